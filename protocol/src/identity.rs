//! Who a certificate speaks for, and in which role. A node's peer id is the
//! first DNS subject-alternative name of the certificate the cluster CA issued
//! it; its role is a URI subject-alternative name `dray://role/<role>` (see
//! [`Role`]). The peer plane, the DHT and the tracker all read both from the
//! certificate (never from a field of a message), so these rules live here,
//! beside the messages they govern, together with the one place certificates
//! are made ([`Authority`]), used by `dray ca` and by the tracker's signer.

use std::time::Duration;

/// HTTP path of the tracker's certificate signer.
pub const CERTIFICATE_PATH: &str = "/v1/certificate";

/// Every role URI starts with this; the role's name follows.
pub const ROLE_URI_PREFIX: &str = "dray://role/";

/// Longest lifetime a certificate may be issued for: ten years.
pub const MAX_LIFETIME: Duration = Duration::from_secs(10 * 365 * 86_400);

/// Shortest lifetime a certificate may be issued for.
pub const MIN_LIFETIME: Duration = Duration::from_secs(10);

/// What a certificate lets its holder do. Each service accepts one role:
/// the peer plane, the DHT and the tracker's agent API accept nodes only,
/// the tracker's preheat API preheaters only, and agents talk to a tracker
/// only if its certificate is the tracker's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// An agent: serves and fetches chunks, joins the DHT, announces.
    /// Usable for TLS client and server authentication.
    Node,
    /// A CI job or operator starting preheat jobs at the tracker. TLS client
    /// authentication only.
    Preheater,
    /// The tracker. TLS server authentication only.
    Tracker,
}

impl Role {
    pub const ALL: [Role; 3] = [Role::Node, Role::Preheater, Role::Tracker];

    /// The role's name, as in its URI and in messages.
    pub fn name(self) -> &'static str {
        match self {
            Role::Node => "node",
            Role::Preheater => "preheater",
            Role::Tracker => "tracker",
        }
    }

    /// The URI subject-alternative name that carries the role.
    pub fn uri(self) -> String {
        format!("{ROLE_URI_PREFIX}{}", self.name())
    }

    fn from_uri(uri: &str) -> Option<Result<Role, String>> {
        let name = uri.strip_prefix(ROLE_URI_PREFIX)?;
        Some(
            Role::ALL
                .into_iter()
                .find(|r| r.name() == name)
                .ok_or_else(|| name.to_string()),
        )
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Why no peer id or role could be read from a certificate.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CertificateError {
    #[error("peer certificate: {0}")]
    Unreadable(String),
    #[error("peer certificate has no subject alternative name")]
    NoSubjectAltName,
    #[error("peer certificate names no DNS peer id")]
    NoDnsName,
    #[error(
        "the certificate carries no role (no {ROLE_URI_PREFIX}<role> URI name): it was issued before roles existed or by another CA; issue a new one (`dray ca issue`, or the tracker's signer)"
    )]
    NoRole,
    #[error("the certificate names the unknown role {0:?} (known: node, preheater, tracker)")]
    UnknownRole(String),
    #[error("the certificate names more than one role")]
    SeveralRoles,
    #[error("the certificate's role is {got}, and {what} accepts only {wanted}")]
    WrongRole {
        what: &'static str,
        got: Role,
        wanted: Role,
    },
}

fn parse(
    cert_der: &[u8],
) -> Result<x509_parser::certificate::X509Certificate<'_>, CertificateError> {
    use x509_parser::prelude::*;
    let (_, x509) = X509Certificate::from_der(cert_der)
        .map_err(|e| CertificateError::Unreadable(e.to_string()))?;
    Ok(x509)
}

fn general_names<'a>(
    x509: &'a x509_parser::certificate::X509Certificate<'_>,
) -> Result<&'a [x509_parser::extensions::GeneralName<'a>], CertificateError> {
    let san = x509
        .subject_alternative_name()
        .map_err(|e| CertificateError::Unreadable(e.to_string()))?
        .ok_or(CertificateError::NoSubjectAltName)?;
    Ok(&san.value.general_names)
}

/// The peer id a DER certificate speaks for: its first DNS subject-alternative name.
pub fn peer_id_of(cert_der: &[u8]) -> Result<String, CertificateError> {
    use x509_parser::extensions::GeneralName;
    let x509 = parse(cert_der)?;
    general_names(&x509)?
        .iter()
        .find_map(|n| match n {
            GeneralName::DNSName(d) => Some(d.to_string()),
            _ => None,
        })
        .ok_or(CertificateError::NoDnsName)
}

