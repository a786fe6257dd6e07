//! Two private network namespaces joined by a veth link, for partition and loss tests with
//! real kernel networking and iptables.
//!
//! Each [`NetnsPair`] owns two fresh namespaces named `trb<pid>n<k>a` and `…b`, each holding one
//! end of a veth link (`veth0`) with `10.201.0.1/30` and `10.201.0.2/30`. The addresses live only
//! inside these namespaces, so pairs never collide with each other or with the host. Faults are
//! iptables DROP rules in the receiving side's INPUT chain, each tagged with a comment so its
//! packet counter proves that the fault really dropped traffic.
//!
//! The test process reaches into a namespace without helpers: [`NetnsPair::in_ns`] runs a
//! closure on a thread that joined the namespace, and sockets created there stay in it.
//! Processes run inside with [`crate::procs::ProcSpec::netns`]. Dropping the pair deletes both
//! namespaces, also during a panic; namespaces left by a killed test run are swept at the next
//! [`NetnsPair::create`].

use std::ffi::OsStr;
use std::fs::File;
use std::io;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::AsRawFd;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};

/// The veth end's name inside each namespace.
pub const IFACE: &str = "veth0";

const PREFIX: &str = "trb";
const ADDRS: [Ipv4Addr; 2] = [Ipv4Addr::new(10, 201, 0, 1), Ipv4Addr::new(10, 201, 0, 2)];

static NEXT_PAIR: AtomicU32 = AtomicU32::new(0);
static NEXT_RULE: AtomicU32 = AtomicU32::new(0);

/// One end of the pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    A,
    B,
}

impl Side {
    fn index(self) -> usize {
        match self {
            Side::A => 0,
            Side::B => 1,
        }
    }

    /// The other end.
    pub fn peer(self) -> Side {
        match self {
            Side::A => Side::B,
            Side::B => Side::A,
        }
    }
}

/// Which layer-4 protocol a drop rule matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum L4 {
    Tcp,
    Udp,
}

/// What a DROP rule matches. The default drops every packet arriving on the side.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DropSpec {
    /// Drop only this fraction of the matching packets (`-m statistic --mode random`).
    pub probability: Option<f64>,
    pub protocol: Option<L4>,
    /// Match a destination port (requires `protocol`).
    pub dport: Option<u16>,
    /// Match a source port (requires `protocol`).
    pub sport: Option<u16>,
}

/// A DROP rule installed in one side's INPUT chain.
#[derive(Debug, Clone, PartialEq)]
pub struct DropRule {
    pub side: Side,
    pub spec: DropSpec,
    tag: String,
}

/// The rules of a full partition, one per side; see [`NetnsPair::partition`].
#[derive(Debug, Clone, PartialEq)]
pub struct Partition {
    pub rules: [DropRule; 2],
}

/// Two namespaces and the veth link between them. Dropping it deletes both.
#[derive(Debug)]
pub struct NetnsPair {
    names: [String; 2],
}

impl NetnsPair {
    /// Creates the namespaces, the link and the addresses, and brings everything up.
    /// Fails with a readable message where namespaces are not permitted (not root, no CAP_SYS_ADMIN).
    pub fn create() -> Result<Self> {
        sweep_stale();
        let k = NEXT_PAIR.fetch_add(1, Ordering::Relaxed);
        let base = format!("{PREFIX}{}n{k}", std::process::id());
        let pair = NetnsPair {
            names: [format!("{base}a"), format!("{base}b")],
        };
        for name in &pair.names {
            ip(&["netns", "add", name]).with_context(|| {
                format!("cannot create network namespace {name}: the namespace tests need root (CAP_SYS_ADMIN)")
            })?;
        }
        // From here on, Drop cleans up whatever was created.
        let [a, b] = &pair.names;
        ip(&[
            "link", "add", IFACE, "netns", a, "type", "veth", "peer", "name", IFACE, "netns", b,
        ])?;
        for side in [Side::A, Side::B] {
            let cidr = format!("{}/30", pair.addr(side));
            pair.run(side, "ip", &["addr", "add", &cidr, "dev", IFACE])?;
            pair.run(side, "ip", &["link", "set", IFACE, "up"])?;
            pair.run(side, "ip", &["link", "set", "lo", "up"])?;
        }
        Ok(pair)
    }

