//! Peer identities and mutual TLS: a cluster CA signs one certificate per agent,
//! whose DNS subject-alternative name is the agent's peer id. Both ends of every
//! peer connection present a certificate and check the other's against the CA;
//! an agent whose certificate the CA did not sign is refused during the handshake.
//!
//! The tracker gets a certificate from the same CA, for the DNS names and
//! addresses agents reach it by, usable for TLS server authentication only: the
//! agents' tracker client checks it against the CA and the URL's host, and
//! refuses a certificate that also allows client authentication (a node's), so
//! a compromised node cannot pose as the tracker. The tracker asks agents for
//! their certificate and reads the caller's peer id from it.

use crate::error::{Error, Result};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use std::path::Path;
use std::sync::Arc;

/// ALPN protocol id of dray's peer protocol.
pub const ALPN: &[u8] = b"dray/1";

/// ALPN protocol id of the tracker's HTTP/1.1 over TLS.
pub const TRACKER_ALPN: &[u8] = b"http/1.1";

/// ALPN protocol id of the DHT's TLS ([`crate::dht`]).
pub const DHT_ALPN: &[u8] = b"dray-dht/1";

/// Lifetime of an issued certificate unless told otherwise: a year.
pub const DEFAULT_VALIDITY_DAYS: u32 = 365;

/// A certificate ending within this many days is logged at warn when it is
/// loaded (and its end is exported as a metric for alerts before then).
pub const EXPIRY_WARNING_DAYS: i64 = 30;

/// The warning for a certificate of `what` ending at `not_after` (Unix
/// seconds), if it ends within [`EXPIRY_WARNING_DAYS`] of `now`.
pub fn expiry_warning(what: &str, not_after: i64, now: i64) -> Option<String> {
    let left = not_after - now;
    if left > EXPIRY_WARNING_DAYS * 86_400 {
        return None;
    }
    Some(if left <= 0 {
        format!(
            "the {what} certificate expired {} days ago: peers and the tracker refuse it; issue a new one (docs/operator-guide.md, rotating certificates)",
            -left / 86_400
        )
    } else {
        format!(
            "the {what} certificate expires in {} days: issue a new one before then (docs/operator-guide.md, rotating certificates)",
            left / 86_400
        )
    })
}

/// A cluster certificate authority (its certificate and signing key, PEM).
#[derive(Clone)]
pub struct ClusterCa {
    pub cert_pem: String,
    pub key_pem: String,
}

/// An agent's certificate chain and key, plus the CA it trusts.
#[derive(Clone)]
pub struct Identity {
    pub peer_id: String,
    cert: CertificateDer<'static>,
    key: Arc<PrivatePkcs8KeyDer<'static>>,
    /// Every CA certificate of the `ca` file: during a CA rotation it holds
    /// the old CA and the new one, and certificates of either are accepted.
    cas: Vec<CertificateDer<'static>>,
    cert_pem: String,
    key_pem: String,
}

/// Peer ids are DNS names: lowercase letters, digits, '-' and '.', 1..=63 chars.
pub fn check_peer_id(id: &str) -> Result<()> {
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
        Err(Error::Config(format!(
            "peer id {id:?} must be 1-63 lowercase letters, digits, '-' or '.', not starting or ending with '-' or '.'"
        )))
    }
}

