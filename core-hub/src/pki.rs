//! The fleet PKI: a CA, the hub's certificate, device certificates, their issuance record
//! and revocation.
//!
//! `core-hub pki init` writes a fleet CA and the hub's server certificate, `pki issue` writes a
//! device certificate whose subject CN is the device id and appends its serial to the issuance
//! record `issued.txt`, and `pki revoke` appends the device (or one of its certificates, by
//! serial) to `revoked.txt`. The hub identifies a device only by that CN
//! ([`device_id_from_cert`]), never by anything in the payload. Device certificates are
//! long-lived on purpose: boards have no reliable clock and may stay offline for months, so
//! revocation is the control, not expiry.
//!
//! Revocation must not fail open. Serials are normalised wherever they are written or read
//! ([`normalize_serial`]: colons, case, leading zeros), so a serial copied from
//! `openssl x509 -text` matches. `pki revoke` refuses a serial the issuance record does not list
//! for that device; the hub, loading a list edited by hand, reports every line it cannot parse
//! and every serial that matches no issued certificate ([`RevocationProblem`], logged at error
//! level and counted on `/metrics`), and revokes the whole device of a line whose serial it
//! cannot read.
//!
//! Key material is written through a fresh temporary file created with `O_EXCL` beside the
//! target (never a fixed name, so a planted symlink is never followed), fsynced, renamed into
//! place (a rename replaces a symlink at the target, it never writes through it), and the
//! directory fsynced. Existing keys are replaced only with `--force`.
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
use std::collections::{BTreeSet, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, RwLock};
use std::time::SystemTime;
use thiserror::Error;

use crate::refusals::{Refusal, Refusals, RefusedAt};

/// The ALPN protocol id of the replication protocol.
pub const ALPN: &[u8] = b"tributary/1";
/// How long a device certificate is valid by default.
pub const DEVICE_CERT_YEARS: i32 = 20;
/// How long the CA and the hub certificate are valid.
pub const CA_CERT_YEARS: i32 = 30;
/// The revocation list file inside the PKI directory (the default of `tls.revoked`).
pub const REVOKED_FILE: &str = "revoked.txt";
/// The issuance record inside the PKI directory, beside the revocation list: one
/// `device-id serial issued-at` line per certificate `pki issue` wrote.
pub const ISSUED_FILE: &str = "issued.txt";
/// Most hex digits of a normalised serial: RFC 5280 serials are at most 20 octets.
pub const SERIAL_HEX_DIGITS_MAX: usize = 40;

/// Why a PKI command failed.
#[derive(Debug, Error)]
pub enum PkiError {
    #[error(
        "{0} already exists; pass --force to replace the fleet CA (every issued certificate becomes useless)"
    )]
    CaExists(PathBuf),
    #[error("{0} already exists; pass --force to replace it (the old key stops working)")]
    Exists(PathBuf),
    #[error("device id `{0}` is not [A-Za-z0-9_.-]{{1,128}}")]
    BadDeviceId(String),
    #[error("bad subject alternative name `{0}`")]
    BadSan(String),
    #[error("serial `{serial}`: {source}")]
    BadSerial {
        serial: String,
        #[source]
        source: SerialError,
    },
    #[error(
        "serial {serial} matches no certificate issued to `{device}` ({record} {issued}); \
         copy the serial from `openssl x509 -noout -serial -in device.pem`"
    )]
    UnknownSerial {
        device: String,
        serial: String,
        record: PathBuf,
        /// What the record holds for the device, as a sentence fragment.
        issued: String,
    },
    #[error(
        "{0} does not exist, so a serial cannot be checked against what this PKI issued; \
         revoke the device as a whole (without --serial)"
    )]
    NoIssuanceRecord(PathBuf),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
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
        #[source]
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

/// Why a certificate serial, as an operator wrote it, is unusable.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum SerialError {
    #[error("the serial is empty")]
    Empty,
    #[error("`{0}` is not a hex digit")]
    NotHex(char),
    #[error("`{0}` is not two hex digits between colons (write `42:bb:57` or `42bb57`)")]
    BadGroup(String),
    #[error("{0} hex digits; a certificate serial has at most {SERIAL_HEX_DIGITS_MAX}")]
    TooLong(usize),
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> PkiError + '_ {
    move |source| PkiError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// A certificate serial in its one written form: lowercase hex, no separators, no leading