    /// The namespace's name, e.g. for [`crate::procs::ProcSpec::netns`].
    pub fn name(&self, side: Side) -> &str {
        &self.names[side.index()]
    }

    /// The side's address on the veth link.
    pub fn addr(&self, side: Side) -> Ipv4Addr {
        ADDRS[side.index()]
    }

    /// `ip netns exec NAME program`, to add arguments to and run.
    pub fn command(&self, side: Side, program: impl AsRef<OsStr>) -> Command {
        let mut command = Command::new("ip");
        command
            .args(["netns", "exec", self.name(side)])
            .arg(program);
        command
    }

    /// Runs a command inside the namespace; fails unless it exits 0. Returns its stdout.
    pub fn run(&self, side: Side, program: &str, args: &[&str]) -> Result<String> {
        let mut command = self.command(side, program);
        command.args(args);
        checked(
            command,
            &format!("{program} {} in {}", args.join(" "), self.name(side)),
        )
    }

    /// Runs `f` on a thread that joined the side's namespace; sockets it creates stay there.
    pub fn in_ns<T: Send>(&self, side: Side, f: impl FnOnce() -> T + Send) -> Result<T> {
        let path = format!("/run/netns/{}", self.name(side));
        let ns = File::open(&path).with_context(|| format!("opening {path}"))?;
        std::thread::scope(|scope| {
            let worker = scope.spawn(move || -> io::Result<T> {
                enter_netns(&ns)?;
                Ok(f())
            });
            match worker.join() {
                Ok(result) => {
                    result.with_context(|| format!("entering namespace {}", self.name(side)))
                }
                Err(panic) => std::panic::resume_unwind(panic),
            }
        })
    }

    /// A UDP socket bound inside the namespace.
    pub fn udp_bind(&self, side: Side, addr: SocketAddr) -> Result<UdpSocket> {
        Ok(self.in_ns(side, || UdpSocket::bind(addr))??)
    }

    /// A TCP listener bound inside the namespace.
    pub fn tcp_listen(&self, side: Side, addr: SocketAddr) -> Result<TcpListener> {
        Ok(self.in_ns(side, || TcpListener::bind(addr))??)
    }

    /// A TCP connection made from inside the namespace, e.g. for [`crate::http::request_on`]
    /// to a process running there.
    pub fn tcp_connect(
        &self,
        side: Side,
        addr: SocketAddr,
        timeout: Duration,
    ) -> Result<TcpStream> {
        let stream = self.in_ns(side, || TcpStream::connect_timeout(&addr, timeout))??;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        Ok(stream)
    }

    /// Installs a DROP rule in `side`'s INPUT chain.
    pub fn add_drop(&self, side: Side, spec: DropSpec) -> Result<DropRule> {
        let tag = format!(
            "{PREFIX}-rule-{}",
            NEXT_RULE.fetch_add(1, Ordering::Relaxed)
        );
        let rule = DropRule { side, spec, tag };
        let mut args = vec!["-w".to_string(), "-A".into(), "INPUT".into()];
        args.extend(rule_args(&rule)?);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.run(side, "iptables", &args)?;
        Ok(rule)
    }

    /// Removes a rule added by [`NetnsPair::add_drop`].
    pub fn remove_drop(&self, rule: &DropRule) -> Result<()> {
        let mut args = vec!["-w".to_string(), "-D".into(), "INPUT".into()];
        args.extend(rule_args(rule)?);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.run(rule.side, "iptables", &args)?;
        Ok(())
    }

