//! The fleet PKI: a CA, the hub's certificate, device certificates and revocation.
//!
//! `core-hub pki init` writes a fleet CA and the hub's server certificate, `pki issue` writes a
//! device certificate whose subject CN is the device id, and `pki revoke` appends the device to
//! `revoked.txt`. The hub identifies a device only by that CN ([`device_id_from_cert`]), never
//! by anything in the payload. Device certificates are long-lived on purpose: boards have no
//! reliable clock and may stay offline for months, so revocation is the control, not expiry.
//!
//! [`server_tls_config`] builds the rustls server config the QUIC driver uses: TLS 1.3, client
//! certificates required and verified against `ca.pem`, the revocation list consulted on every
//! handshake, ALPN `tributary/1`, and no 0-RTT (a replayed early-data flight must never reach
//! ingest).

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{DigitallySignedStruct, DistinguishedName as TlsDn, SignatureScheme};
use std::collections::HashSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::SystemTime;
use thiserror::Error;

/// The ALPN protocol id of the replication protocol.
pub const ALPN: &[u8] = b"tributary/1";
/// How long a device certificate is valid by default.
pub const DEVICE_CERT_YEARS: i32 = 20;
/// How long the CA and the hub certificate are valid.
pub const CA_CERT_YEARS: i32 = 30;
/// The revocation list file inside the PKI directory.
pub const REVOKED_FILE: &str = "revoked.txt";

/// Why a PKI command failed.
#[derive(Debug, Error)]
pub enum PkiError {
    #[error(
        "{0} already exists; pass --force to replace the fleet CA (every issued certificate becomes useless)"
    )]
    CaExists(PathBuf),
    #[error("device id `{0}` is not [A-Za-z0-9_.-]{{1,128}}")]
    BadDeviceId(String),
    #[error("bad subject alternative name `{0}`")]
    BadSan(String),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("certificate generation failed: {0}")]
    Rcgen(#[from] rcgen::Error),
    #[error("{path}: {problem}")]
    Pem { path: PathBuf, problem: String },
}

/// Why a TLS configuration could not be built.
#[derive(Debug, Error)]
pub enum TlsError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {problem}")]
    Pem { path: PathBuf, problem: String },
    #[error("TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
    #[error("client verifier: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
}

/// Why a certificate does not name a device.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum CertIdError {
    #[error("certificate does not parse: {0}")]
    Parse(String),
    #[error("certificate subject has no common name")]
    NoCommonName,
    #[error("certificate common name is not a valid device id")]
    BadDeviceId,
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> PkiError + '_ {
    move |source| PkiError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The files `pki init` writes.
#[derive(Debug, Clone)]
pub struct InitOutput {
    pub ca_pem: PathBuf,
    pub ca_key: PathBuf,
    pub hub_pem: PathBuf,
    pub hub_key: PathBuf,
}

/// `core-hub pki init`: writes `ca.pem`, `ca.key`, `hub.pem`, `hub.key` into `dir`.
///
/// The hub certificate names `localhost`, `127.0.0.1` and every `extra_sans` entry. An existing
/// CA is never overwritten unless `force` is set.
pub fn init(dir: &Path, extra_sans: &[String], force: bool) -> Result<InitOutput, PkiError> {
    let out = InitOutput {
        ca_pem: dir.join("ca.pem"),
        ca_key: dir.join("ca.key"),
        hub_pem: dir.join("hub.pem"),
        hub_key: dir.join("hub.key"),
    };
    if !force && (out.ca_pem.exists() || out.ca_key.exists()) {
        return Err(PkiError::CaExists(out.ca_pem.clone()));
    }
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let ca_key = KeyPair::generate()?;
    let ca_params = ca_params()?;
    let ca_cert = ca_params.self_signed(&ca_key)?;
    let issuer = Issuer::new(ca_params, ca_key);

    let mut sans = vec!["localhost".to_string(), "127.0.0.1".to_string()];
    for san in extra_sans {
        if san.is_empty() || san.chars().any(|c| c.is_whitespace() || c == ',') {
            return Err(PkiError::BadSan(san.clone()));
        }
        if !sans.contains(san) {
            sans.push(san.clone());
        }
    }
    let mut hub_params =
        CertificateParams::new(sans).map_err(|_| PkiError::BadSan(extra_sans.join(",")))?;
    hub_params.distinguished_name = dn("tributary-hub");
    hub_params.is_ca = IsCa::ExplicitNoCa;
    hub_params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    hub_params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    set_validity(&mut hub_params, CA_CERT_YEARS);
    let hub_key = KeyPair::generate()?;
    let hub_cert = hub_params.signed_by(&hub_key, &issuer)?;

    write_file(&out.ca_pem, ca_cert.pem().as_bytes(), false)?;
    write_file(&out.ca_key, issuer.key().serialize_pem().as_bytes(), true)?;
    write_file(&out.hub_pem, hub_cert.pem().as_bytes(), false)?;
    write_file(&out.hub_key, hub_key.serialize_pem().as_bytes(), true)?;
    Ok(out)
}

