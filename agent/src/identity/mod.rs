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

pub mod enroll;

use crate::error::{Error, Result};
use dray_protocol::identity::{Authority, Role};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::sign::CertifiedKey;
use std::path::Path;
use std::sync::{Arc, RwLock};
use std::time::Duration;

/// ALPN protocol id of dray's peer protocol.
pub const ALPN: &[u8] = b"dray/1";

/// ALPN protocol id of the tracker's HTTP/1.1 over TLS.
pub const TRACKER_ALPN: &[u8] = b"http/1.1";

/// ALPN protocol id of the DHT's TLS ([`crate::discovery::dht`]).
pub const DHT_ALPN: &[u8] = b"dray-dht/1";

/// Lifetime of a certificate `dray ca issue` makes unless told otherwise: a year.
pub const DEFAULT_VALIDITY_DAYS: u32 = 365;

/// A certificate ending within this many days is logged at warn when it is
/// loaded (and its end is exported as a metric for alerts before then).
pub const EXPIRY_WARNING_DAYS: i64 = 30;

/// The warning for a certificate of `what` ending at `not_after` (Unix
/// seconds), if it ends within [`EXPIRY_WARNING_DAYS`] of `now` and within
/// a quarter of its `lifetime` (a short-lived certificate renewed by the
/// agent is not worth a warning until its renewal is late).
pub fn expiry_warning(what: &str, not_after: i64, lifetime: i64, now: i64) -> Option<String> {
    let left = not_after - now;
    if left > EXPIRY_WARNING_DAYS * 86_400 || left > lifetime / 4 {
        return None;
    }
    Some(if left <= 0 {
        format!(
            "the {what} certificate expired {} ago: peers and the tracker refuse it; renew it (docs/operator-guide.md, rotating certificates)",
            roughly(-left)
        )
    } else {
        format!(
            "the {what} certificate expires in {}: renew it before then (docs/operator-guide.md, rotating certificates)",
            roughly(left)
        )
    })
}

/// Seconds as whole days, hours or minutes, whichever reads best.
fn roughly(secs: i64) -> String {
    match secs {
        s if s >= 2 * 86_400 => format!("{} days", s / 86_400),
        s if s >= 2 * 3_600 => format!("{} hours", s / 3_600),
        s => format!("{} minutes", s / 60),
    }
}

/// A cluster certificate authority (its certificate and signing key, PEM).
#[derive(Clone)]
pub struct ClusterCa {
    pub cert_pem: String,
    pub key_pem: String,
}

/// Peer ids are DNS names: lowercase letters, digits, '-' and '.', 1..=63 chars.
pub fn check_peer_id(id: &str) -> Result<()> {
    dray_protocol::identity::check_peer_id(id).map_err(Error::Config)
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

    /// The signing half, as the tracker's signer holds it.
    pub fn authority(&self) -> Result<Authority> {
        Authority::from_pem(&self.cert_pem, &self.key_pem).map_err(tls_err)
    }

    /// Signs a node certificate for `peer_id`, valid for
    /// [`DEFAULT_VALIDITY_DAYS`].
    pub fn issue(&self, peer_id: &str) -> Result<Identity> {
        self.issue_for_days(peer_id, DEFAULT_VALIDITY_DAYS)
    }

    /// Signs a node certificate for `peer_id`, valid for `days` days.
    pub fn issue_for_days(&self, peer_id: &str, days: u32) -> Result<Identity> {
        self.issue_role(peer_id, Role::Node, days_long(days)?)
    }

    /// Signs a certificate for `peer_id` in `role` (node or preheater)
    /// with a fresh key, valid for `lifetime`.
    pub fn issue_role(&self, peer_id: &str, role: Role, lifetime: Duration) -> Result<Identity> {
        self.sign(&[peer_id.to_string()], role, lifetime)
    }

    /// Signs the tracker's certificate for `names`, the DNS names and IP
    /// addresses agents reach it by (the first must be a DNS name), usable for
    /// TLS server authentication only, valid for `days` days.
    pub fn issue_tracker(&self, names: &[String], days: u32) -> Result<Identity> {
        self.sign(names, Role::Tracker, days_long(days)?)
    }

    fn sign(&self, names: &[String], role: Role, lifetime: Duration) -> Result<Identity> {
        let key = KeyPair::generate().map_err(tls_err)?;
        let cert = self
            .authority()?
            .sign(&key, names, role, unix_now(), lifetime)
            .map_err(|e| Error::Config(e.to_string()))?;
        Identity::from_pem(&cert, &key.serialize_pem(), &self.cert_pem)
    }
}