    /// Packets the rule has dropped so far, from the iptables counters.
    pub fn dropped(&self, rule: &DropRule) -> Result<u64> {
        let listing = self.run(
            rule.side,
            "iptables",
            &["-w", "-L", "INPUT", "-n", "-v", "-x"],
        )?;
        let marker = format!("/* {} */", rule.tag);
        let line = listing
            .lines()
            .find(|line| line.contains(&marker))
            .with_context(|| format!("rule {} not found in:\n{listing}", rule.tag))?;
        let packets = line.split_whitespace().next().unwrap_or_default();
        packets
            .parse()
            .with_context(|| format!("bad counter in {line:?}"))
    }

    /// Cuts the link both ways: every packet arriving on either side is dropped.
    pub fn partition(&self) -> Result<Partition> {
        let a = self.add_drop(Side::A, DropSpec::default())?;
        let b = self.add_drop(Side::B, DropSpec::default())?;
        Ok(Partition { rules: [a, b] })
    }

    /// Heals a partition; returns how many packets it dropped on both sides together.
    pub fn heal(&self, partition: &Partition) -> Result<u64> {
        let mut dropped = 0;
        for rule in &partition.rules {
            dropped += self.dropped(rule)?;
            self.remove_drop(rule)?;
        }
        Ok(dropped)
    }

    /// Takes `side`'s end of the veth link down or up: a carrier loss, for flapping links.
    pub fn set_link(&self, side: Side, up: bool) -> Result<()> {
        self.run(
            side,
            "ip",
            &["link", "set", IFACE, if up { "up" } else { "down" }],
        )?;
        Ok(())
    }
}

impl Drop for NetnsPair {
    fn drop(&mut self) {
        for name in &self.names {
            let _ = ip(&["netns", "del", name]);
        }
    }
}

/// Names of the namespaces that currently exist.
pub fn list_namespaces() -> Result<Vec<String>> {
    let listing = ip(&["netns", "list"])?;
    Ok(listing
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .map(str::to_string)
        .collect())
}

fn rule_args(rule: &DropRule) -> Result<Vec<String>> {
    let spec = &rule.spec;
    let mut args = Vec::new();
    if let Some(protocol) = spec.protocol {
        args.extend([
            "-p".into(),
            if protocol == L4::Tcp { "tcp" } else { "udp" }.into(),
        ]);
    }
    ensure!(
        spec.protocol.is_some() || (spec.dport.is_none() && spec.sport.is_none()),
        "a port match needs a protocol"
    );
    if let Some(port) = spec.dport {
        args.extend(["--dport".into(), port.to_string()]);
    }
    if let Some(port) = spec.sport {
        args.extend(["--sport".into(), port.to_string()]);
    }
    if let Some(p) = spec.probability {
        ensure!(
            (0.0..=1.0).contains(&p),
            "drop probability {p} is outside [0, 1]"
        );
        args.extend(["-m", "statistic", "--mode", "random", "--probability"].map(String::from));
        args.push(format!("{p:.6}"));
    }
    args.extend(["-m", "comment", "--comment", &rule.tag, "-j", "DROP"].map(String::from));
    Ok(args)
}

/// Deletes namespaces this harness created in processes that no longer exist.
fn sweep_stale() {
    let Ok(names) = list_namespaces() else { return };
    for name in names {
        let Some(rest) = name.strip_prefix(PREFIX) else {
            continue;
        };
        let Some((pid, _)) = rest.split_once('n') else {
            continue;
        };
        let ours = !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit());
        if ours && !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = ip(&["netns", "del", &name]);
        }
    }
}

fn ip(args: &[&str]) -> Result<String> {
    let mut command = Command::new("ip");
    command.args(args);
    checked(command, &format!("ip {}", args.join(" ")))
}

fn checked(mut command: Command, what: &str) -> Result<String> {
    let output = command
        .output()
        .with_context(|| format!("running {what}"))?;
    if !output.status.success() {
        bail!(
            "{what} failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Moves the calling thread into the network namespace behind `ns`.
#[allow(unsafe_code)]
fn enter_netns(ns: &File) -> io::Result<()> {
    // SAFETY: setns(2) reads an open file descriptor that `ns` keeps alive for the call and a
    // flag; it changes only the calling thread's network namespace and touches no Rust memory.
    let rc = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}