fn ca_params() -> Result<CertificateParams, PkiError> {
    let mut p = CertificateParams::new(Vec::<String>::new())?;
    p.distinguished_name = dn("Tributary fleet CA");
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    set_validity(&mut p, CA_CERT_YEARS);
    Ok(p)
}

fn dn(cn: &str) -> DistinguishedName {
    let mut d = DistinguishedName::new();
    d.push(DnType::CommonName, cn);
    d
}

/// Valid from the start of last year (tolerates clocks that lag) for `years` years.
fn set_validity(p: &mut CertificateParams, years: i32) {
    let year = current_year();
    p.not_before = rcgen::date_time_ymd(year - 1, 1, 1);
    p.not_after = rcgen::date_time_ymd(year + years, 1, 1);
}

fn current_year() -> i32 {
    let secs = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    // Accurate to within a day at year boundaries, which the one-year margin absorbs.
    1970 + (secs / 31_556_952) as i32
}

/// The files `pki issue` writes.
#[derive(Debug, Clone)]
pub struct IssueOutput {
    pub ca_pem: PathBuf,
    pub device_pem: PathBuf,
    pub device_key: PathBuf,
    /// The certificate serial, lowercase hex.
    pub serial: String,
}

/// `core-hub pki issue`: writes `ca.pem`, `device.pem` and `device.key` into `out_dir`.
pub fn issue(dir: &Path, device: &str, out_dir: &Path) -> Result<IssueOutput, PkiError> {
    issue_with_years(dir, device, out_dir, DEVICE_CERT_YEARS)
}

/// As [`issue`], with an explicit validity in years.
pub fn issue_with_years(
    dir: &Path,
    device: &str,
    out_dir: &Path,
    years: i32,
) -> Result<IssueOutput, PkiError> {
    if !crate::config::valid_device_id(device) {
        return Err(PkiError::BadDeviceId(device.to_string()));
    }
    let ca_pem_path = dir.join("ca.pem");
    let ca_key_path = dir.join("ca.key");
    let ca_pem = std::fs::read_to_string(&ca_pem_path).map_err(io_err(&ca_pem_path))?;
    let ca_key_pem = std::fs::read_to_string(&ca_key_path).map_err(io_err(&ca_key_path))?;
    let ca_key = KeyPair::from_pem(&ca_key_pem).map_err(|e| PkiError::Pem {
        path: ca_key_path.clone(),
        problem: e.to_string(),
    })?;
    let issuer = Issuer::from_ca_cert_pem(&ca_pem, ca_key).map_err(|e| PkiError::Pem {
        path: ca_pem_path.clone(),
        problem: e.to_string(),
    })?;

    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.distinguished_name = dn(device);
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    // No explicit serial: rcgen derives it from a hash of the fresh public key, so it is
    // unique per certificate.
    set_validity(&mut params, years);
    let key = KeyPair::generate()?;
    let cert = params.signed_by(&key, &issuer)?;
    let (_, serial_hex) = cert_identity(cert.der()).map_err(|e| PkiError::Pem {
        path: ca_pem_path.clone(),
        problem: e.to_string(),
    })?;

    std::fs::create_dir_all(out_dir).map_err(io_err(out_dir))?;
    let out = IssueOutput {
        ca_pem: out_dir.join("ca.pem"),
        device_pem: out_dir.join("device.pem"),
        device_key: out_dir.join("device.key"),
        serial: serial_hex,
    };
    write_file(&out.ca_pem, ca_pem.as_bytes(), false)?;
    write_file(&out.device_pem, cert.pem().as_bytes(), false)?;
    write_file(&out.device_key, key.serialize_pem().as_bytes(), true)?;
    Ok(out)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Writes `bytes` to `path` through a temporary file and a rename, so a crash never leaves a
/// half-written key; `secret` files are created with mode 0600.
fn write_file(path: &Path, bytes: &[u8], secret: bool) -> Result<(), PkiError> {
    let tmp = path.with_extension("tmp");
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(if secret { 0o600 } else { 0o644 });
    }
    let mut f = opts.open(&tmp).map_err(io_err(&tmp))?;
    f.write_all(bytes).map_err(io_err(&tmp))?;
    f.sync_all().map_err(io_err(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io_err(path))?;
    Ok(())
}

/// `core-hub pki revoke`: appends `device` (and the serial of `cert`, if given) to
/// `DIR/revoked.txt`. Returns the list's path.
pub fn revoke(dir: &Path, device: &str, serial: Option<&str>) -> Result<PathBuf, PkiError> {
    if !crate::config::valid_device_id(device) {
        return Err(PkiError::BadDeviceId(device.to_string()));
    }
    let path = dir.join(REVOKED_FILE);
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .map_err(io_err(&path))?;
    let line = match serial {
        Some(s) => format!("{device} {s}\n"),
        None => format!("{device}\n"),
    };
    f.write_all(line.as_bytes()).map_err(io_err(&path))?;
    f.sync_all().map_err(io_err(&path))?;
    Ok(path)
}

/// The revoked devices: one `device-id [serial-hex]` per line; `#` starts a comment.
///
/// A device listed without a serial is revoked outright; with serials, only those certificates
/// are revoked (so a re-issued certificate works again).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RevocationList {
    devices: HashSet<String>,
    serials: HashSet<String>,
}

