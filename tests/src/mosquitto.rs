//! A real mosquitto broker for MQTT interop tests, on a free loopback port.
//!
//! The broker is the real thing (not a mock) because the agent's QoS 1 ack ordering and DUP
//! handling must hold against the broker users run. Persistence is off unless asked for; with a
//! data directory the broker keeps its queues across [`Mosquitto::restart`].

use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::ports;
use crate::procs::{Proc, ProcSpec, wait_until};

/// How long the broker may take to accept TCP connections.
const START_TIMEOUT: Duration = Duration::from_secs(10);

/// Options for [`Mosquitto::start_with`].
#[derive(Debug, Clone, Default)]
pub struct MosquittoOptions {
    /// Listen on this port instead of a free one.
    pub port: Option<u16>,
    /// Turn persistence on, storing `mosquitto.db` in this directory.
    pub persistence_dir: Option<PathBuf>,
    /// Extra lines appended to the configuration file verbatim.
    pub extra_conf: Vec<String>,
}

/// A running broker. Dropping it kills the process.
#[derive(Debug)]
pub struct Mosquitto {
    proc: Proc,
    port: u16,
    conf_path: PathBuf,
    _dir: tempfile::TempDir,
}

impl Mosquitto {
    /// A broker on a free loopback port, anonymous access, persistence off.
    pub fn start() -> Result<Self> {
        Self::start_with(MosquittoOptions::default())
    }

    pub fn start_with(options: MosquittoOptions) -> Result<Self> {
        let binary = find_binary()?;
        let dir = tempfile::Builder::new()
            .prefix("trb-mosquitto-")
            .tempdir()?;
        let port = options.port.unwrap_or_else(ports::tcp);
        let conf_path = dir.path().join("mosquitto.conf");
        std::fs::write(&conf_path, config_text(port, &options))?;
        let spec = ProcSpec::new(binary)
            .name("mosquitto")
            .arg("-c")
            .arg(&conf_path)
            .log_dir(dir.path());
        let proc = Proc::spawn(spec)?;
        let mut broker = Mosquitto {
            proc,
            port,
            conf_path,
            _dir: dir,
        };
        broker.wait_accepting()?;
        Ok(broker)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from((Ipv4Addr::LOCALHOST, self.port))
    }

    pub fn conf_path(&self) -> &Path {
        &self.conf_path
    }

    /// The broker process, e.g. to `kill9()` it mid-test or read its log.
    pub fn proc_mut(&mut self) -> &mut Proc {
        &mut self.proc
    }

    /// Kills the broker if it runs and starts it again on the same port and data directory.
    pub fn restart(&mut self) -> Result<()> {
        self.proc.restart()?;
        self.wait_accepting()
    }

    /// Stops the broker with SIGTERM, which also makes it save its persistence file.
    pub fn stop(&mut self) -> Result<()> {
        self.proc.terminate(Duration::from_secs(10))?;
        Ok(())
    }

    fn wait_accepting(&mut self) -> Result<()> {
        let addr = self.addr();
        let mut exited = false;
        let accepting = wait_until(
            START_TIMEOUT,
            &format!("mosquitto to accept on {addr}"),
            || {
                exited = !self.proc.is_running();
                exited || TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
            },
        );
        if exited || accepting.is_err() {
            let tail = self.proc.log_tail(20);
            bail!("mosquitto did not start on {addr} (exited: {exited})\n{tail}");
        }
        Ok(())
    }
}

fn config_text(port: u16, options: &MosquittoOptions) -> String {
    let mut lines = vec![
        format!("listener {port} 127.0.0.1"),
        "allow_anonymous true".into(),
        "max_inflight_messages 1000".into(),
        "max_queued_messages 1000000".into(),
        // Running as root, mosquitto would switch to its own user and lose access to our files.
        "user root".into(),
        "log_dest stderr".into(),
    ];
    match &options.persistence_dir {
        Some(dir) => {
            lines.push("persistence true".into());
            lines.push(format!("persistence_location {}/", dir.display()));
        }
        None => lines.push("persistence false".into()),
    }
    lines.extend(options.extra_conf.iter().cloned());
    lines.join("\n") + "\n"
}

fn find_binary() -> Result<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let dirs = std::env::split_paths(&path).chain(["/usr/sbin".into(), "/usr/local/sbin".into()]);
    for dir in dirs {
        let candidate = dir.join("mosquitto");
        if candidate.is_file() {
            return Ok(candidate);
        }
    }
    Err(anyhow::anyhow!("mosquitto is not installed")).context(
        "the MQTT tests need a real broker: run `apt-get install mosquitto` (`.ci/test` does)",
    )
}
