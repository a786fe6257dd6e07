//! `edge-agent doctor`: checks what a device needs before it can record and ship, and says what
//! to fix.
//!
//! Each check prints one line, `ok`, `warn` or `FAIL`, with its finding and, when it is not
//! ok, the fix. The command exits non-zero when any check failed, so provisioning scripts can
//! gate on it. Checks that need the network (broker, hub) connect for real, with a short
//! deadline. The hub check passes only once the hub answered a Hello with a Welcome
//! (`doctor/hub.rs`): a finished TLS handshake alone proves nothing under TLS 1.3.
//!
//! For tests, `TRIBUTARY_DOCTOR_NOW_UNIX` replaces the wall clock (seconds since the epoch):
//! this is how a board that booted at 1970 is reproduced. Only builds with the
//! `fault-injection` feature read it (the test build, `cargo build --workspace --all-targets`).

use std::net::ToSocketAddrs;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use edge_agent::config::{EdgeConfig, SourceConfig};
use edge_agent::link::{self, TlsPaths};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, UnixTime};

use self::hub::Verdict;

mod hub;

/// How long the hub check waits for the handshake, and then for the hub's verdict on the Hello.
const HUB_WAIT: Duration = Duration::from_secs(5);

/// The outcome of one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Level {
    Ok,
    Warn,
    Fail,
}

struct Report {
    failed: usize,
}

impl Report {
    fn line(&mut self, level: Level, check: &str, finding: &str, fix: Option<&str>) {
        let tag = match level {
            Level::Ok => "ok  ",
            Level::Warn => "warn",
            Level::Fail => "FAIL",
        };
        println!("{tag}  {check:<12} {finding}");
        if let Some(fix) = fix {
            println!("      {:<12} fix: {fix}", "");
        }
        if level == Level::Fail {
            self.failed += 1;
        }
    }
}

/// Runs every check; returns an error (non-zero exit) if any failed.
pub fn doctor(config_path: &Path) -> anyhow::Result<()> {
    let mut r = Report { failed: 0 };
    let cfg = match EdgeConfig::load(config_path) {
        Ok(cfg) => {
            r.line(
                Level::Ok,
                "config",
                &format!("{} parses", config_path.display()),
                None,
            );
            cfg
        }
        Err(e) => {
            r.line(
                Level::Fail,
                "config",
                &e.to_string(),
                Some("correct the key named above"),
            );
            anyhow::bail!("1 check failed: the config could not be read");
        }
    };
    let now = check_clock(&mut r);
    check_disk(&mut r, &cfg);
    check_certificates(&mut r, &cfg, now);
    check_broker(&mut r, &cfg);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(check_hub(&mut r, &cfg));
    if r.failed > 0 {
        anyhow::bail!("{} check(s) failed", r.failed);
    }
    println!("all checks passed");
    Ok(())
}

fn wall_clock() -> u64 {
    // Test builds only (`fault-injection`): release binaries read no test clock.
    #[cfg(feature = "fault-injection")]
    if let Some(fake) = std::env::var("TRIBUTARY_DOCTOR_NOW_UNIX")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        return fake;
    }
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The clock must not be older than the binary. TLS still works then (validity is checked at
/// `max(now, build time)`), but event times stamped from the clock are wrong.
fn check_clock(r: &mut Report) -> u64 {
    let now = wall_clock();
    let built: u64 = link::BUILD_UNIX.parse().unwrap_or(0);
    if now + 60 < built {
        r.line(
            Level::Fail,
            "clock",
            &format!("the clock reads {now} s since 1970, before this binary was built ({built})"),
            Some("set the clock: enable NTP (systemd-timesyncd or chrony) or fit an RTC; records stamped with receive time are wrong until then"),
        );
    } else {
        r.line(
            Level::Ok,
            "clock",
            "the clock is later than the build time",
            None,
        );
    }
    now
}

fn check_disk(r: &mut Report, cfg: &EdgeConfig) {
    let dir = &cfg.data_dir;
    let probe_dir = if dir.exists() {
        dir.clone()
    } else {
        dir.parent().map(Path::to_path_buf).unwrap_or_default()
    };
    let probe = probe_dir.join(format!(".doctor-{}", std::process::id()));
    if let Err(e) = std::fs::write(&probe, b"probe").and_then(|_| std::fs::remove_file(&probe)) {
        r.line(
            Level::Fail,
            "disk",
            &format!("cannot write in {}: {e}", probe_dir.display()),
            Some("create the data directory and make it writable by the agent's user"),
        );
        return;
    }
    match free_bytes(&probe_dir) {
        Some(0) => r.line(
            Level::Fail,
            "disk",
            &format!("{} is full", probe_dir.display()),
            Some("free space on that filesystem, or move data_dir"),
        ),
        Some(free) if free < cfg.storage.disk_bytes_max => r.line(
            Level::Warn,
            "disk",
            &format!(
                "{} bytes free, less than storage.disk_bytes_max = {}",
                free, cfg.storage.disk_bytes_max
            ),
            Some("lower storage.disk_bytes_max below the free space, or the budget can never be reached and the disk fills first"),
        ),
        Some(free) => r.line(Level::Ok, "disk", &format!("{free} bytes free for a budget of {}", cfg.storage.disk_bytes_max), None),
        None => r.line(Level::Warn, "disk", "free space unknown", None),
    }
}

#[allow(unsafe_code)]
fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `path` is a valid NUL-terminated string and `st` a properly sized out-parameter.
    let rc = unsafe { libc::statvfs(path.as_ptr(), &mut st) };
    (rc == 0).then(|| st.f_bavail as u64 * st.f_frsize as u64)
}