impl RevocationList {
    /// Loads `path`; a missing file is an empty list.
    pub fn load(path: &Path) -> Result<RevocationList, std::io::Error> {
        match std::fs::read_to_string(path) {
            Ok(text) => Ok(Self::parse(&text)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Self::default()),
            Err(e) => Err(e),
        }
    }

    /// Parses the file's text. Malformed lines are skipped: revocation must never fail open
    /// for the well-formed entries because of a typo elsewhere.
    pub fn parse(text: &str) -> RevocationList {
        let mut list = RevocationList::default();
        for line in text.lines() {
            let line = line.split('#').next().unwrap_or("").trim();
            let mut parts = line.split_whitespace();
            let Some(device) = parts.next() else { continue };
            match parts.next() {
                Some(serial) => list.serials.insert(serial.to_ascii_lowercase()),
                None => list.devices.insert(device.to_string()),
            };
        }
        list
    }

    /// Whether every certificate of `device_id` is revoked.
    pub fn is_revoked(&self, device_id: &str) -> bool {
        self.devices.contains(device_id)
    }

    /// Whether a certificate with this serial (lowercase hex) is revoked.
    pub fn is_serial_revoked(&self, serial_hex: &str) -> bool {
        self.serials.contains(serial_hex)
    }

    /// Whether the certificate is revoked, by device or by serial. Unparseable certificates count
    /// as revoked.
    pub fn is_cert_revoked(&self, cert: &CertificateDer<'_>) -> bool {
        match cert_identity(cert) {
            Ok((device, serial)) => self.is_revoked(&device) || self.is_serial_revoked(&serial),
            Err(_) => true,
        }
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.devices.len() + self.serials.len()
    }

    /// `true` when nothing is revoked.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A revocation list shared with the TLS verifier and reloaded when its file changes.
#[derive(Debug)]
pub struct SharedRevocations {
    path: PathBuf,
    list: RwLock<Arc<RevocationList>>,
    /// The file's (mtime, length) when last loaded: a change in either triggers a reload.
    stamp: RwLock<Option<(SystemTime, u64)>>,
}

impl SharedRevocations {
    /// Loads `path` (missing = empty).
    pub fn open(path: &Path) -> Result<Arc<SharedRevocations>, std::io::Error> {
        let stamp = file_stamp(path);
        let list = RevocationList::load(path)?;
        Ok(Arc::new(SharedRevocations {
            path: path.to_path_buf(),
            list: RwLock::new(Arc::new(list)),
            stamp: RwLock::new(stamp),
        }))
    }

    /// The current list.
    pub fn current(&self) -> Arc<RevocationList> {
        self.list.read().expect("revocation lock").clone()
    }