impl ClusterCa {
    /// A new CA with a fresh key.
    pub fn generate() -> Result<Self> {
        let key = KeyPair::generate().map_err(tls_err)?;
        let cert = ca_params(&key).self_signed(&key).map_err(tls_err)?;
        Ok(Self {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }

    pub fn load(cert: &Path, key: &Path) -> Result<Self> {
        Ok(Self {
            cert_pem: read_text(cert)?,
            key_pem: read_text(key)?,
        })
    }

    /// Signs a certificate for `peer_id`, usable as both TLS client and
    /// server, valid for [`DEFAULT_VALIDITY_DAYS`].
    pub fn issue(&self, peer_id: &str) -> Result<Identity> {
        self.issue_for_days(peer_id, DEFAULT_VALIDITY_DAYS)
    }

    /// Signs a certificate for `peer_id` valid from an hour ago (clocks
    /// differ) for `days` days.
    pub fn issue_for_days(&self, peer_id: &str, days: u32) -> Result<Identity> {
        check_peer_id(peer_id)?;
        let mut params = CertificateParams::new(vec![peer_id.to_string()]).map_err(tls_err)?;
        params.distinguished_name.push(DnType::CommonName, peer_id);
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        self.sign(params, days)
    }

    /// Signs the tracker's certificate for `names`, the DNS names and IP
    /// addresses agents reach it by (the first must be a DNS name), usable for
    /// TLS server authentication only, valid for `days` days.
    pub fn issue_tracker(&self, names: &[String], days: u32) -> Result<Identity> {
        let first_is_dns = names
            .first()
            .is_some_and(|n| n.parse::<std::net::IpAddr>().is_err());
        if !first_is_dns {
            return Err(Error::Config(format!(
                "the tracker's certificate needs a DNS name first (the name agents reach it by), got {names:?}"
            )));
        }
        for n in names {
            if n.parse::<std::net::IpAddr>().is_err() {
                check_peer_id(n).map_err(|_| {
                    Error::Config(format!(
                        "tracker name {n:?} must be an IP address or a DNS name of lowercase letters, digits, '-' and '.'"
                    ))
                })?;
            }
        }
        let mut params = CertificateParams::new(names.to_vec()).map_err(tls_err)?;
        params
            .distinguished_name
            .push(DnType::CommonName, format!("dray tracker {}", names[0]));
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        self.sign(params, days)
    }

    fn sign(&self, mut params: CertificateParams, days: u32) -> Result<Identity> {
        if days == 0 {
            return Err(Error::Config(
                "a certificate must be valid for at least 1 day".into(),
            ));
        }
        let now = time::OffsetDateTime::now_utc();
        params.not_before = now - time::Duration::hours(1);
        params.not_after = now + time::Duration::days(i64::from(days));
        let ca_key = KeyPair::from_pem(&self.key_pem).map_err(tls_err)?;
        let issuer = Issuer::from_ca_cert_pem(&self.cert_pem, ca_key).map_err(tls_err)?;
        let key = KeyPair::generate().map_err(tls_err)?;
        let cert = params.signed_by(&key, &issuer).map_err(tls_err)?;
        Identity::from_pem(&cert.pem(), &key.serialize_pem(), &self.cert_pem)
    }
}

/// CA parameters. The name carries a fingerprint of the key, so that two
/// clusters' CAs never share a name and a foreign certificate is reported as
/// coming from an unknown issuer.
fn ca_params(key: &KeyPair) -> CertificateParams {
    use sha2::Digest;
    let fingerprint = hex::encode(&sha2::Sha256::digest(key.public_key_raw())[..6]);
    let mut params = CertificateParams::default();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(DnType::CommonName, format!("dray cluster CA {fingerprint}"));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params
}

fn tls_err(e: impl std::fmt::Display) -> Error {
    Error::Tls(e.to_string())
}

fn read_text(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|e| Error::io(format!("reading {}", path.display()), e))
}

fn one_cert(pem: &str, what: &str) -> Result<CertificateDer<'static>> {
    let mut reader = pem.as_bytes();
    let first = rustls_pemfile::certs(&mut reader).next();
    match first {
        Some(Ok(c)) => Ok(c),
        Some(Err(e)) => Err(Error::Tls(format!("{what}: {e}"))),
        None => Err(Error::Tls(format!("{what}: no PEM certificate found"))),
    }
}