/// zeros (`"0"` for zero).
///
/// Accepts what operators copy: `42:BB:57` (`openssl x509 -text`), `serial=42BB57`
/// (`openssl x509 -noout -serial`), `0x42bb57`, and `0042bb57` (a DER serial's sign byte).
pub fn normalize_serial(text: &str) -> Result<String, SerialError> {
    let t = text.trim();
    let t = t.strip_prefix("serial=").unwrap_or(t);
    let t = t
        .strip_prefix("0x")
        .or_else(|| t.strip_prefix("0X"))
        .unwrap_or(t);
    if t.is_empty() {
        return Err(SerialError::Empty);
    }
    let mut digits = String::with_capacity(t.len());
    if t.contains(':') {
        for group in t.split(':') {
            if group.len() != 2 || !group.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(SerialError::BadGroup(group.to_string()));
            }
            digits.push_str(group);
        }
    } else if let Some(c) = t.chars().find(|c| !c.is_ascii_hexdigit()) {
        return Err(SerialError::NotHex(c));
    } else {
        digits.push_str(t);
    }
    let trimmed = digits.trim_start_matches('0');
    let out = if trimmed.is_empty() { "0" } else { trimmed }.to_ascii_lowercase();
    if out.len() > SERIAL_HEX_DIGITS_MAX {
        return Err(SerialError::TooLong(out.len()));
    }
    Ok(out)
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
/// CA or hub key is never overwritten unless `force` is set.
pub fn init(dir: &Path, extra_sans: &[String], force: bool) -> Result<InitOutput, PkiError> {
    let out = InitOutput {
        ca_pem: dir.join("ca.pem"),
        ca_key: dir.join("ca.key"),
        hub_pem: dir.join("hub.pem"),
        hub_key: dir.join("hub.key"),
    };
    if !force && (exists(&out.ca_pem) || exists(&out.ca_key)) {
        return Err(PkiError::CaExists(out.ca_pem.clone()));
    }
    let existing = refuse_existing(force, &[&out.hub_pem, &out.hub_key])?;
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let ca_key = KeyPair::generate()?;
    let ca_params = ca_params()?;
    let ca_cert = ca_params.self_signed(&ca_key)?;
    let issuer = Issuer::new(ca_params, ca_key);
    let hub_params = hub_params(extra_sans)?;
    let hub_key = KeyPair::generate()?;
    let hub_cert = hub_params.signed_by(&hub_key, &issuer)?;

    write_file(&out.ca_pem, ca_cert.pem().as_bytes(), false, existing)?;
    write_file(
        &out.ca_key,
        issuer.key().serialize_pem().as_bytes(),
        true,
        existing,
    )?;
    write_file(&out.hub_pem, hub_cert.pem().as_bytes(), false, existing)?;
    write_file(
        &out.hub_key,
        hub_key.serialize_pem().as_bytes(),
        true,
        existing,
    )?;
    Ok(out)
}

fn hub_params(extra_sans: &[String]) -> Result<CertificateParams, PkiError> {
    let mut sans = vec!["localhost".to_string(), "127.0.0.1".to_string()];
    for san in extra_sans {
        if san.is_empty() || san.chars().any(|c| c.is_whitespace() || c == ',') {
            return Err(PkiError::BadSan(san.clone()));
        }
        if !sans.contains(san) {
            sans.push(san.clone());
        }
    }
    let mut p = CertificateParams::new(sans).map_err(|_| PkiError::BadSan(extra_sans.join(",")))?;
    p.distinguished_name = dn("tributary-hub");
    p.is_ca = IsCa::ExplicitNoCa;
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    set_validity(&mut p, CA_CERT_YEARS);
    Ok(p)
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
    /// The certificate serial, normalised ([`normalize_serial`]).
    pub serial: String,
    /// The issuance record the serial was appended to.
    pub record: PathBuf,
}

/// `core-hub pki issue`: writes `ca.pem`, `device.pem` and `device.key` into `out_dir`,
/// refusing to replace an existing device key or certificate.
pub fn issue(dir: &Path, device: &str, out_dir: &Path) -> Result<IssueOutput, PkiError> {
    issue_with_years(dir, device, out_dir, DEVICE_CERT_YEARS, false)
}

/// As [`issue`], with an explicit validity in years; `force` replaces an existing device key.
pub fn issue_with_years(
    dir: &Path,
    device: &str,
    out_dir: &Path,
    years: i32,
    force: bool,
) -> Result<IssueOutput, PkiError> {
    if !crate::config::valid_device_id(device) {
        return Err(PkiError::BadDeviceId(device.to_string()));
    }
    let out = IssueOutput {
        ca_pem: out_dir.join("ca.pem"),
        device_pem: out_dir.join("device.pem"),
        device_key: out_dir.join("device.key"),
        serial: String::new(),
        record: dir.join(ISSUED_FILE),
    };
    let existing = refuse_existing(force, &[&out.device_pem, &out.device_key])?;
    let ca_pem_path = dir.join("ca.pem");
    let ca_pem = std::fs::read_to_string(&ca_pem_path).map_err(io_err(&ca_pem_path))?;
    let (cert, key) = sign_device(dir, &ca_pem, device, years)?;
    let (_, serial) = cert_identity(cert.der()).map_err(|e| PkiError::Pem {
        path: ca_pem_path.clone(),
        problem: e.to_string(),
    })?;
    // The record first: a crash before the files leaves a listed serial nobody holds, never a
    // certificate in use that `pki revoke --serial` cannot find.
    append_line(&out.record, &issuance_line(device, &serial))?;
    std::fs::create_dir_all(out_dir).map_err(io_err(out_dir))?;
    write_file(&out.ca_pem, ca_pem.as_bytes(), false, Existing::Replace)?;
    write_file(&out.device_pem, cert.pem().as_bytes(), false, existing)?;
    write_file(
        &out.device_key,
        key.serialize_pem().as_bytes(),
        true,
        existing,
    )?;
    Ok(IssueOutput { serial, ..out })
}