fn check_certificates(r: &mut Report, cfg: &EdgeConfig, now: u64) {
    let Some(tls) = &cfg.tls else {
        r.line(
            Level::Ok,
            "certificate",
            "no [tls]: replication is not configured",
            None,
        );
        return;
    };
    let paths = TlsPaths {
        ca: tls.ca.clone(),
        cert: tls.cert.clone(),
        key: tls.key.clone(),
    };
    if let Err(e) = link::client_config(&paths) {
        r.line(Level::Fail, "certificate", &e.to_string(), Some("re-issue with `core-hub pki issue --dir PKI --device ID --out DIR` and point [tls] at the files"));
        return;
    }
    match verify_chain(&paths, now) {
        Ok(()) => r.line(Level::Ok, "certificate", &format!("{} is signed by {}", paths.cert.display(), paths.ca.display()), None),
        Err(e) => r.line(
            Level::Fail,
            "certificate",
            &e,
            Some("the device certificate must come from the same fleet CA as tls.ca: re-issue it with `core-hub pki issue`"),
        ),
    }
}

/// Verifies the device certificate against the configured CA, as the hub will.
fn verify_chain(paths: &TlsPaths, now: u64) -> Result<(), String> {
    let read = |p: &Path| std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()));
    let ca = CertificateDer::from_pem_slice(&read(&paths.ca)?)
        .map_err(|e| format!("{}: {e}", paths.ca.display()))?;
    let leaf = CertificateDer::from_pem_slice(&read(&paths.cert)?)
        .map_err(|e| format!("{}: {e}", paths.cert.display()))?;
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(ca)
        .map_err(|e| format!("{}: {e}", paths.ca.display()))?;
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        std::sync::Arc::new(roots),
        provider,
    )
    .build()
    .map_err(|e| e.to_string())?;
    let at = UnixTime::since_unix_epoch(Duration::from_secs(now)).max(link::build_time());
    verifier.verify_client_cert(&leaf, &[], at).map_err(|e| {
        format!(
            "{} is not accepted by {}: {e}",
            paths.cert.display(),
            paths.ca.display()
        )
    })?;
    Ok(())
}

fn check_broker(r: &mut Report, cfg: &EdgeConfig) {
    for source in &cfg.sources {
        let SourceConfig::Mqtt(m) = source else {
            continue;
        };
        let hostport = m
            .url
            .split("://")
            .nth(1)
            .unwrap_or(&m.url)
            .trim_end_matches('/');
        let hostport = if hostport.contains(':') {
            hostport.to_owned()
        } else {
            format!("{hostport}:1883")
        };
        let reached = hostport
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .and_then(|a| std::net::TcpStream::connect_timeout(&a, Duration::from_secs(2)).ok());
        match reached {
            Some(_) => r.line(
                Level::Ok,
                "broker",
                &format!("{} accepts connections", m.url),
                None,
            ),
            None => r.line(
                Level::Fail,
                "broker",
                &format!("cannot reach the MQTT broker at {}", m.url),
                Some("start the broker (systemctl start mosquitto) or correct [[sources]] url"),
            ),
        }
    }
}

async fn check_hub(r: &mut Report, cfg: &EdgeConfig) {
    let (Some(hub), Some(tls)) = (&cfg.hub, &cfg.tls) else {
        r.line(
            Level::Ok,
            "hub",
            "no [hub]: the agent records locally only",
            None,
        );
        return;
    };
    let paths = TlsPaths {
        ca: tls.ca.clone(),
        cert: tls.cert.clone(),
        key: tls.key.clone(),
    };
    let addr = match tokio::net::lookup_host(&hub.addr)
        .await
        .map(|mut a| a.next())
    {
        Ok(Some(addr)) => addr,
        Ok(None) => {
            return hub_fail(
                r,
                &hub.addr,
                &format!("{} resolves to no address", hub.addr),
            );
        }
        Err(e) => return hub_fail(r, &hub.addr, &format!("resolving {}: {e}", hub.addr)),
    };
    match hub::probe(addr, &hub.server_name, &paths, HUB_WAIT).await {
        Verdict::Accepted { version } => r.line(
            Level::Ok,
            "hub",
            &format!(
                "{} ({addr}) accepted this device (mutual TLS and a protocol version {version} session)",
                hub.addr
            ),
            None,
        ),
        Verdict::Busy { reason } => r.line(
            Level::Warn,
            "hub",
            &format!("{} ({addr}) accepted this device, but {reason}", hub.addr),
            Some("nothing to change on this device: the agent keeps its data and retries"),
        ),
        Verdict::Refused { reason, fix } => r.line(
            Level::Fail,
            "hub",
            &format!("{} ({addr}): {reason}", hub.addr),
            Some(fix),
        ),
        Verdict::Unreachable { reason, fix } => r.line(
            Level::Fail,
            "hub",
            &format!("cannot connect to the hub at {}: {reason}", hub.addr),
            Some(fix),
        ),
    }
}

fn hub_fail(r: &mut Report, addr: &str, why: &str) {
    r.line(
        Level::Fail,
        "hub",
        &format!("cannot connect to the hub at {addr}: {why}"),
        Some("check hub.addr (host:port) and the device's DNS"),
    );
}