fn days_long(days: u32) -> Result<Duration> {
    if days == 0 {
        return Err(Error::Config(
            "a certificate must be valid for at least 1 day".into(),
        ));
    }
    Ok(Duration::from_secs(u64::from(days) * 86_400))
}

/// Seconds since the Unix epoch, now.
pub(crate) fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
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

/// A certificate with its key, as loaded: what an [`Identity`] presents now.
struct Current {
    cert: CertificateDer<'static>,
    certified: Arc<CertifiedKey>,
    cert_pem: String,
    key_pem: String,
}

impl Current {
    fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Self> {
        let cert = one_cert(cert_pem, "agent certificate")?;
        let key = match rustls_pemfile::private_key(&mut key_pem.as_bytes()) {
            Ok(Some(PrivateKeyDer::Pkcs8(k))) => k,
            Ok(Some(_)) => return Err(Error::Tls("agent key must be PKCS#8 PEM".into())),
            Ok(None) => return Err(Error::Tls("agent key: no PEM private key found".into())),
            Err(e) => return Err(Error::Tls(format!("agent key: {e}"))),
        };
        let certified = CertifiedKey::from_der(
            vec![cert.clone()],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.secret_pkcs8_der().to_vec())),
            &provider(),
        )
        .map_err(|e| Error::Tls(format!("agent certificate and key: {e}")))?;
        Ok(Self {
            cert,
            certified: Arc::new(certified),
            cert_pem: cert_pem.to_string(),
            key_pem: key_pem.to_string(),
        })
    }
}

/// An agent's certificate and key, plus the CA it trusts. Clones share the
/// certificate: [`Identity::renew`] replaces it for every clone and every
/// TLS configuration made from any of them, so the next handshake presents
/// the new one (connections already open keep theirs).
#[derive(Clone)]
pub struct Identity {
    pub peer_id: String,
    pub role: Role,
    current: Arc<RwLock<Current>>,
    /// Every CA certificate of the `ca` file: during a CA rotation it holds
    /// the old CA and the new one, and certificates of either are accepted.
    cas: Vec<CertificateDer<'static>>,
}

/// What the TLS configurations of an [`Identity`] present: its current
/// certificate, read at each handshake.
#[derive(Debug)]
struct Presented(Arc<RwLock<Current>>);

impl std::fmt::Debug for Current {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the identity's current certificate")
    }
}

impl Presented {
    fn now(&self) -> Arc<CertifiedKey> {
        self.0
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .certified
            .clone()
    }
}

impl rustls::server::ResolvesServerCert for Presented {
    fn resolve(&self, _: rustls::server::ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.now())
    }
}