/// Signs a fresh device key with the CA in `dir`.
fn sign_device(
    dir: &Path,
    ca_pem: &str,
    device: &str,
    years: i32,
) -> Result<(rcgen::Certificate, KeyPair), PkiError> {
    let ca_key_path = dir.join("ca.key");
    let ca_key_pem = std::fs::read_to_string(&ca_key_path).map_err(io_err(&ca_key_path))?;
    let ca_key = KeyPair::from_pem(&ca_key_pem).map_err(|e| PkiError::Pem {
        path: ca_key_path.clone(),
        problem: e.to_string(),
    })?;
    let issuer = Issuer::from_ca_cert_pem(ca_pem, ca_key).map_err(|e| PkiError::Pem {
        path: dir.join("ca.pem"),
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
    Ok((cert, key))
}

fn issuance_line(device: &str, serial: &str) -> String {
    let at = humantime::format_rfc3339_seconds(SystemTime::now());
    format!("{device} {serial} {at}\n")
}

/// Whether a file at the target of [`write_file`] may be replaced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Existing {
    Refuse,
    Replace,
}

/// Whether anything (a file, a directory, a symlink, even a dangling one) is at `path`.
fn exists(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok()
}

/// Checks, before anything is generated, that no target exists unless `force` is set.
fn refuse_existing(force: bool, paths: &[&Path]) -> Result<Existing, PkiError> {
    if force {
        return Ok(Existing::Replace);
    }
    match paths.iter().find(|p| exists(p)) {
        Some(p) => Err(PkiError::Exists(p.to_path_buf())),
        None => Ok(Existing::Refuse),
    }
}

/// Writes `bytes` to `path` through a fresh temporary file in the same directory, so a crash
/// never leaves a half-written key and a planted symlink is never written through.
///
/// The temporary file has a random name and is created with `O_CREAT | O_EXCL` (mode 0600),
/// so no existing file or symlink is ever opened. It is fsynced, renamed over `path` (with
/// [`Existing::Refuse`], only if nothing is there, atomically), and the directory is fsynced.
/// `secret` files stay 0600; others become 0644.
fn write_file(path: &Path, bytes: &[u8], secret: bool, existing: Existing) -> Result<(), PkiError> {
    let dir = parent_dir(path);
    let name = path
        .file_name()
        .map_or_else(|| "pki".into(), |n| n.to_string_lossy().into_owned());
    let mut tmp = tempfile::Builder::new()
        .prefix(&format!(".{name}."))
        .suffix(".tmp")
        .tempfile_in(dir)
        .map_err(io_err(dir))?;
    #[cfg(unix)]
    if !secret {
        use std::os::unix::fs::PermissionsExt;
        let perms = std::fs::Permissions::from_mode(0o644);
        tmp.as_file()
            .set_permissions(perms)
            .map_err(io_err(tmp.path()))?;
    }
    #[cfg(not(unix))]
    let _ = secret;
    tmp.write_all(bytes).map_err(io_err(path))?;
    tmp.as_file().sync_all().map_err(io_err(path))?;
    let persisted = match existing {
        Existing::Refuse => tmp.persist_noclobber(path),
        Existing::Replace => tmp.persist(path),
    };
    persisted.map_err(|e| match e.error.kind() {
        std::io::ErrorKind::AlreadyExists => PkiError::Exists(path.to_path_buf()),
        _ => PkiError::Io {
            path: path.to_path_buf(),
            source: e.error,
        },
    })?;
    sync_dir(dir)
}

fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

fn sync_dir(dir: &Path) -> Result<(), PkiError> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err(dir))
}

/// Appends one line to a list file (created if missing), fsyncs it, and fsyncs the directory
/// when the file is new. A symlink at `path` is refused (`O_NOFOLLOW`), not followed.
fn append_line(path: &Path, line: &str) -> Result<(), PkiError> {
    let created = !exists(path);
    let mut opts = std::fs::OpenOptions::new();
    opts.create(true).append(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.custom_flags(libc::O_NOFOLLOW).mode(0o644);
    }
    let mut f = opts.open(path).map_err(io_err(path))?;
    f.write_all(line.as_bytes()).map_err(io_err(path))?;
    f.sync_all().map_err(io_err(path))?;
    if created {
        sync_dir(parent_dir(path))?;
    }
    Ok(())
}

/// What `pki revoke` wrote.
#[derive(Debug, Clone)]
pub struct RevokeOutput {
    /// The revocation list.
    pub path: PathBuf,
    /// The serial revoked, normalised; `None` when the whole device is.
    pub serial: Option<String>,
    /// Something the operator should know although the revocation was written.
    pub warning: Option<String>,
}

/// `core-hub pki revoke`: appends `device` (and, if given, one of its certificates' serial) to
/// `DIR/revoked.txt`.
///
/// A serial is normalised and must be one the issuance record `DIR/issued.txt` lists for
/// `device`, else nothing is written: a mistyped serial would revoke nothing. Revoking a whole
/// device the record does not know is written (it can only be more strict) with a warning.
pub fn revoke(dir: &Path, device: &str, serial: Option<&str>) -> Result<RevokeOutput, PkiError> {
    if !crate::config::valid_device_id(device) {
        return Err(PkiError::BadDeviceId(device.to_string()));
    }
    let record_path = dir.join(ISSUED_FILE);
    let record = IssuanceRecord::load(&record_path).map_err(io_err(&record_path))?;
    let serial = serial
        .map(|s| checked_serial(device, s, record.as_ref(), &record_path))
        .transpose()?;
    let warning = match (&serial, &record) {
        (None, Some(r)) if !r.knows_device(device) => Some(format!(
            "{} lists no certificate issued to `{device}`; check the device id",
            record_path.display()
        )),
        _ => None,
    };
    let path = dir.join(REVOKED_FILE);
    let line = match &serial {
        Some(s) => format!("{device} {s}\n"),
        None => format!("{device}\n"),
    };
    append_line(&path, &line)?;
    Ok(RevokeOutput {
        path,
        serial,
        warning,
    })
}

fn checked_serial(
    device: &str,
    serial: &str,
    record: Option<&IssuanceRecord>,
    record_path: &Path,
) -> Result<String, PkiError> {
    let s = normalize_serial(serial).map_err(|source| PkiError::BadSerial {
        serial: serial.to_string(),
        source,
    })?;
    let record = record.ok_or_else(|| PkiError::NoIssuanceRecord(record_path.to_path_buf()))?;
    if record.issued_to(device, &s) {
        return Ok(s);
    }
    let known = record.serials_of(device);
    let issued = if known.is_empty() {
        format!("lists no certificate for `{device}`")
    } else {
        format!("lists {}", known.join(", "))
    };
    Err(PkiError::UnknownSerial {
        device: device.to_string(),
        serial: s,
        record: record_path.to_path_buf(),
        issued,
    })
}