/// The role a DER certificate carries: exactly one `dray://role/<role>` URI
/// subject-alternative name.
pub fn role_of(cert_der: &[u8]) -> Result<Role, CertificateError> {
    use x509_parser::extensions::GeneralName;
    let x509 = parse(cert_der)?;
    let mut roles = general_names(&x509)?.iter().filter_map(|n| match n {
        GeneralName::URI(u) => Role::from_uri(u),
        _ => None,
    });
    let role = roles
        .next()
        .ok_or(CertificateError::NoRole)?
        .map_err(CertificateError::UnknownRole)?;
    if roles.next().is_some() {
        return Err(CertificateError::SeveralRoles);
    }
    Ok(role)
}

/// The peer id of a DER certificate that must carry `wanted`'s role to be
/// accepted by `what` ("the peer plane", "the DHT", ...).
pub fn check_role(
    cert_der: &[u8],
    wanted: Role,
    what: &'static str,
) -> Result<String, CertificateError> {
    let got = role_of(cert_der)?;
    if got != wanted {
        return Err(CertificateError::WrongRole { what, got, wanted });
    }
    peer_id_of(cert_der)
}

/// When a DER certificate starts and stops being valid, in seconds since the
/// Unix epoch.
pub fn validity(cert_der: &[u8]) -> Result<(i64, i64), CertificateError> {
    let x509 = parse(cert_der)?;
    let v = x509.validity();
    Ok((v.not_before.timestamp(), v.not_after.timestamp()))
}

/// When a DER certificate stops being valid, in seconds since the Unix epoch.
pub fn not_after(cert_der: &[u8]) -> Result<i64, CertificateError> {
    Ok(validity(cert_der)?.1)
}

/// Peer ids are DNS names: lowercase letters, digits, '-' and '.', 1..=63 chars.
pub fn check_peer_id(id: &str) -> Result<(), String> {
    let ok = !id.is_empty()
        && id.len() <= 63
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && !id.starts_with(['-', '.'])
        && !id.ends_with(['-', '.']);
    if ok {
        Ok(())
    } else {
        Err(format!(
            "peer id {id:?} must be 1-63 lowercase letters, digits, '-' or '.', not starting or ending with '-' or '.'"
        ))
    }
}

/// Why a certificate could not be made.
#[derive(Debug, thiserror::Error)]
pub enum IssueError {
    #[error("{0}")]
    Invalid(String),
    #[error("the certificate signing request: {0}")]
    Request(String),
    #[error("the cluster CA: {0}")]
    Authority(String),
    #[error("signing the certificate: {0}")]
    Signing(String),
}

/// The cluster CA's signing half: its certificate and key. Every certificate
/// dray uses is made by [`Authority::sign`], with its role's name and key
/// usages.
pub struct Authority {
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    cert_pem: String,
}

impl Authority {
    /// The CA of a PEM certificate and its PEM (PKCS#8) key.
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Self, IssueError> {
        let authority = |e: rcgen::Error| IssueError::Authority(e.to_string());
        let key = rcgen::KeyPair::from_pem(key_pem).map_err(authority)?;
        let issuer = rcgen::Issuer::from_ca_cert_pem(cert_pem, key).map_err(authority)?;
        Ok(Self {
            issuer,
            cert_pem: cert_pem.to_string(),
        })
    }

    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// Signs a certificate for `public_key` in `role`, named `names` (a
    /// node's or preheater's: its peer id; the tracker's: the DNS names and
    /// IP addresses agents reach it by, a DNS name first), valid from
    /// `now` (Unix seconds) for `lifetime`, and backdated by a tenth of
    /// that, at most an hour, for clocks that differ. Answers its PEM.
    pub fn sign(
        &self,
        public_key: &impl rcgen::PublicKeyData,
        names: &[String],
        role: Role,
        now: i64,
        lifetime: Duration,
    ) -> Result<String, IssueError> {
        use rcgen::{DnType, ExtendedKeyUsagePurpose as Eku, SanType};
        if !(MIN_LIFETIME..=MAX_LIFETIME).contains(&lifetime) {
            return Err(IssueError::Invalid(format!(
                "a certificate's lifetime must be {} to {} days, not {lifetime:?}",
                humantime::format_duration(MIN_LIFETIME),
                MAX_LIFETIME.as_secs() / 86_400
            )));
        }
        check_names(names, role)?;
        let signing = |e: rcgen::Error| IssueError::Signing(e.to_string());
        let mut params = rcgen::CertificateParams::new(names.to_vec()).map_err(signing)?;
        let uri = rcgen::string::Ia5String::try_from(role.uri()).map_err(signing)?;
        params.subject_alt_names.push(SanType::URI(uri));
        let common_name = match role {
            Role::Tracker => format!("dray tracker {}", names[0]),
            Role::Node | Role::Preheater => names[0].clone(),
        };
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        params.extended_key_usages = match role {
            Role::Node => vec![Eku::ServerAuth, Eku::ClientAuth],
            Role::Preheater => vec![Eku::ClientAuth],
            Role::Tracker => vec![Eku::ServerAuth],
        };
        let backdate = (lifetime / 10).min(Duration::from_secs(3_600));
        let at = |secs: i64| {
            time::OffsetDateTime::from_unix_timestamp(secs)
                .map_err(|e| IssueError::Invalid(format!("time {secs}: {e}")))
        };
        params.not_before = at(now - backdate.as_secs() as i64)?;
        params.not_after = at(now + lifetime.as_secs() as i64)?;
        params.serial_number = Some(serial(public_key.der_bytes(), names, role, now));
        let cert = params
            .signed_by(public_key, &self.issuer)
            .map_err(signing)?;
        Ok(cert.pem())
    }