impl Identity {
    /// Builds an identity from PEM text; the peer id is read from the certificate.
    pub fn from_pem(cert_pem: &str, key_pem: &str, ca_pem: &str) -> Result<Self> {
        let cert = one_cert(cert_pem, "agent certificate")?;
        let cas = rustls_pemfile::certs(&mut ca_pem.as_bytes())
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| Error::Tls(format!("cluster CA certificate: {e}")))?;
        if cas.is_empty() {
            return Err(Error::Tls(
                "cluster CA certificate: no PEM certificate found".into(),
            ));
        }
        let key = match rustls_pemfile::private_key(&mut key_pem.as_bytes()) {
            Ok(Some(PrivateKeyDer::Pkcs8(k))) => k,
            Ok(Some(_)) => return Err(Error::Tls("agent key must be PKCS#8 PEM".into())),
            Ok(None) => return Err(Error::Tls("agent key: no PEM private key found".into())),
            Err(e) => return Err(Error::Tls(format!("agent key: {e}"))),
        };
        let peer_id = peer_id_of(&cert)?;
        Ok(Self {
            peer_id,
            cert,
            key: Arc::new(key),
            cas,
            cert_pem: cert_pem.to_string(),
            key_pem: key_pem.to_string(),
        })
    }

    pub fn load(cert: &Path, key: &Path, ca: &Path) -> Result<Self> {
        Self::from_pem(&read_text(cert)?, &read_text(key)?, &read_text(ca)?)
    }

    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// When this certificate ends, in seconds since the Unix epoch.
    pub fn not_after(&self) -> Result<i64> {
        dray_protocol::identity::not_after(&self.cert).map_err(|e| Error::Tls(e.to_string()))
    }

    /// Logs at warn when this certificate (of `what`: "agent", "tracker")
    /// ends within [`EXPIRY_WARNING_DAYS`]; returns when it ends.
    pub fn warn_if_expiring(&self, what: &str) -> Result<i64> {
        let not_after = self.not_after()?;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() as i64);
        if let Some(w) = expiry_warning(what, not_after, now) {
            tracing::warn!(peer_id = %self.peer_id, not_after, "{w}");
        }
        Ok(not_after)
    }

    pub fn key_pem(&self) -> &str {
        &self.key_pem
    }

    fn roots(&self) -> Result<Arc<rustls::RootCertStore>> {
        let mut roots = rustls::RootCertStore::empty();
        for ca in &self.cas {
            roots.add(ca.clone()).map_err(tls_err)?;
        }
        Ok(Arc::new(roots))
    }

    /// TLS for accepting peers: a client certificate signed by the CA is required.
    pub fn server_tls(&self) -> Result<rustls::ServerConfig> {
        self.server_config(false, ALPN)
    }

    /// TLS 1.3 serving our certificate, client certificates checked against
    /// the CA (required, or only checked when offered).
    fn server_config(&self, optional_client: bool, alpn: &[u8]) -> Result<rustls::ServerConfig> {
        let builder =
            rustls::server::WebPkiClientVerifier::builder_with_provider(self.roots()?, provider());
        let builder = if optional_client {
            builder.allow_unauthenticated()
        } else {
            builder
        };
        let verifier = builder.build().map_err(tls_err)?;
        let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls_err)?
            .with_client_cert_verifier(verifier)
            .with_single_cert(
                vec![self.cert.clone()],
                PrivateKeyDer::Pkcs8(self.key.clone_key()),
            )
            .map_err(tls_err)?;
        cfg.alpn_protocols = vec![alpn.to_vec()];
        Ok(cfg)
    }

    /// TLS for dialling peers: the server must hold a CA-signed certificate for
    /// the peer id we dial, and we present ours.
    pub fn client_tls(&self) -> Result<rustls::ClientConfig> {
        let mut cfg = rustls::ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls_err)?
            .with_root_certificates(self.roots()?)
            .with_client_auth_cert(
                vec![self.cert.clone()],
                PrivateKeyDer::Pkcs8(self.key.clone_key()),
            )
            .map_err(tls_err)?;
        cfg.alpn_protocols = vec![ALPN.to_vec()];
        Ok(cfg)
    }

    /// TLS for the tracker's listener: its certificate, and a client
    /// certificate signed by the CA checked when one is offered. One is
    /// optional at the handshake so that probes and Prometheus reach
    /// `/healthz`, `/readyz` and `/metrics`; the tracker API refuses a
    /// request without one.
    pub fn tracker_server_tls(&self) -> Result<rustls::ServerConfig> {
        self.server_config(true, TRACKER_ALPN)
    }

    /// TLS for talking to the tracker: its certificate must be signed by the
    /// CA for the host dialled and must not be a node's; we present ours.
    pub fn tracker_client_tls(&self) -> Result<rustls::ClientConfig> {
        self.checked_client(ServerRole::Tracker, TRACKER_ALPN)
    }

    /// TLS for accepting DHT connections: as the peer plane's, under
    /// [`DHT_ALPN`].
    pub fn dht_server_tls(&self) -> Result<rustls::ServerConfig> {
        self.server_config(false, DHT_ALPN)
    }

    /// TLS for dialling DHT nodes: the server must hold a node certificate
    /// the CA signed (for any peer id: whom a bootstrap address reaches is
    /// not known before), and we present ours.
    pub fn dht_client_tls(&self) -> Result<rustls::ClientConfig> {
        self.checked_client(ServerRole::Member, DHT_ALPN)
    }

    fn checked_client(&self, role: ServerRole, alpn: &[u8]) -> Result<rustls::ClientConfig> {
        let webpki =
            rustls::client::WebPkiServerVerifier::builder_with_provider(self.roots()?, provider())
                .build()
                .map_err(tls_err)?;
        let mut cfg = rustls::ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls_err)?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(ServerVerifier { webpki, role }))
            .with_client_auth_cert(
                vec![self.cert.clone()],
                PrivateKeyDer::Pkcs8(self.key.clone_key()),
            )
            .map_err(tls_err)?;
        cfg.alpn_protocols = vec![alpn.to_vec()];
        Ok(cfg)
    }
}