/// The certificates `pki issue` wrote: per device, the normalised serials.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IssuanceRecord {
    serials: HashMap<String, BTreeSet<String>>,
}

impl IssuanceRecord {
    /// Loads `path`; `None` when there is no record (a PKI made before records were kept, or a
    /// hub given only the revocation list).
    pub fn load(path: &Path) -> Result<Option<IssuanceRecord>, std::io::Error> {
        match std::fs::read_to_string(path) {
            Ok(text) => Ok(Some(Self::parse(&text))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Parses `device-id serial [issued-at]` lines; `#` starts a comment. Lines that do not
    /// parse list nothing (they can only make a revoked serial look unmatched, which is
    /// reported).
    pub fn parse(text: &str) -> IssuanceRecord {
        let mut record = IssuanceRecord::default();
        for line in text.lines() {
            let line = line.split('#').next().unwrap_or("");
            let mut fields = line.split_whitespace();
            let (Some(device), Some(serial)) = (fields.next(), fields.next()) else {
                continue;
            };
            if let Ok(serial) = normalize_serial(serial) {
                record
                    .serials
                    .entry(device.to_string())
                    .or_default()
                    .insert(serial);
            }
        }
        record
    }

    /// Whether a certificate with this normalised serial was issued to `device`.
    pub fn issued_to(&self, device: &str, serial: &str) -> bool {
        self.serials.get(device).is_some_and(|s| s.contains(serial))
    }

    /// Whether any certificate was issued to `device`.
    pub fn knows_device(&self, device: &str) -> bool {
        self.serials.contains_key(device)
    }

    /// The serials issued to `device`, sorted.
    pub fn serials_of(&self, device: &str) -> Vec<String> {
        self.serials
            .get(device)
            .map(|s| s.iter().cloned().collect())
            .unwrap_or_default()
    }
}

/// A revocation-list line the hub could not take as written. Every one is logged at error
/// level and counted on `/metrics`; none is ignored silently.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RevocationProblem {
    /// The line does not parse. When its first field is a valid device id, that device is
    /// revoked as a whole (`device_revoked`): the line meant to revoke something of it, and
    /// revocation must not fail open.
    Invalid {
        line: usize,
        text: String,
        why: String,
        device_revoked: bool,
    },
    /// The serial matches no certificate the issuance record lists for the device. It is still
    /// revoked, but the certificate meant may well be live.
    Unmatched {
        line: usize,
        device: String,
        serial: String,
    },
}

impl std::fmt::Display for RevocationProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RevocationProblem::Invalid {
                line,
                text,
                why,
                device_revoked,
            } => {
                write!(f, "line {line} `{text}` is invalid: {why}")?;
                if *device_revoked {
                    write!(f, "; the whole device is revoked instead")?;
                }
                Ok(())
            }
            RevocationProblem::Unmatched {
                line,
                device,
                serial,
            } => write!(
                f,
                "line {line}: serial {serial} matches no certificate issued to `{device}`; \
                 the certificate meant may still be accepted"
            ),
        }
    }
}

/// The revoked devices: one `device-id [serial-hex]` per line; `#` starts a comment.
///
/// A device listed without a serial is revoked outright; with serials, only those certificates
/// are revoked (so a re-issued certificate works again).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RevocationList {
    /// Devices revoked as a whole, each with the first line that does it.
    devices: HashMap<String, RevocationRule>,
    /// Revoked certificate serials, normalised, each with the first line that names it.
    serials: HashMap<String, RevocationRule>,
    problems: Vec<RevocationProblem>,
}

/// The line of the revocation list that revokes something, as the operator sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RevocationRule {
    /// Its line number in the file, from 1.
    pub line: usize,
    /// The line as written, without its comment.
    pub text: String,
    /// What it does, in words: "revocation list line 3 `dev-1 42bb57` revokes ...".
    pub why: String,
}

impl RevocationList {
    /// Loads `path`; a missing file is an empty list. Serials are not checked against an
    /// issuance record (see [`RevocationList::load_checked`]).
    pub fn load(path: &Path) -> Result<RevocationList, std::io::Error> {
        Self::load_checked(path, None)
    }

    /// Loads `path`, reporting serials that `issued` does not list for their device.
    pub fn load_checked(
        path: &Path,
        issued: Option<&IssuanceRecord>,
    ) -> Result<RevocationList, std::io::Error> {
        match std::fs::read_to_string(path) {
            Ok(text) => Ok(Self::parse_checked(&text, issued)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Self::default()),
            Err(e) => Err(e),
        }
    }

    /// Parses the file's text without an issuance record.
    pub fn parse(text: &str) -> RevocationList {
        Self::parse_checked(text, None)
    }

    /// Parses the file's text. A line that does not parse never stops the others from
    /// applying, and never passes unreported ([`RevocationList::problems`]).
    pub fn parse_checked(text: &str, issued: Option<&IssuanceRecord>) -> RevocationList {
        let mut list = RevocationList::default();
        for (i, raw) in text.lines().enumerate() {
            list.parse_line(i + 1, raw, issued);
        }
        list
    }