    /// Reloads the file if its mtime or length changed; returns `true` when it did. The server driver
    /// polls this and then closes connections of devices that became revoked.
    pub fn reload_if_changed(&self) -> Result<bool, std::io::Error> {
        let stamp = file_stamp(&self.path);
        if *self.stamp.read().expect("revocation lock") == stamp {
            return Ok(false);
        }
        let list = RevocationList::load(&self.path)?;
        *self.list.write().expect("revocation lock") = Arc::new(list);
        *self.stamp.write().expect("revocation lock") = stamp;
        Ok(true)
    }
}

fn file_stamp(path: &Path) -> Option<(SystemTime, u64)> {
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok()?, m.len()))
}

/// The device id of a client certificate: its subject common name, validated.
pub fn device_id_from_cert(cert: &CertificateDer<'_>) -> Result<String, CertIdError> {
    cert_identity(cert).map(|(device, _)| device)
}

/// The device id and the serial (lowercase hex) of a certificate.
pub fn cert_identity(cert: &CertificateDer<'_>) -> Result<(String, String), CertIdError> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref())
        .map_err(|e| CertIdError::Parse(e.to_string()))?;
    let cn = parsed
        .subject()
        .iter_common_name()
        .next()
        .ok_or(CertIdError::NoCommonName)?;
    let cn = cn.as_str().map_err(|_| CertIdError::BadDeviceId)?;
    if !crate::config::valid_device_id(cn) {
        return Err(CertIdError::BadDeviceId);
    }
    let serial = hex(parsed.raw_serial());
    Ok((cn.to_string(), serial))
}

/// Reads every certificate in a PEM file.
pub fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bytes = std::fs::read(path).map_err(|source| TlsError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let certs: Result<Vec<_>, _> = rustls_pemfile::certs(&mut bytes.as_slice()).collect();
    let certs = certs.map_err(|e| TlsError::Pem {
        path: path.to_path_buf(),
        problem: e.to_string(),
    })?;
    if certs.is_empty() {
        return Err(TlsError::Pem {
            path: path.to_path_buf(),
            problem: "no certificate found".into(),
        });
    }
    Ok(certs)
}

/// Reads the private key in a PEM file.
pub fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let bytes = std::fs::read(path).map_err(|source| TlsError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    rustls_pemfile::private_key(&mut bytes.as_slice())
        .map_err(|e| TlsError::Pem {
            path: path.to_path_buf(),
            problem: e.to_string(),
        })?
        .ok_or_else(|| TlsError::Pem {
            path: path.to_path_buf(),
            problem: "no private key found".into(),
        })
}

/// The client-certificate verifier: webpki against the fleet CA, then the revocation list.
pub fn client_verifier(
    ca: &Path,
    revocations: Arc<SharedRevocations>,
) -> Result<Arc<dyn ClientCertVerifier>, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in load_certs(ca)? {
        roots.add(cert)?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let inner = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider).build()?;
    Ok(Arc::new(RevocationCheckingVerifier { inner, revocations }))
}

/// The hub's rustls server config for QUIC: TLS 1.3 only, mutual TLS, ALPN `tributary/1`,
/// no 0-RTT.
pub fn server_tls_config(
    paths: &crate::config::TlsPaths,
    revocations: Arc<SharedRevocations>,
) -> Result<rustls::ServerConfig, TlsError> {
    let verifier = client_verifier(&paths.ca, revocations)?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(verifier)
        .with_single_cert(load_certs(&paths.cert)?, load_key(&paths.key)?)?;
    cfg.alpn_protocols = vec![ALPN.to_vec()];
    // 0-RTT data can be replayed by an attacker; ingest must only see 1-RTT data.
    cfg.max_early_data_size = 0;
    Ok(cfg)
}

/// Wraps webpki's verifier and rejects revoked devices at the handshake.
#[derive(Debug)]
struct RevocationCheckingVerifier {
    inner: Arc<dyn ClientCertVerifier>,
    revocations: Arc<SharedRevocations>,
}