impl rustls::client::ResolvesClientCert for Presented {
    fn resolve(&self, _: &[&[u8]], _: &[rustls::SignatureScheme]) -> Option<Arc<CertifiedKey>> {
        Some(self.now())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

impl Identity {
    /// Builds an identity from PEM text; the peer id and role are read from
    /// the certificate.
    pub fn from_pem(cert_pem: &str, key_pem: &str, ca_pem: &str) -> Result<Self> {
        let current = Current::from_pem(cert_pem, key_pem)?;
        let cas = rustls_pemfile::certs(&mut ca_pem.as_bytes())
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| Error::Tls(format!("cluster CA certificate: {e}")))?;
        if cas.is_empty() {
            return Err(Error::Tls(
                "cluster CA certificate: no PEM certificate found".into(),
            ));
        }
        let peer_id = peer_id_of(&current.cert)?;
        let role = dray_protocol::identity::role_of(&current.cert).map_err(tls_err)?;
        Ok(Self {
            peer_id,
            role,
            current: Arc::new(RwLock::new(current)),
            cas,
        })
    }

    pub fn load(cert: &Path, key: &Path, ca: &Path) -> Result<Self> {
        Self::from_pem(&read_text(cert)?, &read_text(key)?, &read_text(ca)?)
    }

    /// Replaces the certificate and key every clone presents with a renewed
    /// pair, which must name the same peer id and role.
    pub fn renew(&self, cert_pem: &str, key_pem: &str) -> Result<()> {
        let next = Current::from_pem(cert_pem, key_pem)?;
        let (peer_id, role) = (
            peer_id_of(&next.cert)?,
            dray_protocol::identity::role_of(&next.cert).map_err(tls_err)?,
        );
        if peer_id != self.peer_id || role != self.role {
            return Err(Error::Tls(format!(
                "a renewed certificate for {peer_id:?} as {role} cannot replace {:?}'s as {}",
                self.peer_id, self.role
            )));
        }
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = next;
        Ok(())
    }

    /// Refuses an identity not in `wanted`'s role, for `what` ("the agent").
    pub fn require_role(&self, wanted: Role, what: &str) -> Result<()> {
        if self.role == wanted {
            return Ok(());
        }
        Err(Error::Config(format!(
            "{what} needs a {wanted} certificate, and {:?}'s is a {}'s (docs/operator-guide.md, identities)",
            self.peer_id, self.role
        )))
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Current> {
        self.current.read().unwrap_or_else(|p| p.into_inner())
    }

    pub fn cert_pem(&self) -> String {
        self.read().cert_pem.clone()
    }

    pub fn key_pem(&self) -> String {
        self.read().key_pem.clone()
    }

    /// When this certificate starts and ends, in seconds since the Unix epoch.
    pub fn validity(&self) -> Result<(i64, i64)> {
        dray_protocol::identity::validity(&self.read().cert).map_err(tls_err)
    }

    /// When this certificate ends, in seconds since the Unix epoch.
    pub fn not_after(&self) -> Result<i64> {
        Ok(self.validity()?.1)
    }

    /// Logs at warn when this certificate (of `what`: "agent", "tracker")
    /// ends soon (see [`expiry_warning`]); returns when it starts and ends.
    pub fn warn_if_expiring(&self, what: &str) -> Result<(i64, i64)> {
        let (not_before, not_after) = self.validity()?;
        if let Some(w) = expiry_warning(what, not_after, not_after - not_before, unix_now()) {
            tracing::warn!(peer_id = %self.peer_id, not_after, "{w}");
        }
        Ok((not_before, not_after))
    }

    fn presented(&self) -> Arc<Presented> {
        Arc::new(Presented(self.current.clone()))
    }

    fn roots(&self) -> Result<Arc<rustls::RootCertStore>> {
        let mut roots = rustls::RootCertStore::empty();
        for ca in &self.cas {
            roots.add(ca.clone()).map_err(tls_err)?;
        }
        Ok(Arc::new(roots))
    }

    /// TLS for accepting peers: a node's client certificate signed by the
    /// CA is required.
    pub fn server_tls(&self) -> Result<rustls::ServerConfig> {
        self.server_config(Some(("the peer plane", Role::Node)), ALPN)
    }

    /// TLS 1.3 serving our certificate, client certificates checked against
    /// the CA: required and of one role (`Some((service, role))`), or only
    /// checked when offered (`None`: the service reads the role itself).
    fn server_config(
        &self,
        required: Option<(&'static str, Role)>,
        alpn: &[u8],
    ) -> Result<rustls::ServerConfig> {
        let builder =
            rustls::server::WebPkiClientVerifier::builder_with_provider(self.roots()?, provider());
        let verifier: Arc<dyn rustls::server::danger::ClientCertVerifier> = match required {
            Some((service, role)) => Arc::new(RoleVerifier {
                webpki: builder.build().map_err(tls_err)?,
                service,
                role,
            }),
            None => builder.allow_unauthenticated().build().map_err(tls_err)?,
        };
        let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls_err)?
            .with_client_cert_verifier(verifier)
            .with_cert_resolver(self.presented());
        cfg.alpn_protocols = vec![alpn.to_vec()];
        Ok(cfg)
    }

    /// TLS for dialling peers: the server must hold a node certificate
    /// signed by the CA for the peer id we dial, and we present ours.
    pub fn client_tls(&self) -> Result<rustls::ClientConfig> {
        self.checked_client(ServerRole::Peer, ALPN)
    }

    /// TLS for the tracker's listener: its certificate, and a client
    /// certificate signed by the CA checked when one is offered. One is
    /// optional at the handshake so that probes and Prometheus reach
    /// `/healthz`, `/readyz` and `/metrics`, and agents without a
    /// certificate yet reach the signer; the tracker API refuses a request
    /// without a node's, the preheat API one without a preheater's.
    pub fn tracker_server_tls(&self) -> Result<rustls::ServerConfig> {
        self.server_config(None, TRACKER_ALPN)
    }

    /// TLS for talking to the tracker: its certificate must be signed by the
    /// CA for the host dialled and carry the tracker's role; we present ours.
    pub fn tracker_client_tls(&self) -> Result<rustls::ClientConfig> {
        self.checked_client(ServerRole::Tracker, TRACKER_ALPN)
    }

    /// TLS for accepting DHT connections: as the peer plane's, under
    /// [`DHT_ALPN`].
    pub fn dht_server_tls(&self) -> Result<rustls::ServerConfig> {
        self.server_config(Some(("the DHT", Role::Node)), DHT_ALPN)
    }

    /// TLS for dialling DHT nodes: the server must hold a node certificate
    /// the CA signed (for any peer id: whom a bootstrap address reaches is
    /// not known before), and we present ours.
    pub fn dht_client_tls(&self) -> Result<rustls::ClientConfig> {
        self.checked_client(ServerRole::Member, DHT_ALPN)
    }

    fn checked_client(&self, role: ServerRole, alpn: &[u8]) -> Result<rustls::ClientConfig> {
        let mut cfg =
            verifying_client(&self.cas, role)?.with_client_cert_resolver(self.presented());
        cfg.alpn_protocols = vec![alpn.to_vec()];
        Ok(cfg)
    }
}

/// TLS for reaching the tracker without a certificate of our own (an agent
/// enrolling with the signer): the tracker's certificate is checked against
/// the CA in `ca_pem` and must carry the tracker's role.
pub fn enrollment_tls(ca_pem: &str) -> Result<rustls::ClientConfig> {
    let cas = rustls_pemfile::certs(&mut ca_pem.as_bytes())
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| Error::Tls(format!("cluster CA certificate: {e}")))?;
    let mut cfg = verifying_client(&cas, ServerRole::Tracker)?.with_no_client_auth();
    cfg.alpn_protocols = vec![TRACKER_ALPN.to_vec()];
    Ok(cfg)
}

/// A client configuration, up to its client certificate, that checks the
/// server's certificate against `cas` and `role`'s rule.
fn verifying_client(
    cas: &[CertificateDer<'static>],
    role: ServerRole,
) -> Result<rustls::ConfigBuilder<rustls::ClientConfig, rustls::client::WantsClientCert>> {
    let mut roots = rustls::RootCertStore::empty();
    for ca in cas {
        roots.add(ca.clone()).map_err(tls_err)?;
    }
    let webpki =
        rustls::client::WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider())
            .build()
            .map_err(tls_err)?;
    Ok(rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls_err)?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(ServerVerifier { webpki, role })))
}

