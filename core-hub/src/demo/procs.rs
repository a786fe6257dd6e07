//! The demo's child processes and its working directory, each behind a Drop guard.
//!
//! The demo must never leave a hub or an agent running behind it, whatever way it exits: a
//! failed verification, an error, a panic or ctrl-c. Every child therefore lives in a
//! [`ChildProc`] that kills and reaps it on drop, and a temporary working directory lives in a
//! [`WorkDir`] that removes it on drop unless the user asked to keep it.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};

/// A child process killed and reaped on drop. Its stdout and stderr go to one log file.
#[derive(Debug)]
pub struct ChildProc {
    name: String,
    child: Child,
    log: PathBuf,
}

impl ChildProc {
    /// Starts `program args` with both output streams appended to `log`.
    pub fn spawn(name: &str, program: &Path, args: &[&str], log: &Path) -> Result<ChildProc> {
        let out = File::create(log).with_context(|| format!("creating {}", log.display()))?;
        let err = out.try_clone()?;
        let child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .env("RUST_LOG", "info")
            .spawn()
            .with_context(|| format!("starting {name} ({})", program.display()))?;
        Ok(ChildProc {
            name: name.to_owned(),
            child,
            log: log.to_owned(),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn log(&self) -> &Path {
        &self.log
    }

    /// An error naming the child and quoting its log if it has exited.
    pub fn check_alive(&mut self) -> Result<()> {
        match self.child.try_wait()? {
            None => Ok(()),
            Some(status) => bail!(
                "{} exited ({status}); the end of {}:\n{}",
                self.name,
                self.log.display(),
                log_tail(&self.log)
            ),
        }
    }
}

impl Drop for ChildProc {
    fn drop(&mut self) {
        // SIGKILL is safe here: both processes are built to survive kill -9 without losing
        // anything they acknowledged, and it cannot be ignored.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The last few KiB of a log file, for error messages.
pub fn log_tail(path: &Path) -> String {
    const TAIL: u64 = 4096;
    let Ok(mut f) = File::open(path) else {
        return String::from("(no log)");
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(TAIL)));
    let mut text = String::new();
    let _ = f.read_to_string(&mut text);
    text
}

/// The demo's working directory: given by the user (kept) or temporary (removed unless kept).
#[derive(Debug)]
pub struct WorkDir {
    path: PathBuf,
    remove: bool,
}

impl WorkDir {
    /// Uses `dir` (which must be empty or absent) or makes a fresh temporary directory.
    pub fn new(dir: Option<&Path>, keep: bool) -> Result<WorkDir> {
        match dir {
            Some(dir) => {
                if dir.exists() && std::fs::read_dir(dir)?.next().is_some() {
                    bail!(
                        "{} is not empty: the demo verifies exactly what it writes, so give it an empty or new directory",
                        dir.display()
                    );
                }
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("creating {}", dir.display()))?;
                let path = dir.canonicalize()?;
                Ok(WorkDir {
                    path,
                    remove: false,
                })
            }
            None => {
                let nanos = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map(|d| d.subsec_nanos())
                    .unwrap_or(0);
                let path = std::env::temp_dir()
                    .join(format!("tributary-demo-{}-{nanos:08x}", std::process::id()));
                std::fs::create_dir_all(&path)
                    .with_context(|| format!("creating {}", path.display()))?;
                Ok(WorkDir {
                    path,
                    remove: !keep,
                })
            }
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the directory disappears when the demo exits.
    pub fn removed_at_exit(&self) -> bool {
        self.remove
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        if self.remove {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// A loopback TCP port free right now. The tiny race with other programs is acceptable for a
/// demo; a clash shows up as a clear bind error in the child's log.
pub fn free_tcp_port() -> Result<SocketAddr> {
    Ok(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?.local_addr()?)
}

/// A loopback UDP port free right now (the hub's QUIC listener).
pub fn free_udp_port() -> Result<SocketAddr> {
    Ok(UdpSocket::bind((Ipv4Addr::LOCALHOST, 0))?.local_addr()?)
}

/// The `edge-agent` binary next to the running `core-hub`.
pub fn sibling_edge_agent() -> Result<PathBuf> {
    let me = std::env::current_exe().context("locating the core-hub binary")?;
    let dir = me
        .parent()
        .context("the core-hub binary has no directory")?;
    let path = dir.join(format!("edge-agent{}", std::env::consts::EXE_SUFFIX));
    if !path.is_file() {
        bail!(
            "the edge-agent binary is missing: expected {} next to core-hub; build it with cargo build --release (or cargo build --workspace)",
            path.display()
        );
    }
    Ok(path)
}

/// A TOML basic string: quotes and backslashes escaped, so any path is written safely.
pub fn toml_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The hub's config for the demo.
pub fn hub_toml(data_dir: &Path, quic: SocketAddr, http: SocketAddr, pki_dir: &Path) -> String {
    let p = |path: PathBuf| toml_str(&path.display().to_string());
    format!(
        "# Written by `core-hub demo`.\ndata_dir = {}\n\n[listen]\nquic = \"{quic}\"\nhttp = \"{http}\"\n\n[tls]\nca = {}\ncert = {}\nkey = {}\n\n\
         # Short chunks, so a demo run leaves Parquet files in tier 2 (data_dir/tier2).\n[tier2]\nchunk_age_max = \"5s\"\n",
        p(data_dir.to_owned()),
        p(pki_dir.join("ca.pem")),
        p(pki_dir.join("hub.pem")),
        p(pki_dir.join("hub.key")),
    )
}

/// One edge's config for the demo: its hub is the edge's relay.
pub fn edge_toml(
    data_dir: &Path,
    relay: SocketAddr,
    http: SocketAddr,
    cert_dir: &Path,
    stream: &str,
) -> String {
    let p = |path: PathBuf| toml_str(&path.display().to_string());
    format!(
        "# Written by `core-hub demo`. The hub address is the demo's relay, which drops the link on a schedule.\n\
         data_dir = {}\n\n[hub]\naddr = \"{relay}\"\nserver_name = \"localhost\"\n\n[tls]\nca = {}\ncert = {}\nkey = {}\n\n\
         [http]\nlisten = \"{http}\"\n\n[storage]\nfsync = \"interval:10ms\"\n\n[[streams]]\nname = {}\n",
        p(data_dir.to_owned()),
        p(cert_dir.join("ca.pem")),
        p(cert_dir.join("device.pem")),
        p(cert_dir.join("device.key")),
        toml_str(stream),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::HubConfig;

    #[test]
    fn written_configs_parse() {
        let hub = hub_toml(
            Path::new("/d/\"q\"/hub"),
            "127.0.0.1:1".parse().unwrap(),
            "127.0.0.1:2".parse().unwrap(),
            Path::new("/d/pki"),
        );
        let cfg = HubConfig::from_toml(&hub).unwrap();
        assert_eq!(cfg.data_dir, PathBuf::from("/d/\"q\"/hub"));
        assert_eq!(cfg.tls.unwrap().key, PathBuf::from("/d/pki/hub.key"));
        let edge = edge_toml(
            Path::new("/e"),
            "127.0.0.1:3".parse().unwrap(),
            "127.0.0.1:4".parse().unwrap(),
            Path::new("/c"),
            "telemetry",
        );
        assert!(edge.contains("addr = \"127.0.0.1:3\""), "{edge}");
    }
}
