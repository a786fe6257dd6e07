//! Test support: an s3s-fs S3 server on loopback, for this crate's tests, the hub's tier-2
//! tests and the benchmarks; a PostgreSQL server ([`postgres`]).
//!
//! s3s-fs is installed by `.ci/test` (`cargo install s3s-fs@0.14.1 --features binary --locked`).
//! The binary is found through `S3S_FS_BIN`, then `PATH`, then `~/.cargo/bin`. A bucket is a
//! directory under the server's root. The server is killed when the handle drops; it can also
//! be stopped and restarted on the same port and root to simulate a tier-2 outage.

use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::config::TierConfig;

pub mod postgres;

pub const ACCESS_KEY: &str = "tributary-test";
pub const SECRET_KEY: &str = "tributary-test-secret";
pub const BUCKET: &str = "tier2";

/// Why the test server could not be started.
#[derive(Debug, thiserror::Error)]
pub enum S3sFsError {
    #[error(
        "s3s-fs binary not found (set S3S_FS_BIN, or install it with `cargo install s3s-fs@0.14.1 --features binary --locked`)"
    )]
    NotInstalled,
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    #[error("s3s-fs did not accept connections on {addr} within {secs}s; log: {log}")]
    NotReady {
        addr: SocketAddr,
        secs: u64,
        log: String,
    },
}

/// A running (or stopped) s3s-fs server with its own temporary root.
#[derive(Debug)]
pub struct S3sFs {
    bin: PathBuf,
    root: tempdir::TempRoot,
    addr: SocketAddr,
    child: Option<Child>,
}

/// A self-deleting directory, so this module needs no dev-only dependency.
mod tempdir {
    use std::path::{Path, PathBuf};

    #[derive(Debug)]
    pub struct TempRoot(PathBuf);

    impl TempRoot {
        pub fn new() -> std::io::Result<TempRoot> {
            use std::sync::atomic::{AtomicU64, Ordering};
            static N: AtomicU64 = AtomicU64::new(0);
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0);
            let dir = std::env::temp_dir().join(format!(
                "tributary-s3s-{}-{nanos}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::create_dir_all(&dir)?;
            Ok(TempRoot(dir))
        }
        pub fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for TempRoot {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// The s3s-fs binary, if installed.
pub fn s3s_fs_bin() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("S3S_FS_BIN") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join("s3s-fs"))
        .chain(std::env::var_os("HOME").map(|h| Path::new(&h).join(".cargo/bin/s3s-fs")))
        .find(|p| p.is_file())
}

/// Ports below the kernel's ephemeral range (the test harness's picker, shared by path): the
/// server keeps its port across [`S3sFs::stop`] and [`S3sFs::restart`], and meanwhile no
/// outgoing connection can take it as its source port.
#[path = "../../../tests/src/ports.rs"]
#[allow(dead_code)]
mod ports;

fn free_port() -> std::io::Result<u16> {
    Ok(ports::tcp())
}

impl S3sFs {
    /// Starts s3s-fs on a free loopback port with a fresh root and bucket [`BUCKET`].
    pub fn start() -> Result<S3sFs, S3sFsError> {
        let bin = s3s_fs_bin().ok_or(S3sFsError::NotInstalled)?;
        let io = |what: &str| {
            let what = what.to_owned();
            move |source| S3sFsError::Io { what, source }
        };
        let root = tempdir::TempRoot::new().map_err(io("creating s3s-fs root"))?;
        std::fs::create_dir_all(root.path().join("data").join(BUCKET))
            .map_err(io("creating bucket directory"))?;
        let port = free_port().map_err(io("finding a free port"))?;
        let mut server = S3sFs {
            bin,
            root,
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            child: None,
        };
        server.restart()?;
        Ok(server)
    }

    /// Starts the server again after [`S3sFs::stop`] (same port, same data).
    pub fn restart(&mut self) -> Result<(), S3sFsError> {
        if self.child.is_some() {
            return Ok(());
        }
        let log_path = self.root.path().join("s3s-fs.log");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|source| S3sFsError::Io {
                what: format!("opening {}", log_path.display()),
                source,
            })?;
        let log2 = log.try_clone().map_err(|source| S3sFsError::Io {
            what: "cloning log handle".into(),
            source,
        })?;
        let child = Command::new(&self.bin)
            .arg("--host")
            .arg("127.0.0.1")
            .arg("--port")
            .arg(self.addr.port().to_string())
            .arg("--access-key")
            .arg(ACCESS_KEY)
            .arg("--secret-key")
            .arg(SECRET_KEY)
            .arg(self.root.path().join("data"))
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            .spawn()
            .map_err(|source| S3sFsError::Io {
                what: format!("spawning {}", self.bin.display()),
                source,
            })?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if TcpStream::connect_timeout(&self.addr, Duration::from_millis(200)).is_ok() {
                return Ok(());
            }
            let exited = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
                .is_some();
            if exited || Instant::now() > deadline {
                self.stop();
                return Err(S3sFsError::NotReady {
                    addr: self.addr,
                    secs: 20,
                    log: std::fs::read_to_string(&log_path).unwrap_or_default(),
                });
            }
            // Poll again shortly: the server binds within milliseconds of starting.
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Kills the server (data stays); requests fail until [`S3sFs::restart`].
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The bucket's directory on disk (objects appear as files under it).
    pub fn bucket_dir(&self) -> PathBuf {
        self.root.path().join("data").join(BUCKET)
    }

    /// A tier config pointing at this server's bucket, with explicit credentials.
    pub fn config(&self) -> TierConfig {
        TierConfig::S3 {
            endpoint: self.endpoint(),
            region: "us-east-1".to_owned(),
            bucket: BUCKET.to_owned(),
            access_key_id: Some(ACCESS_KEY.to_owned()),
            secret_access_key: Some(SECRET_KEY.to_owned()),
            allow_http: true,
        }
    }
}

impl Drop for S3sFs {
    fn drop(&mut self) {
        self.stop();
    }
}