    fn parse_line(&mut self, line: usize, raw: &str, issued: Option<&IssuanceRecord>) {
        let text = raw.split('#').next().unwrap_or("").trim();
        let fields: Vec<&str> = text.split_whitespace().collect();
        let Some(&device) = fields.first() else {
            return;
        };
        // Listed as written even when invalid: it can never match a certificate (CNs are
        // validated), but a caller asking about that exact name gets "revoked".
        let device_ok = crate::config::valid_device_id(device);
        let rule = |why: String| RevocationRule {
            line,
            text: text.to_string(),
            why,
        };
        let why = match fields[1..] {
            _ if !device_ok => format!("`{device}` is not a device id"),
            [] => {
                let why = format!(
                    "revocation list line {line} `{text}` names the device (`core-hub pki \
                     revoke`), so the hub refuses its certificates at the handshake"
                );
                self.devices
                    .entry(device.to_string())
                    .or_insert_with(|| rule(why));
                return;
            }
            [serial] => match normalize_serial(serial) {
                Ok(serial) => {
                    if issued.is_some_and(|r| !r.issued_to(device, &serial)) {
                        let device = device.to_string();
                        let serial = serial.clone();
                        self.problems.push(RevocationProblem::Unmatched {
                            line,
                            device,
                            serial,
                        });
                    }
                    let why = format!(
                        "revocation list line {line} `{text}` revokes the certificate with \
                         serial {serial}"
                    );
                    self.serials.entry(serial).or_insert_with(|| rule(why));
                    return;
                }
                Err(e) => format!("serial `{serial}`: {e}"),
            },
            _ => "more than two fields (expected `device-id [serial]`)".to_string(),
        };
        let problem = RevocationProblem::Invalid {
            line,
            text: text.to_string(),
            why,
            device_revoked: device_ok,
        };
        self.devices
            .entry(device.to_string())
            .or_insert_with(|| rule(format!("revocation list {problem}")));
        self.problems.push(problem);
    }

    /// Every device revoked as a whole, with the rule that does it: listed alone, or named by
    /// a line that does not parse (which revokes the device rather than fail open).
    pub fn device_rules(&self) -> HashMap<String, RevocationRule> {
        self.devices.clone()
    }

    /// The rule that refuses a certificate of `device` with this normalised serial: the
    /// device's own line first, else the serial's.
    pub fn rule_for(&self, device: &str, serial: &str) -> Option<&RevocationRule> {
        self.devices
            .get(device)
            .or_else(|| self.serials.get(serial))
    }

    /// Whether every certificate of `device_id` is revoked.
    pub fn is_revoked(&self, device_id: &str) -> bool {
        self.devices.contains_key(device_id)
    }

    /// Whether a certificate with this serial is revoked; any written form matches
    /// ([`normalize_serial`]), and an unreadable serial counts as revoked.
    pub fn is_serial_revoked(&self, serial: &str) -> bool {
        normalize_serial(serial).map_or(true, |s| self.serials.contains_key(&s))
    }

    /// Whether the certificate is revoked, by device or by serial. Unparseable certificates count
    /// as revoked.
    pub fn is_cert_revoked(&self, cert: &CertificateDer<'_>) -> bool {
        match cert_identity(cert) {
            Ok((device, serial)) => self.is_revoked(&device) || self.is_serial_revoked(&serial),
            Err(_) => true,
        }
    }

    /// The lines that could not be taken as written, in file order.
    pub fn problems(&self) -> &[RevocationProblem] {
        &self.problems
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

/// Revocation figures for `/metrics`.
#[derive(Debug, Default)]
pub struct RevocationStats {
    /// Entries (devices plus serials) in the list in force.
    pub entries: AtomicU64,
    /// Lines of that list that do not parse ([`RevocationProblem::Invalid`]).
    pub invalid: AtomicU64,
    /// Serials in it that match no issued certificate ([`RevocationProblem::Unmatched`]).
    pub unmatched: AtomicU64,
    /// Reloads that failed (the file could not be read); the previous list stays in force.
    pub load_failures: AtomicU64,
    /// Live sessions closed because their certificate became revoked.
    pub sessions_closed: AtomicU64,
    /// Devices the list in force revokes as a whole, each with its rule, for the status page.
    pub revoked_devices: RwLock<HashMap<String, RevocationRule>>,
    /// The devices the hub refused for a revocation, once the server runs
    /// ([`SharedRevocations::refusals`]).
    refusals: OnceLock<Arc<Refusals>>,
}

impl RevocationStats {
    /// Publishes the figures of the list now in force.
    pub fn publish(&self, list: &RevocationList) {
        let count = |unmatched: bool| {
            let n = list
                .problems()
                .iter()
                .filter(|p| matches!(p, RevocationProblem::Unmatched { .. }) == unmatched)
                .count();
            n as u64
        };
        self.entries.store(list.len() as u64, Ordering::Relaxed);
        self.invalid.store(count(false), Ordering::Relaxed);
        self.unmatched.store(count(true), Ordering::Relaxed);
        let rules = list.device_rules();
        *self
            .revoked_devices
            .write()
            .unwrap_or_else(|e| e.into_inner()) = rules;
    }

    /// Shows the refusals the server records (the first call wins).
    pub fn show_refusals(&self, refusals: Arc<Refusals>) {
        let _ = self.refusals.set(refusals);
    }

    /// Why `device` is revoked: the hub refused a certificate of it for a revocation (any
    /// rule: by device or by serial), or the list in force revokes it as a whole.
    pub fn revoked(&self, device: &str) -> Option<Revoked> {
        if let Some(refusal) = self.refusals.get().and_then(|r| r.of(device)) {
            return Some(Revoked {
                rule: refusal.rule.clone(),
                refusal: Some(refusal),
            });
        }
        let map = self
            .revoked_devices
            .read()
            .unwrap_or_else(|e| e.into_inner());
        let rule = map.get(device)?.clone();
        Some(Revoked {
            rule,
            refusal: None,
        })
    }

    /// [`RevocationStats::revoked`] in words.
    pub fn revoked_reason(&self, device: &str) -> Option<String> {
        self.revoked(device).map(|r| r.reason())
    }

    /// Every device refused for a revocation, by name, each with why: some may have no
    /// catalog row (refused at their first handshake).
    pub fn refused_devices(&self) -> Vec<(String, Refusal)> {
        self.refusals.get().map(|r| r.all()).unwrap_or_default()
    }
}

/// Why a device is revoked, as the status page and `GET /v1/devices` show it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Revoked {
    /// The line of the revocation list that does it.
    pub rule: RevocationRule,
    /// When and where the hub refused a certificate of it; `None` for a device the list
    /// revokes as a whole that has not tried since.
    pub refusal: Option<Refusal>,
}

impl Revoked {
    /// "refused at the TLS handshake for certificate serial 42bb57 (first ..., last ...):
    /// revocation list line 1 `dev-1 42bb57` revokes ...".
    pub fn reason(&self) -> String {
        match &self.refusal {
            Some(r) => format!("{}: {}", r.describe(), self.rule.why),
            None => self.rule.why.clone(),
        }
    }
}

/// A revocation list shared with the TLS verifier and reloaded when its file (or the issuance
/// record beside it) changes.
#[derive(Debug)]
pub struct SharedRevocations {
    path: PathBuf,
    issued_path: PathBuf,
    list: RwLock<Arc<RevocationList>>,
    /// Both files' stamps when last loaded: a change in either triggers a reload.
    stamp: RwLock<[Option<FileStamp>; 2]>,
    /// The devices refused for a revocation, for the status page.
    refusals: Arc<Refusals>,
}

impl SharedRevocations {
    /// Loads `path` (missing = empty), checking its serials against the issuance record
    /// `issued.txt` beside it when there is one. Every problem is logged at error level.
    pub fn open(path: &Path) -> Result<Arc<SharedRevocations>, std::io::Error> {
        let issued_path = path.with_file_name(ISSUED_FILE);
        let stamp = [file_stamp(path), file_stamp(&issued_path)];
        let list = load_reported(path, &issued_path)?;
        Ok(Arc::new(SharedRevocations {
            path: path.to_path_buf(),
            issued_path,
            list: RwLock::new(Arc::new(list)),
            stamp: RwLock::new(stamp),
            refusals: Arc::default(),
        }))
    }