    /// Signs a certificate for the key of a PEM certificate signing request,
    /// whose self-signature is checked. A request may name `peer_id` (as its
    /// common name or DNS names) or nothing; one naming anything else is
    /// refused. Only its key is used: the name, role and lifetime are the
    /// signer's decision.
    pub fn sign_request(
        &self,
        csr_pem: &str,
        peer_id: &str,
        role: Role,
        now: i64,
        lifetime: Duration,
    ) -> Result<String, IssueError> {
        let request = |e: String| IssueError::Request(e);
        let (_, pem) = x509_parser::pem::parse_x509_pem(csr_pem.as_bytes())
            .map_err(|e| request(format!("not PEM: {e}")))?;
        if pem.label != "CERTIFICATE REQUEST" {
            return Err(request(format!(
                "a PEM {:?}, not a CERTIFICATE REQUEST",
                pem.label
            )));
        }
        let csr = rcgen::CertificateSigningRequestParams::from_der(&pem.contents.as_slice().into())
            .map_err(|e| request(e.to_string()))?;
        if let Some(other) = requested_names(&pem.contents)?
            .into_iter()
            .find(|n| n != peer_id)
        {
            return Err(request(format!(
                "it asks for {other:?}, and its caller may be issued only {peer_id:?}"
            )));
        }
        self.sign(&csr.public_key, &[peer_id.to_string()], role, now, lifetime)
    }
}

/// The names a DER certificate signing request asks for: its common names
/// and subject-alternative names (a name that is not a DNS name, written as
/// x509-parser shows it, so that it never equals a peer id).
fn requested_names(csr_der: &[u8]) -> Result<Vec<String>, IssueError> {
    use x509_parser::extensions::{GeneralName, ParsedExtension};
    use x509_parser::prelude::FromDer;
    let (_, csr) = x509_parser::certification_request::X509CertificationRequest::from_der(csr_der)
        .map_err(|e| IssueError::Request(e.to_string()))?;
    let mut names: Vec<String> = csr
        .certification_request_info
        .subject
        .iter_common_name()
        .map(|cn| {
            cn.as_str()
                .map_or_else(|_| format!("{cn:?}"), str::to_string)
        })
        .collect();
    for ext in csr.requested_extensions().into_iter().flatten() {
        if let ParsedExtension::SubjectAlternativeName(san) = ext {
            names.extend(san.general_names.iter().map(|n| match n {
                GeneralName::DNSName(d) => d.to_string(),
                other => format!("the name {other:?}"),
            }));
        }
    }
    Ok(names)
}

fn check_names(names: &[String], role: Role) -> Result<(), IssueError> {
    let invalid = |m: String| Err(IssueError::Invalid(m));
    let first_is_dns = names
        .first()
        .is_some_and(|n| n.parse::<std::net::IpAddr>().is_err());
    if !first_is_dns {
        return invalid(format!(
            "a {role} certificate needs a DNS name first, got {names:?}"
        ));
    }
    if role != Role::Tracker && names.len() != 1 {
        return invalid(format!(
            "a {role} certificate names exactly one peer id, got {names:?}"
        ));
    }
    for n in names {
        if n.parse::<std::net::IpAddr>().is_err() {
            check_peer_id(n).map_err(IssueError::Invalid)?;
        }
    }
    Ok(())
}