/// The CA's WebPKI check of a client's certificate, plus the role the
/// service accepts: a preheater's certificate, or one without a role, is
/// refused during the handshake.
#[derive(Debug)]
struct RoleVerifier {
    webpki: Arc<dyn rustls::server::danger::ClientCertVerifier>,
    service: &'static str,
    role: Role,
}

/// A rustls error that carries our sentence to the log (rustls shows the
/// inner error with `Debug`, which here is the sentence too).
fn refused(e: impl std::fmt::Display) -> rustls::Error {
    rustls::Error::InvalidCertificate(rustls::CertificateError::Other(rustls::OtherError(
        Arc::new(Refusal(e.to_string())),
    )))
}

struct Refusal(String);

impl std::fmt::Debug for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Refusal {}

impl rustls::server::danger::ClientCertVerifier for RoleVerifier {
    fn root_hint_subjects(&self) -> &[rustls::DistinguishedName] {
        self.webpki.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: rustls::pki_types::UnixTime,
    ) -> std::result::Result<rustls::server::danger::ClientCertVerified, rustls::Error> {
        let verified = self
            .webpki
            .verify_client_cert(end_entity, intermediates, now)?;
        dray_protocol::identity::check_role(end_entity, self.role, self.service)
            .map_err(refused)?;
        Ok(verified)
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

/// Whom a server certificate must belong to, beyond the CA's signature.
#[derive(Debug, Clone, Copy)]
enum ServerRole {
    /// The tracker, for the host dialled: a node (even one whose peer id
    /// matches the tracker's host name) is not the tracker.
    Tracker,
    /// The node whose peer id was dialled (the peer plane).
    Peer,
    /// Any node, whatever name was dialled (a DHT bootstrap address names
    /// no node): the certificate must be valid for the peer id it carries.
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
        let (name, role, service) = match self.role {
            ServerRole::Tracker => (
                server_name.to_owned(),
                Role::Tracker,
                "an agent's tracker client",
            ),
            ServerRole::Peer => (server_name.to_owned(), Role::Node, "the peer plane"),
            ServerRole::Member => {
                let name =
                    peer_id_of(end_entity).map_err(|e| rustls::Error::General(e.to_string()))?;
                let name = rustls::pki_types::ServerName::try_from(name).map_err(|e| {
                    rustls::Error::General(format!("a node certificate's peer id: {e}"))
                })?;
                (name, Role::Node, "the DHT")
            }
        };
        let verified =
            self.webpki
                .verify_server_cert(end_entity, intermediates, &name, ocsp_response, now)?;
        match dray_protocol::identity::check_role(end_entity, role, service) {
            Ok(_) => Ok(verified),
            Err(e) if role == Role::Tracker => Err(rustls::Error::General(format!(
                "the certificate {server_name:?} presented as the tracker is not the tracker's ({e}); the tracker's comes from `dray ca issue --tracker`"
            ))),
            Err(e) => Err(rustls::Error::General(e.to_string())),
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
    fn a_certificate_is_warned_about_within_30_days_or_a_quarter_of_its_lifetime() {
        let (day, now) = (86_400, unix_now());
        let ca = ClusterCa::generate().unwrap();
        let (start, end) = ca.issue("node-1").unwrap().validity().unwrap();
        assert!((end - now - 365 * day).abs() < day, "{}", end - now);
        assert_eq!(expiry_warning("agent", end, end - start, now), None);
        let w = expiry_warning("agent", now + 9 * day + 60, 365 * day, now).unwrap();
        assert!(
            w.starts_with("the agent certificate expires in 9 days"),
            "{w}"
        );
        // A day-long certificate the agent renews: quiet until a quarter is left.
        assert_eq!(expiry_warning("agent", now + 8 * 3_600, day, now), None);
        let w = expiry_warning("agent", now + 5 * 3_600, day, now).unwrap();
        assert!(
            w.starts_with("the agent certificate expires in 5 hours"),
            "{w}"
        );
        let w = expiry_warning("tracker", now - 3 * day, 365 * day, now).unwrap();
        assert!(
            w.starts_with("the tracker certificate expired 3 days ago"),
            "{w}"
        );
    }

    #[test]
    fn issued_identity_round_trips_through_pem_with_its_role() {
        let ca = ClusterCa::generate().unwrap();
        let id = ca.issue("node-1.dray").unwrap();
        assert_eq!((id.peer_id.as_str(), id.role), ("node-1.dray", Role::Node));
        let again = Identity::from_pem(&id.cert_pem(), &id.key_pem(), &ca.cert_pem).unwrap();
        assert_eq!(again.peer_id, "node-1.dray");
        assert_eq!(again.cert_pem(), id.cert_pem());
        assert!(ca.issue("Bad_Name").is_err());
        id.server_tls().unwrap();
        id.client_tls().unwrap();
        let ci = ca
            .issue_role("ci", Role::Preheater, Duration::from_secs(3_600))
            .unwrap();
        assert_eq!(ci.role, Role::Preheater);
        let err = ci.require_role(Role::Node, "the agent").unwrap_err();
        assert!(err.to_string().contains("is a preheater's"), "{err}");
    }

    #[test]
    fn a_renewal_replaces_the_certificate_of_every_clone_for_the_same_name_only() {
        let ca = ClusterCa::generate().unwrap();
        let id = ca.issue("node-1").unwrap();
        let clone = id.clone();
        let renewed = ca.issue("node-1").unwrap();
        id.renew(&renewed.cert_pem(), &renewed.key_pem()).unwrap();
        assert_eq!(clone.cert_pem(), renewed.cert_pem());
        let other = ca.issue("node-2").unwrap();
        let err = id
            .renew(&other.cert_pem(), &other.key_pem())
            .unwrap_err()
            .to_string();
        assert!(err.contains("cannot replace \"node-1\""), "{err}");
        let err = id
            .renew(&renewed.cert_pem(), &other.key_pem())
            .unwrap_err()
            .to_string();
        assert!(err.contains("certificate and key"), "{err}");
    }
}