    /// The list's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The current list.
    pub fn current(&self) -> Arc<RevocationList> {
        self.list.read().expect("revocation lock").clone()
    }

    /// The devices refused for a revocation (recorded by the verifier and the sessions).
    pub fn refusals(&self) -> &Arc<Refusals> {
        &self.refusals
    }

    /// Reloads the file if it (or the issuance record) changed; returns `true` when it did. The
    /// server driver polls this and then closes connections of certificates that became
    /// revoked. On an error the previous list stays in force.
    pub fn reload_if_changed(&self) -> Result<bool, std::io::Error> {
        let stamp = [file_stamp(&self.path), file_stamp(&self.issued_path)];
        if *self.stamp.read().expect("revocation lock") == stamp {
            return Ok(false);
        }
        let list = load_reported(&self.path, &self.issued_path)?;
        self.refusals.reloaded(&list);
        *self.list.write().expect("revocation lock") = Arc::new(list);
        *self.stamp.write().expect("revocation lock") = stamp;
        Ok(true)
    }
}

/// Loads the list and logs each of its problems loudly.
fn load_reported(path: &Path, issued_path: &Path) -> Result<RevocationList, std::io::Error> {
    let issued = IssuanceRecord::load(issued_path).unwrap_or_else(|e| {
        tracing::error!(path = %issued_path.display(), error = %e, "cannot read the issuance record; revoked serials are not checked");
        None
    });
    let list = RevocationList::load_checked(path, issued.as_ref())?;
    for problem in list.problems() {
        tracing::error!(path = %path.display(), "revocation list: {problem}");
    }
    Ok(list)
}

/// What identifies a version of a file: a change in any of these means it was rewritten.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileStamp {
    modified: Option<SystemTime>,
    len: u64,
    inode: u64,
    changed_ns: i64,
}

fn file_stamp(path: &Path) -> Option<FileStamp> {
    let m = std::fs::metadata(path).ok()?;
    #[cfg(unix)]
    let (inode, changed_ns) = {
        use std::os::unix::fs::MetadataExt;
        (m.ino(), m.ctime() * 1_000_000_000 + m.ctime_nsec())
    };
    #[cfg(not(unix))]
    let (inode, changed_ns) = (0, 0);
    Some(FileStamp {
        modified: m.modified().ok(),
        len: m.len(),
        inode,
        changed_ns,
    })
}

/// The device id of a client certificate: its subject common name, validated.
pub fn device_id_from_cert(cert: &CertificateDer<'_>) -> Result<String, CertIdError> {
    cert_identity(cert).map(|(device, _)| device)
}

/// The device id and the serial (normalised, [`normalize_serial`]) of a certificate.
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
    let serial = serial_of(parsed.raw_serial());
    Ok((cn.to_string(), serial))
}