/// A serial number unique to what is signed and when (RFC 5280: positive,
/// at most 20 bytes), so that a key renewed under the same name gets a new one.
fn serial(key: &[u8], names: &[String], role: Role, now: i64) -> rcgen::SerialNumber {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    h.update(key);
    for n in names {
        h.update(n.as_bytes());
        h.update([0]);
    }
    h.update(role.name());
    h.update(now.to_be_bytes());
    let mut bytes = h.finalize()[..16].to_vec();
    bytes[0] &= 0x7f;
    rcgen::SerialNumber::from_slice(&bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ca() -> Authority {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::default();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let cert = params.self_signed(&key).unwrap();
        Authority::from_pem(&cert.pem(), &key.serialize_pem()).unwrap()
    }

    fn der(pem: &str) -> Vec<u8> {
        x509_parser::pem::parse_x509_pem(pem.as_bytes())
            .unwrap()
            .1
            .contents
    }

    #[test]
    fn a_signed_certificate_carries_its_peer_id_role_and_lifetime() {
        let ca = ca();
        let key = rcgen::KeyPair::generate().unwrap();
        let day = Duration::from_secs(86_400);
        for role in Role::ALL {
            let pem = ca
                .sign(&key, &["node-1".into()], role, 1_000_000, day)
                .unwrap();
            let cert = der(&pem);
            assert_eq!(peer_id_of(&cert).unwrap(), "node-1");
            assert_eq!(role_of(&cert).unwrap(), role);
            assert_eq!(
                validity(&cert).unwrap(),
                (1_000_000 - 3_600, 1_000_000 + 86_400)
            );
        }
        let preheater = der(&ca
            .sign(&key, &["ci".into()], Role::Preheater, 0, day)
            .unwrap());
        assert_eq!(
            check_role(&preheater, Role::Node, "the peer plane"),
            Err(CertificateError::WrongRole {
                what: "the peer plane",
                got: Role::Preheater,
                wanted: Role::Node
            })
        );
        assert!(
            ca.sign(&key, &["a".into(), "b".into()], Role::Node, 0, day)
                .is_err()
        );
        assert!(
            ca.sign(
                &key,
                &["node-1".into()],
                Role::Node,
                0,
                Duration::from_secs(1)
            )
            .is_err()
        );
    }

    #[test]
    fn a_certificate_without_a_role_or_with_two_is_refused() {
        let key = rcgen::KeyPair::generate().unwrap();
        let plain = rcgen::CertificateParams::new(vec!["node-1".to_string()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        assert_eq!(role_of(plain.der()), Err(CertificateError::NoRole));
        let mut two = rcgen::CertificateParams::new(vec!["node-1".to_string()]).unwrap();
        for r in ["node", "preheater"] {
            two.subject_alt_names.push(rcgen::SanType::URI(
                format!("{ROLE_URI_PREFIX}{r}").try_into().unwrap(),
            ));
        }
        let two = two.self_signed(&key).unwrap();
        assert_eq!(role_of(two.der()), Err(CertificateError::SeveralRoles));
        let mut odd = rcgen::CertificateParams::new(vec!["node-1".to_string()]).unwrap();
        odd.subject_alt_names.push(rcgen::SanType::URI(
            format!("{ROLE_URI_PREFIX}admin").try_into().unwrap(),
        ));
        let odd = odd.self_signed(&key).unwrap();
        assert_eq!(
            role_of(odd.der()),
            Err(CertificateError::UnknownRole("admin".into()))
        );
    }

    #[test]
    fn a_request_contributes_only_its_key_may_name_only_its_caller_and_must_be_self_signed() {
        let ca = ca();
        let key = rcgen::KeyPair::generate().unwrap();
        let request = |names: Vec<String>| {
            let mut params = rcgen::CertificateParams::new(names).unwrap();
            // rcgen's default common name is a name of its own.
            params.distinguished_name = rcgen::DistinguishedName::new();
            params.serialize_request(&key).unwrap().pem().unwrap()
        };
        let err = ca
            .sign_request(
                &request(vec!["node-2".into()]),
                "node-1",
                Role::Node,
                0,
                Duration::from_secs(600),
            )
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("it asks for \"node-2\", and its caller may be issued only \"node-1\""),
            "{err}"
        );
        ca.sign_request(
            &request(vec![]),
            "node-1",
            Role::Node,
            0,
            Duration::from_secs(600),
        )
        .unwrap();
        let csr = request(vec!["node-1".into()]);
        let pem = ca
            .sign_request(&csr, "node-1", Role::Node, 0, Duration::from_secs(600))
            .unwrap();
        let cert = der(&pem);
        assert_eq!(peer_id_of(&cert).unwrap(), "node-1");
        let (_, x509) = x509_parser::parse_x509_certificate(&cert).unwrap();
        assert_eq!(
            x509.public_key().raw,
            rcgen::PublicKeyData::subject_public_key_info(&key)
        );
        // A request whose signature does not match its key: one bit of
        // the signature, near the end of the PEM body, flipped.
        let mut lines: Vec<String> = csr.lines().map(str::to_string).collect();
        let body = lines.len() - 2;
        let mut chars: Vec<char> = lines[body].chars().collect();
        let at = chars.iter().rposition(|c| *c != '=').unwrap() - 1;
        chars[at] = if chars[at] == 'A' { 'B' } else { 'A' };
        lines[body] = chars.into_iter().collect();
        let tampered = lines.join("\n") + "\n";
        assert!(matches!(
            ca.sign_request(&tampered, "node-1", Role::Node, 0, Duration::from_secs(600)),
            Err(IssueError::Request(_))
        ));
    }
}