/// Whom a server certificate must belong to, beyond the CA's signature.
#[derive(Debug, Clone, Copy)]
enum ServerRole {
    /// The tracker, for the host dialled. A certificate that allows client
    /// authentication is a node's, and a node (even one whose peer id
    /// matches the tracker's host name) is not the tracker.
    Tracker,
    /// Any node, whatever name was dialled (a DHT bootstrap address names
    /// no node): the certificate must be valid for the peer id it carries
    /// and allow client authentication, as every node's does.
    Member,
}

/// The CA's WebPKI check of a server's certificate, plus its role's rule.
#[derive(Debug)]
struct ServerVerifier {
    webpki: Arc<rustls::client::WebPkiServerVerifier>,
    role: ServerRole,
}

impl rustls::client::danger::ServerCertVerifier for ServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &rustls::pki_types::ServerName<'_>,
        ocsp_response: &[u8],
        now: rustls::pki_types::UnixTime,
    ) -> std::result::Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        let general = |e: String| rustls::Error::General(e);
        let node = dray_protocol::identity::allows_client_auth(end_entity);
        match self.role {
            ServerRole::Tracker => {
                let verified = self.webpki.verify_server_cert(
                    end_entity,
                    intermediates,
                    server_name,
                    ocsp_response,
                    now,
                )?;
                if node {
                    return Err(general(format!(
                        "the certificate {server_name:?} presented as the tracker is a node's (it allows client authentication); the tracker's comes from `dray ca issue --tracker`"
                    )));
                }
                Ok(verified)
            }
            ServerRole::Member => {
                let name = peer_id_of(end_entity).map_err(|e| general(e.to_string()))?;
                let name = rustls::pki_types::ServerName::try_from(name)
                    .map_err(|e| general(format!("a node certificate's peer id: {e}")))?;
                let verified = self.webpki.verify_server_cert(
                    end_entity,
                    intermediates,
                    &name,
                    ocsp_response,
                    now,
                )?;
                if !node {
                    return Err(general(
                        "the certificate is not a node's (it allows no client authentication)"
                            .into(),
                    ));
                }
                Ok(verified)
            }
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> std::result::Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> std::result::Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.webpki.supported_verify_schemes()
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The peer id a certificate speaks for: its first DNS subject-alternative name.
pub fn peer_id_of(cert: &CertificateDer<'_>) -> Result<String> {
    dray_protocol::identity::peer_id_of(cert).map_err(|e| Error::Tls(e.to_string()))
}

/// The peer id proven by a QUIC connection's client or server certificate.
pub fn connection_peer_id(conn: &quinn::Connection) -> Result<String> {
    let certs = conn
        .peer_identity()
        .and_then(|any| any.downcast::<Vec<CertificateDer<'static>>>().ok())
        .ok_or_else(|| Error::Tls("peer presented no certificate".into()))?;
    let leaf = certs
        .first()
        .ok_or_else(|| Error::Tls("peer presented an empty certificate chain".into()))?;
    peer_id_of(leaf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_certificate_ending_within_30_days_gets_a_warning_naming_the_days_left() {
        let ca = ClusterCa::generate().unwrap();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64;
        let year = ca.issue("node-1").unwrap().not_after().unwrap();
        assert!((year - now - 365 * 86_400).abs() < 86_400, "{}", year - now);
        assert_eq!(expiry_warning("agent", year, now), None);
        let soon = ca
            .issue_for_days("node-1", 10)
            .unwrap()
            .not_after()
            .unwrap();
        let w = expiry_warning("agent", soon, now).unwrap();
        assert!(
            w.starts_with("the agent certificate expires in 9 days")
                || w.starts_with("the agent certificate expires in 10 days"),
            "{w}"
        );
        let w = expiry_warning("tracker", now - 3 * 86_400, now).unwrap();
        assert!(
            w.starts_with("the tracker certificate expired 3 days ago"),
            "{w}"
        );
    }

    #[test]
    fn issued_identity_round_trips_through_pem() {
        let ca = ClusterCa::generate().unwrap();
        let id = ca.issue("node-1.dray").unwrap();
        assert_eq!(id.peer_id, "node-1.dray");
        let again = Identity::from_pem(id.cert_pem(), id.key_pem(), &ca.cert_pem).unwrap();
        assert_eq!(again.peer_id, "node-1.dray");
        assert_eq!(again.cert, id.cert);
        assert!(ca.issue("Bad_Name").is_err());
        id.server_tls().unwrap();
        id.client_tls().unwrap();
    }
}
