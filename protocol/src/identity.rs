//! Who a certificate speaks for. A node's peer id is the first DNS
//! subject-alternative name of the certificate the cluster CA issued it; the
//! peer plane and the tracker both read it from there (never from a field of a
//! message), so this one rule lives here, beside the messages it governs.

/// Why no peer id could be read from a certificate.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CertificateError {
    #[error("peer certificate: {0}")]
    Unreadable(String),
    #[error("peer certificate has no subject alternative name")]
    NoSubjectAltName,
    #[error("peer certificate names no DNS peer id")]
    NoDnsName,
}

/// The peer id a DER certificate speaks for: its first DNS subject-alternative name.
pub fn peer_id_of(cert_der: &[u8]) -> Result<String, CertificateError> {
    use x509_parser::prelude::*;
    let (_, x509) = X509Certificate::from_der(cert_der)
        .map_err(|e| CertificateError::Unreadable(e.to_string()))?;
    let san = x509
        .subject_alternative_name()
        .map_err(|e| CertificateError::Unreadable(e.to_string()))?
        .ok_or(CertificateError::NoSubjectAltName)?;
    san.value
        .general_names
        .iter()
        .find_map(|n| match n {
            GeneralName::DNSName(d) => Some(d.to_string()),
            _ => None,
        })
        .ok_or(CertificateError::NoDnsName)
}

/// Whether a DER certificate allows TLS client authentication (extended key
/// usage `clientAuth`): node certificates do, the tracker's does not, so a
/// node's certificate cannot pose as the tracker. Unreadable: treated as yes.
pub fn allows_client_auth(cert_der: &[u8]) -> bool {
    use x509_parser::prelude::*;
    let Ok((_, x509)) = X509Certificate::from_der(cert_der) else {
        return true;
    };
    match x509.extended_key_usage() {
        Ok(Some(eku)) => eku.value.client_auth || eku.value.any,
        // No EKU extension: usable for anything.
        Ok(None) => true,
        Err(_) => true,
    }
}

/// When a DER certificate stops being valid, in seconds since the Unix epoch.
pub fn not_after(cert_der: &[u8]) -> Result<i64, CertificateError> {
    use x509_parser::prelude::*;
    let (_, x509) = X509Certificate::from_der(cert_der)
        .map_err(|e| CertificateError::Unreadable(e.to_string()))?;
    Ok(x509.validity().not_after.timestamp())
}