impl ClientCertVerifier for RevocationCheckingVerifier {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        true
    }

    fn root_hint_subjects(&self) -> &[TlsDn] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let verified = self
            .inner
            .verify_client_cert(end_entity, intermediates, now)?;
        if self.revocations.current().is_cert_revoked(end_entity) {
            return Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::Revoked,
            ));
        }
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn now() -> UnixTime {
        UnixTime::now()
    }

    #[test]
    fn init_and_issue_produce_a_working_chain() {
        let dir = tempfile::tempdir().unwrap();
        let pki = dir.path().join("pki");
        init(&pki, &["hub.example.net".into()], false).unwrap();
        let dev = dir.path().join("dev");
        let out = issue(&pki, "truck-0042", &dev).unwrap();
        assert_eq!(
            std::fs::read(&out.ca_pem).unwrap(),
            std::fs::read(pki.join("ca.pem")).unwrap()
        );

        let revs = SharedRevocations::open(&pki.join(REVOKED_FILE)).unwrap();
        let paths = crate::config::TlsPaths {
            ca: pki.join("ca.pem"),
            cert: pki.join("hub.pem"),
            key: pki.join("hub.key"),
        };
        let cfg = server_tls_config(&paths, revs.clone()).unwrap();
        assert_eq!(cfg.alpn_protocols, vec![ALPN.to_vec()]);
        assert_eq!(cfg.max_early_data_size, 0);

        let verifier = client_verifier(&pki.join("ca.pem"), revs).unwrap();
        let cert = load_certs(&out.device_pem).unwrap().remove(0);
        verifier.verify_client_cert(&cert, &[], now()).unwrap();
        assert_eq!(device_id_from_cert(&cert).unwrap(), "truck-0042");
        load_key(&out.device_key).unwrap();

        // The hub certificate names localhost, 127.0.0.1 and the extra SAN.
        let hub = load_certs(&pki.join("hub.pem")).unwrap().remove(0);
        let (_, parsed) = x509_parser::parse_x509_certificate(hub.as_ref()).unwrap();
        let san = parsed
            .subject_alternative_name()
            .unwrap()
            .unwrap()
            .value
            .general_names
            .len();
        assert_eq!(san, 3);
    }

    #[test]
    fn another_ca_is_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        init(&a, &[], false).unwrap();
        init(&b, &[], false).unwrap();
        let foreign = issue(&b, "intruder", &dir.path().join("x")).unwrap();
        let revs = SharedRevocations::open(&a.join(REVOKED_FILE)).unwrap();
        let verifier = client_verifier(&a.join("ca.pem"), revs).unwrap();
        let cert = load_certs(&foreign.device_pem).unwrap().remove(0);
        assert!(verifier.verify_client_cert(&cert, &[], now()).is_err());
    }

    #[test]
    fn existing_ca_needs_force() {
        let dir = tempfile::tempdir().unwrap();
        init(dir.path(), &[], false).unwrap();
        assert!(matches!(
            init(dir.path(), &[], false),
            Err(PkiError::CaExists(_))
        ));
        init(dir.path(), &[], true).unwrap();
    }

    #[test]
    fn bad_device_ids_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        init(dir.path(), &[], false).unwrap();
        for bad in ["", "../x", "a b", "a/b", ".."] {
            assert!(matches!(
                issue(dir.path(), bad, &dir.path().join("o")),
                Err(PkiError::BadDeviceId(_))
            ));
        }
    }

    #[test]
    fn revoked_devices_fail_verification_after_reload() {
        let dir = tempfile::tempdir().unwrap();
        init(dir.path(), &[], false).unwrap();
        let d1 = issue(dir.path(), "d1", &dir.path().join("d1")).unwrap();
        let d2 = issue(dir.path(), "d2", &dir.path().join("d2")).unwrap();
        let revs = SharedRevocations::open(&dir.path().join(REVOKED_FILE)).unwrap();
        let verifier = client_verifier(&dir.path().join("ca.pem"), revs.clone()).unwrap();
        let c1 = load_certs(&d1.device_pem).unwrap().remove(0);
        let c2 = load_certs(&d2.device_pem).unwrap().remove(0);
        verifier.verify_client_cert(&c1, &[], now()).unwrap();

        revoke(dir.path(), "d1", None).unwrap();
        assert!(revs.reload_if_changed().unwrap());
        assert!(revs.current().is_revoked("d1"));
        assert!(!revs.current().is_revoked("d2"));
        assert!(verifier.verify_client_cert(&c1, &[], now()).is_err());
        verifier.verify_client_cert(&c2, &[], now()).unwrap();
        assert!(!revs.reload_if_changed().unwrap());
    }

    #[test]
    fn revocation_by_serial() {
        let list = RevocationList::parse("# comment\nd1\nd2 0A0b\n\n  \n");
        assert!(list.is_revoked("d1"));
        assert!(!list.is_revoked("d2"));
        assert!(list.is_serial_revoked("0a0b"));
        assert_eq!(list.len(), 2);
    }
}