/// A DER serial's bytes in the normalised form: lowercase hex without leading zeros.
fn serial_of(bytes: &[u8]) -> String {
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    let trimmed = hex.trim_start_matches('0');
    if trimmed.is_empty() { "0" } else { trimmed }.to_string()
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
    Ok(Arc::new(RevocationCheckingVerifier {
        inner,
        revocations,
        refusals_logged: crate::logging::OncePer::new(REFUSAL_LOG_PERIOD),
    }))
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

/// A device refused at the handshake is logged at most once per this period.
const REFUSAL_LOG_PERIOD: std::time::Duration = std::time::Duration::from_secs(60);

/// Wraps webpki's verifier and rejects revoked devices at the handshake.
#[derive(Debug)]
struct RevocationCheckingVerifier {
    inner: Arc<dyn ClientCertVerifier>,
    revocations: Arc<SharedRevocations>,
    /// Refusals are logged once per device (certificate CN) per [`REFUSAL_LOG_PERIOD`], so a
    /// device retrying in a loop, or a flood of them, cannot fill the disk.
    refusals_logged: crate::logging::OncePer,
}

impl RevocationCheckingVerifier {
    /// Logs a refused client certificate with its CN: the device id it claims (not verified
    /// when the chain itself was refused).
    fn refused(&self, cert: &CertificateDer<'_>, why: rustls::Error) -> rustls::Error {
        let device = device_id_from_cert(cert).unwrap_or_else(|_| "(no readable CN)".into());
        if self
            .refusals_logged
            .allow(&device, std::time::Instant::now())
        {
            tracing::info!(
                %device,
                reason = %why,
                "refused a device's TLS handshake (logged once per device per minute)"
            );
        }
        why
    }
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
            .verify_client_cert(end_entity, intermediates, now)
            .map_err(|e| self.refused(end_entity, e))?;
        let list = self.revocations.current();
        if list.is_cert_revoked(end_entity) {
            let refusals = self.revocations.refusals();
            refusals.refused(&list, end_entity, RefusedAt::Handshake);
            let revoked = rustls::Error::InvalidCertificate(rustls::CertificateError::Revoked);
            return Err(self.refused(end_entity, revoked));
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
        let paths = crate::config::TlsPaths::new(
            pki.join("ca.pem"),
            pki.join("hub.pem"),
            pki.join("hub.key"),
        );
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
    fn revoked_devices_carry_why_for_the_status_page() {
        let list = RevocationList::parse("dev-a\ndev-b not-a-serial\ndev-c 0a\n");
        let stats = RevocationStats::default();
        stats.publish(&list);
        let a = stats.revoked_reason("dev-a").expect("listed alone");
        assert!(a.contains("names the device"), "{a}");
        let b = stats
            .revoked_reason("dev-b")
            .expect("an invalid line revokes the device");
        assert!(b.contains("line 2") && b.contains("whole device"), "{b}");
        // One certificate revoked by serial leaves the device itself accepted.
        assert_eq!(stats.revoked_reason("dev-c"), None);
        stats.publish(&RevocationList::parse(""));
        assert_eq!(
            stats.revoked_reason("dev-a"),
            None,
            "a reload replaces the reasons"
        );
    }

    #[test]
    fn revocation_by_serial() {
        let list = RevocationList::parse("# comment\nd1\nd2 0A0b\n\n  \n");
        assert!(list.is_revoked("d1"));
        assert!(!list.is_revoked("d2"));
        assert!(list.is_serial_revoked("0a0b"));
        assert_eq!(list.len(), 2);
    }

    #[test]
    fn serials_normalise_from_every_written_form() {
        let same = [
            "42bb57",
            "42BB57",
            "42:bb:57",
            "42:BB:57",
            "00:42:bb:57",
            "0042bb57",
            "0x42bb57",
            "serial=42BB57",
            "  42:bb:57 ",
        ];
        for form in same {
            assert_eq!(normalize_serial(form).as_deref(), Ok("42bb57"), "{form}");
        }
        assert_eq!(normalize_serial("00").as_deref(), Ok("0"));
        assert_eq!(normalize_serial(""), Err(SerialError::Empty));
        assert_eq!(normalize_serial("0x"), Err(SerialError::Empty));
        assert_eq!(normalize_serial("42bg57"), Err(SerialError::NotHex('g')));
        assert_eq!(
            normalize_serial("42:b:57"),
            Err(SerialError::BadGroup("b".into()))
        );
        assert_eq!(
            normalize_serial("42::57"),
            Err(SerialError::BadGroup(String::new()))
        );
        assert_eq!(
            normalize_serial(&"1".repeat(41)),
            Err(SerialError::TooLong(41))
        );
        assert!(normalize_serial(&format!("00{}", "1".repeat(40))).is_ok());
    }

    /// `openssl x509 -text` style: uppercase pairs between colons.
    fn colon_form(serial: &str) -> String {
        let even = if serial.len() % 2 == 1 {
            format!("0{serial}")
        } else {
            serial.to_string()
        };
        let pairs: Vec<String> = even
            .as_bytes()
            .chunks(2)
            .map(|p| String::from_utf8_lossy(p).to_uppercase())
            .collect();
        pairs.join(":")
    }

    #[test]
    fn a_serial_in_colon_form_revokes_that_certificate_only() {
        let dir = tempfile::tempdir().unwrap();
        init(dir.path(), &[], false).unwrap();
        let old = issue(dir.path(), "d1", &dir.path().join("old")).unwrap();
        let new = issue(dir.path(), "d1", &dir.path().join("new")).unwrap();
        let out = revoke(dir.path(), "d1", Some(&colon_form(&old.serial))).unwrap();
        assert_eq!(out.serial.as_deref(), Some(old.serial.as_str()));
        assert!(out.warning.is_none());
        let written = std::fs::read_to_string(&out.path).unwrap();
        assert_eq!(
            written,
            format!("d1 {}\n", old.serial),
            "written normalised"
        );

        let revs = SharedRevocations::open(&out.path).unwrap();
        let list = revs.current();
        assert!(list.problems().is_empty(), "{:?}", list.problems());
        let old_cert = load_certs(&old.device_pem).unwrap().remove(0);
        let new_cert = load_certs(&new.device_pem).unwrap().remove(0);
        assert!(list.is_cert_revoked(&old_cert));
        assert!(
            !list.is_cert_revoked(&new_cert),
            "the re-issued certificate works"
        );
        assert!(list.is_serial_revoked(&colon_form(&old.serial)));
    }

    #[test]
    fn revoking_a_serial_nobody_was_issued_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        init(dir.path(), &[], false).unwrap();
        let d1 = issue(dir.path(), "d1", &dir.path().join("d1")).unwrap();
        let d2 = issue(dir.path(), "d2", &dir.path().join("d2")).unwrap();
        // Someone else's serial, a typo, and garbage: nothing is written for any of them.
        let (head, last) = d1.serial.split_at(d1.serial.len() - 1);
        let typo = format!("{head}{}", if last == "0" { "1" } else { "0" });
        for (device, serial) in [
            ("d1", d2.serial.as_str()),
            ("d1", &typo),
            ("d3", &d1.serial),
        ] {
            let err = revoke(dir.path(), device, Some(serial)).unwrap_err();
            assert!(matches!(err, PkiError::UnknownSerial { .. }), "{err}");
            let msg = err.to_string();
            assert!(msg.contains(ISSUED_FILE) && msg.contains(device), "{msg}");
        }
        let msg = revoke(dir.path(), "d1", Some("xyz"))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("`x` is not a hex digit"), "{msg}");
        assert!(!dir.path().join(REVOKED_FILE).exists());
        // Without an issuance record a serial cannot be checked.
        std::fs::remove_file(dir.path().join(ISSUED_FILE)).unwrap();
        let err = revoke(dir.path(), "d1", Some(&d1.serial)).unwrap_err();
        assert!(matches!(err, PkiError::NoIssuanceRecord(_)), "{err}");
        // A whole device the record does not know is written, with a warning.
        issue(dir.path(), "d4", &dir.path().join("d4")).unwrap();
        let out = revoke(dir.path(), "d5", None).unwrap();
        assert!(out.warning.unwrap().contains("d5"));
    }

    #[test]
    fn the_hub_reports_every_line_it_cannot_take_as_written() {
        let mut record = IssuanceRecord::default();
        record
            .serials
            .entry("d1".into())
            .or_default()
            .insert("abc".into());
        let text = "d1 AB:C0\nd2 42:b:57\nd3 1 2\nbad/id\nd4\n# note\nd1 0abc\n";
        let list = RevocationList::parse_checked(text, Some(&record));
        let p = list.problems();
        assert_eq!(p.len(), 4, "{p:?}");
        assert!(
            matches!(&p[0], RevocationProblem::Unmatched { line: 1, device, serial } if device == "d1" && serial == "abc0")
        );
        assert!(matches!(
            &p[1],
            RevocationProblem::Invalid {
                line: 2,
                device_revoked: true,
                ..
            }
        ));
        assert!(matches!(
            &p[2],
            RevocationProblem::Invalid {
                line: 3,
                device_revoked: true,
                ..
            }
        ));
        assert!(matches!(
            &p[3],
            RevocationProblem::Invalid {
                line: 4,
                device_revoked: false,
                ..
            }
        ));
        // Fail closed: a device whose line cannot be read is revoked whole.
        assert!(list.is_revoked("d2") && list.is_revoked("d3") && list.is_revoked("d4"));
        assert!(!list.is_revoked("d1"));
        assert!(list.is_serial_revoked("abc") && list.is_serial_revoked("abc0"));
        assert!(p[1].to_string().contains("whole device"), "{}", p[1]);
        let stats = RevocationStats::default();
        stats.publish(&list);
        assert_eq!(stats.invalid.load(Ordering::Relaxed), 3);
        assert_eq!(stats.unmatched.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn issue_refuses_to_replace_a_key_without_force() {
        let dir = tempfile::tempdir().unwrap();
        init(dir.path(), &[], false).unwrap();
        let out = dir.path().join("out");
        let first = issue(dir.path(), "d1", &out).unwrap();
        let key = std::fs::read(&first.device_key).unwrap();
        let err = issue(dir.path(), "d1", &out).unwrap_err();
        assert!(
            matches!(&err, PkiError::Exists(p) if p.ends_with("device.pem")),
            "{err}"
        );
        assert!(err.to_string().contains("--force"));
        assert_eq!(std::fs::read(&first.device_key).unwrap(), key);
        let second = issue_with_years(dir.path(), "d1", &out, 1, true).unwrap();
        assert_ne!(std::fs::read(&second.device_key).unwrap(), key);
        assert_ne!(first.serial, second.serial);
        let record = IssuanceRecord::load(&dir.path().join(ISSUED_FILE))
            .unwrap()
            .unwrap();
        assert_eq!(
            record.serials_of("d1").len(),
            2,
            "both issuances are recorded"
        );
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode(&second.device_key), 0o600);
            assert_eq!(mode(&second.device_pem), 0o644);
        }
        // Nothing is left behind but the three files.
        let names: BTreeSet<String> = std::fs::read_dir(&out)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names.len(), 3, "{names:?}");
    }

    #[cfg(unix)]
    #[test]
    fn issue_never_writes_through_a_symlink() {
        let dir = tempfile::tempdir().unwrap();
        init(dir.path(), &[], false).unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        let out = dir.path().join("out");
        std::fs::create_dir(&out).unwrap();
        // The temporary names the old code used, and the final name, all point at the victim.
        for name in ["device.tmp", "ca.tmp"] {
            std::os::unix::fs::symlink(&victim, out.join(name)).unwrap();
        }
        std::os::unix::fs::symlink(&victim, out.join("device.key")).unwrap();
        let err = issue(dir.path(), "d1", &out).unwrap_err();
        assert!(
            matches!(&err, PkiError::Exists(p) if p.ends_with("device.key")),
            "{err}"
        );
        let issued = issue_with_years(dir.path(), "d1", &out, 1, true).unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        let meta = std::fs::symlink_metadata(&issued.device_key).unwrap();
        assert!(
            meta.file_type().is_file(),
            "the symlink was replaced, not followed"
        );
        load_key(&issued.device_key).unwrap();
    }
}
