//! A PostgreSQL server of its own for a test: Debian's `postgresql` package (installed by
//! `.ci/test`), a fresh data directory, loopback only, trust authentication, one database
//! ([`DATABASE`]). Found under `/usr/lib/postgresql/<version>/bin` (the newest), or through
//! `PG_BIN_DIR`. As root the server runs as the `postgres` user the package creates (the
//! server refuses to run as root). Stopped (immediate mode) when the handle drops.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The database every test server has.
pub const DATABASE: &str = "tributary";

/// Why the server could not be started.
#[derive(Debug, thiserror::Error)]
pub enum PostgresError {
    #[error(
        "PostgreSQL server binaries not found under /usr/lib/postgresql/*/bin (apt-get install postgresql, or set PG_BIN_DIR)"
    )]
    NotInstalled,
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    #[error("{what} failed: {output}")]
    Command { what: String, output: String },
}

/// A running test server.
#[derive(Debug)]
pub struct Postgres {
    bin: PathBuf,
    port: u16,
    /// Removed after the server stopped (fields drop after `Drop::drop`).
    root: super::tempdir::TempRoot,
}

fn bin_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("PG_BIN_DIR") {
        return Some(PathBuf::from(dir));
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| {
            let e = e.ok()?;
            let v = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("postgres").exists().then_some((v, bin))
        })
        .collect();
    versions.sort();
    versions.pop().map(|(_, b)| b)
}

/// Whether this process runs as root: the owner of a directory it just created.
fn is_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    let dir = super::tempdir::TempRoot::new().ok();
    dir.and_then(|d| std::fs::metadata(d.path()).ok())
        .is_some_and(|m| m.uid() == 0)
}

impl Postgres {
    /// Starts a server on a free loopback port with database [`DATABASE`].
    pub fn start() -> Result<Postgres, PostgresError> {
        let bin = bin_dir().ok_or(PostgresError::NotInstalled)?;
        let root = super::tempdir::TempRoot::new().map_err(|source| PostgresError::Io {
            what: "creating the server's directory".into(),
            source,
        })?;
        let server = Postgres {
            bin,
            port: super::free_port().map_err(|source| PostgresError::Io {
                what: "finding a free port".into(),
                source,
            })?,
            root,
        };
        server.prepare_root()?;
        let data = server.data();
        let data = data.to_str().unwrap_or_default();
        server.run(
            "initdb",
            &["-D", data, "-U", "postgres", "--auth=trust", "-E", "UTF8"],
        )?;
        server.pg_ctl(&["-w", "start"])?;
        let port = server.port.to_string();
        server.run(
            "psql",
            &[
                "-h",
                "127.0.0.1",
                "-p",
                &port,
                "-U",
                "postgres",
                "-v",
                "ON_ERROR_STOP=1",
                "-c",
                &format!("CREATE DATABASE {DATABASE}"),
            ],
        )?;
        Ok(server)
    }

    fn data(&self) -> PathBuf {
        self.root.path().join("data")
    }

    /// The server refuses to run as root: as root, its directory belongs to `postgres`.
    fn prepare_root(&self) -> Result<(), PostgresError> {
        let io = |what: &str| {
            let what = what.to_owned();
            move |source| PostgresError::Io { what, source }
        };
        std::fs::create_dir_all(self.data()).map_err(io("creating the data directory"))?;
        if is_root() {
            let root = self.root.path().to_str().unwrap_or_default().to_owned();
            let out = Command::new("chown")
                .args(["-R", "postgres:postgres", &root])
                .output()
                .map_err(io("running chown"))?;
            if !out.status.success() {
                return Err(PostgresError::Command {
                    what: "chown to the postgres user".into(),
                    output: String::from_utf8_lossy(&out.stderr).into_owned(),
                });
            }
        }
        Ok(())
    }

    /// Runs one of the server's programs (as `postgres` when root).
    fn run(&self, program: &str, args: &[&str]) -> Result<(), PostgresError> {
        let exe = self.bin.join(program);
        let mut cmd = if is_root() {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(&exe);
            c
        } else {
            Command::new(&exe)
        };
        let out = cmd
            .args(args)
            .current_dir(self.root.path())
            .output()
            .map_err(|source| PostgresError::Io {
                what: format!("running {}", exe.display()),
                source,
            })?;
        if !out.status.success() {
            let log =
                std::fs::read_to_string(self.root.path().join("server.log")).unwrap_or_default();
            return Err(PostgresError::Command {
                what: program.into(),
                output: format!(
                    "{}{}{log}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                ),
            });
        }
        Ok(())
    }

    /// Stops the server (fast mode: open connections are cut) and starts it again on the
    /// same port and data.
    pub fn restart(&self) -> Result<(), PostgresError> {
        self.pg_ctl(&["-m", "fast", "-w", "restart"])
    }

    /// Stops the server (fast mode); [`Postgres::resume`] starts it again.
    pub fn stop(&self) -> Result<(), PostgresError> {
        self.pg_ctl(&["-m", "fast", "-w", "stop"])
    }

    /// Starts a stopped server again on the same port and data.
    pub fn resume(&self) -> Result<(), PostgresError> {
        self.pg_ctl(&["-w", "start"])
    }

    fn pg_ctl(&self, action: &[&str]) -> Result<(), PostgresError> {
        let data = self.data();
        let data = data.to_str().unwrap_or_default();
        let log = self.root.path().join("server.log");
        let log = log.to_str().unwrap_or_default();
        let opts = format!(
            "-p {} -k {data} -c listen_addresses=127.0.0.1 -c fsync=on",
            self.port
        );
        let mut args = vec!["-D", data, "-l", log, "-o", &opts];
        args.extend_from_slice(action);
        self.run("pg_ctl", &args)
    }

    /// The loopback port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `postgresql://postgres@127.0.0.1:PORT/tributary`.
    pub fn url(&self) -> String {
        format!("postgresql://postgres@127.0.0.1:{}/{DATABASE}", self.port)
    }

    /// The server's directory (data and log).
    pub fn root(&self) -> &Path {
        self.root.path()
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        let _ = self.pg_ctl(&["-m", "immediate", "-w", "stop"]);
    }
}
