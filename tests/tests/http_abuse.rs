//! A hostile HTTP client against the real hub and agent binaries: slowloris heads, half-sent
//! bodies, oversize unauthenticated uploads, foreign `Host` and cross-origin posts, and file
//! descriptor exhaustion. Each fault is counted twice: by what the client saw (the cut, the
//! status) and by the server's own `*_http_refused_total` / `*_http_accept_errors_total`
//! counters, and every test asserts both are above zero.
//!
//! Memory is measured from `/proc/<pid>/status` (VmRSS) with a wide margin, and every wait has
//! a deadline on a condition; nothing here depends on the machine's speed.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use tributary_tests::cluster::{AgentSpec, HubSpec, Pki, fetch_metric};
use tributary_tests::http;
use tributary_tests::procs::{Proc, wait_until};

/// Deadline of every wait on the servers.
const WAIT: Duration = Duration::from_secs(60);
/// The short timeouts the servers run with here, so that the cuts come quickly.
const SHORT_LIMITS: &str =
    "header_timeout = \"1s\"\nbody_timeout = \"1s\"\nidle_timeout = \"2s\"\n";
const AGENT_TOKEN: &str = "agent-token-0123456789";
const ADMIN_TOKEN: &str = "admin-token-0123456789";
const READER_TOKEN: &str = "reader-token-0123456789";

/// Where to post a body: a route that reads one and needs a token when tokens are set.
#[derive(Debug, Clone, Copy)]
struct Target {
    addr: SocketAddr,
    path: &'static str,
    content_type: &'static str,
}

/// A started server and where its API listens.
struct Server {
    proc: Proc,
    addr: SocketAddr,
    /// `tributary_edge_http` or `tributary_hub_http`.
    prefix: &'static str,
    post: Target,
    /// The bearer token for `post`, when tokens are configured.
    token: Option<&'static str>,
    /// Its largest request body.
    body_bytes_max: usize,
    /// A line its log has once start-up is over.
    started_log: &'static str,
    _dir: tempfile::TempDir,
}

impl Server {
    fn refused(&self, limit: &str) -> Result<f64> {
        let name = format!("{}_refused_total{{limit=\"{limit}\"}}", self.prefix);
        self.metric(&name)
    }

    fn metric(&self, name: &str) -> Result<f64> {
        match self.token {
            // The hub's `/metrics` needs a token once tokens are set.
            Some(token) if self.prefix.contains("hub") => {
                let auth = format!("Bearer {token}");
                let r = http::request(
                    self.addr,
                    "GET",
                    "/metrics",
                    &[("Authorization", &auth)],
                    None,
                )?;
                ensure!(r.status == 200, "metrics: {} {}", r.status, r.text());
                Ok(tributary_tests::cluster::metric(&r.text(), name).unwrap_or(0.0))
            }
            _ => fetch_metric(self.addr, name),
        }
    }
}

fn agent(http_toml: &str, token: bool) -> Result<Server> {
    let dir = tempfile::tempdir()?;
    let pki = Pki::init(dir.path().join("pki"))?;
    let cert = pki.issue("dev-1", None)?;
    let mut spec = AgentSpec::new(dir.path(), "agent", cert, None);
    spec.extra_toml = http_toml.to_string();
    if token {
        spec.extra_toml
            .push_str(&format!("token = \"{AGENT_TOKEN}\"\n"));
    }
    let proc = spec.start()?;
    Ok(Server {
        proc,
        addr: spec.http,
        prefix: "tributary_edge_http",
        post: Target {
            addr: spec.http,
            path: "/v1/streams/telemetry/records",
            content_type: "application/x-ndjson",
        },
        token: token.then_some(AGENT_TOKEN),
        body_bytes_max: 16 << 20,
        started_log: "edge-agent ready",
        _dir: dir,
    })
}

fn hub(http_toml: &str, tokens: bool) -> Result<Server> {
    let dir = tempfile::tempdir()?;
    let pki = Pki::init(dir.path().join("pki"))?;
    let mut spec = HubSpec::new(dir.path());
    spec.extra_toml = format!("[http]\n{http_toml}");
    if tokens {
        spec.extra_toml.push_str(&format!(
            "reader_tokens = [\"{READER_TOKEN}\"]\nadmin_tokens = [\"{ADMIN_TOKEN}\"]\n"
        ));
    }
    let proc = spec.start(&pki)?;
    Ok(Server {
        proc,
        addr: spec.http,
        prefix: "tributary_hub_http",
        post: Target {
            addr: spec.http,
            path: "/v1/devices/dev-1/retire",
            content_type: "application/json",
        },
        token: tokens.then_some(ADMIN_TOKEN),
        body_bytes_max: 64 << 10,
        started_log: "tiering to tier 2",
        _dir: dir,
    })
}

fn connect(addr: SocketAddr) -> Result<TcpStream> {
    let s = TcpStream::connect_timeout(&addr, Duration::from_secs(10))?;
    s.set_write_timeout(Some(Duration::from_secs(10)))?;
    Ok(s)
}

/// Trickles a head one byte at a time (a slowloris client) until the server closes the
/// connection; fails if it is still open at the deadline. Returns the bytes it got to send.
fn slowloris(addr: SocketAddr) -> Result<usize> {
    let mut s = connect(addr)?;
    // The pace of the attack, not a wait for a condition: each read below waits this long.
    s.set_read_timeout(Some(Duration::from_millis(100)))?;
    let head = format!("GET /healthz HTTP/1.1\r\nHost: {addr}\r\n");
    s.write_all(head.as_bytes())?;
    let started = Instant::now();
    let mut sent = head.len();
    let mut buf = [0u8; 512];
    while started.elapsed() < WAIT {
        if s.write_all(b"X").is_err() {
            return Ok(sent);
        }
        sent += 1;
        match s.read(&mut buf) {
            Ok(0) => return Ok(sent),
            Ok(_) => {} // a 408 before the close is fine
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => return Ok(sent),
        }
    }
    bail!("a head trickled for {WAIT:?} ({sent} bytes) was never cut")
}

/// Sends a complete head announcing `length` body bytes, then only `sent` of them, and reads
/// the answer (or the close) without sending more.
fn partial_body(
    to: Target,
    length: usize,
    sent: usize,
    token: Option<&str>,
) -> Result<Option<u16>> {
    let mut s = connect(to.addr)?;
    s.set_read_timeout(Some(WAIT))?;
    let mut head = format!(
        "POST {} HTTP/1.1\r\nHost: {}\r\nContent-Type: {}\r\nContent-Length: {length}\r\n",
        to.path, to.addr, to.content_type
    );
    if let Some(token) = token {
        head.push_str(&format!("Authorization: Bearer {token}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes())?;
    let chunk = vec![b' '; 64 << 10];
    let mut left = sent;
    while left > 0 {
        let n = left.min(chunk.len());
        if s.write_all(&chunk[..n]).is_err() {
            break; // the server answered and closed: what we read below tells
        }
        left -= n;
    }
    Ok(read_status(&mut s))
}

/// The status of the first answer on `s`, `None` when it closed without one.
fn read_status(s: &mut TcpStream) -> Option<u16> {
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    while !got.windows(2).any(|w| w == b"\r\n") {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
    let line = String::from_utf8_lossy(&got);
    line.split_whitespace().nth(1)?.parse().ok()
}

fn vm_rss_kib(pid: u32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let line = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .context("no VmRSS line")?;
    let kib = line.split_whitespace().nth(1).context("VmRSS value")?;
    Ok(kib.parse()?)
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

fn slow_clients_are_cut(server: &Server) -> Result<()> {
    let sent = slowloris(server.addr)?;
    println!("{}: slowloris cut after {sent} bytes", server.prefix);
    let cut = server.refused("header_timeout")?;
    ensure!(cut > 0.0, "no header timeout counted");

    let status = partial_body(server.post, 1000, 10, server.token)?;
    ensure!(
        status == Some(408),
        "half-sent body: status {status:?}, expected 408"
    );
    let cut = server.refused("body_timeout")?;
    ensure!(cut > 0.0, "no body timeout counted");

    // An idle kept-alive connection is closed by itself.
    let mut idle = connect(server.addr)?;
    idle.set_read_timeout(Some(WAIT))?;
    let mut buf = [0u8; 16];
    let n = idle.read(&mut buf).unwrap_or(0);
    ensure!(
        n == 0,
        "the idle connection got {n} bytes instead of a close"
    );
    wait_until(WAIT, "an idle close counted", || {
        server.refused("idle_timeout").is_ok_and(|n| n > 0.0)
    })?;
    Ok(())
}

#[test]
fn agent_cuts_slow_heads_bodies_and_idle_connections() -> Result<()> {
    slow_clients_are_cut(&agent(SHORT_LIMITS, false)?)
}

#[test]
fn hub_cuts_slow_heads_bodies_and_idle_connections() -> Result<()> {
    slow_clients_are_cut(&hub(SHORT_LIMITS, false)?)
}

/// Twenty concurrent 15 MB uploads without a token: each gets 401 after its head, and the
/// server's resident memory does not grow by anything like the bodies' size.
fn unauthenticated_uploads_cost_no_memory(server: &Server) -> Result<()> {
    const UPLOADS: usize = 20;
    const BODY: usize = 15 << 20;
    for _ in 0..3 {
        http::get(server.addr, "/healthz")?; // warm the allocator before measuring
    }
    let before = vm_rss_kib(server.proc.pid())?;
    let uploads: Vec<_> = (0..UPLOADS)
        .map(|_| {
            let to = server.post;
            std::thread::spawn(move || partial_body(to, BODY, BODY, None))
        })
        .collect();
    let mut statuses = Vec::new();
    for u in uploads {
        statuses.push(u.join().expect("upload thread")?);
    }
    let after = vm_rss_kib(server.proc.pid())?;
    let growth_kib = after.saturating_sub(before);
    println!(
        "{}: VmRSS {before} KiB -> {after} KiB (+{growth_kib} KiB) after {UPLOADS} x {BODY} B \
         unauthenticated uploads; statuses {statuses:?}",
        server.prefix
    );
    ensure!(
        statuses.iter().all(|s| *s == Some(401)),
        "expected 401 for every upload: {statuses:?}"
    );
    let refused = server.refused("token")?;
    ensure!(
        refused >= UPLOADS as f64,
        "{refused} token refusals counted"
    );
    // The bodies total 300 MB; a server that read them would grow by far more than a quarter.
    let bound_kib = (UPLOADS * BODY / 4 / 1024) as u64;
    ensure!(
        growth_kib < bound_kib,
        "VmRSS grew by {growth_kib} KiB (bound {bound_kib} KiB)"
    );

    // With the token, an announced oversize body is refused before it is read.
    let status = partial_body(
        server.post,
        server.body_bytes_max + 1,
        1 << 20,
        server.token,
    )?;
    ensure!(
        status == Some(413),
        "oversize body with a token: {status:?}"
    );
    ensure!(
        server.refused("body_bytes_max")? > 0.0,
        "no oversize body counted"
    );
    Ok(())
}

#[test]
fn agent_refuses_unauthenticated_uploads_before_reading_them() -> Result<()> {
    unauthenticated_uploads_cost_no_memory(&agent("", true)?)
}

#[test]
fn hub_refuses_unauthenticated_uploads_before_reading_them() -> Result<()> {
    unauthenticated_uploads_cost_no_memory(&hub("", true)?)
}

/// A page on another origin posts `text/plain` (a CORS-simple request, no preflight), and a
/// DNS-rebinding page sends its own name as `Host`: both get 403. The same post from the
/// server's own origin gets `own_status`.
fn foreign_pages_are_refused(server: &Server, body: &[u8], own_status: u16) -> Result<()> {
    let own_host = server.addr.to_string();
    let own_origin = format!("http://{own_host}");
    let cases = [
        (own_host.as_str(), Some("http://evil.example"), 403),
        ("rebind.evil.example", None, 403),
        (own_host.as_str(), Some(own_origin.as_str()), own_status),
    ];
    for (host, origin, expected) in cases {
        let mut headers = vec![("Content-Type", "text/plain")];
        headers.extend(origin.map(|o| ("Origin", o)));
        let path = server.post.path;
        let r = http::request_on(
            connect(server.addr)?,
            host,
            "POST",
            path,
            &headers,
            Some(body),
        )?;
        let answer = format!("{} {}", r.status, r.text().trim());
        println!(
            "{}: Host {host}, Origin {origin:?} -> {answer}",
            server.prefix
        );
        ensure!(
            r.status == expected,
            "Host {host}, Origin {origin:?}: {answer}"
        );
    }
    ensure!(server.refused("origin")? > 0.0, "no Origin refusal counted");
    ensure!(server.refused("host")? > 0.0, "no Host refusal counted");
    Ok(())
}

#[test]
fn agent_refuses_cross_origin_posts_and_foreign_hosts() -> Result<()> {
    let server = agent("", false)?;
    foreign_pages_are_refused(&server, b"telemetry v=1i 1\n", 200)?;
    // Only the same-origin post was stored.
    let stored = server.metric("tributary_edge_records_total")?;
    ensure!(
        stored == 1.0,
        "{stored} records stored, expected the one same-origin record"
    );
    Ok(())
}

#[test]
fn hub_refuses_cross_origin_retires_and_foreign_hosts() -> Result<()> {
    let server = hub("", false)?;
    // The same-origin retire is let through, to find no such device.
    foreign_pages_are_refused(&server, b"", 404)
}

/// Opens `count` connections, each with a head left unfinished, as a Slowloris attacker does.
fn hold_connections(addr: SocketAddr, count: usize) -> Vec<TcpStream> {
    (0..count)
        .filter_map(|_| {
            let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).ok()?;
            s.write_all(b"GET /healthz HTTP/1.1\r\nX-Slow: ").ok()?;
            Some(s)
        })
        .collect()
}

fn set_nofile(pid: u32, limit: u64) -> Result<()> {
    let out = Command::new("prlimit")
        .arg(format!("--pid={pid}"))
        .arg(format!("--nofile={limit}:{limit}"))
        .output()
        .context("running prlimit (util-linux)")?;
    ensure!(
        out.status.success(),
        "prlimit: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// Runs the server out of file descriptors with held connections, lets them go, and checks
/// that it serves again by itself and counted the failed accepts.
fn recovers_from_fd_exhaustion(server: &mut Server) -> Result<()> {
    let pid = server.proc.pid();
    // The hub answers `/healthz` before it has opened tier 2; that open is not meant to
    // survive EMFILE, so the attack starts once start-up is over.
    wait_until(WAIT, "start-up to finish", || {
        server.proc.stderr().contains(server.started_log)
    })?;
    let limit = open_fds(pid) as u64 + 64;
    set_nofile(pid, limit)?;
    let attackers = hold_connections(server.addr, limit as usize + 64);
    println!(
        "{}: {} connections held, fd limit {limit}",
        server.prefix,
        attackers.len()
    );
    // The server logs the first failed accept of a streak; its counter is read afterwards,
    // since no request gets through while the descriptors are gone.
    let logged = |p: &Proc| (p.stderr() + &p.stdout()).contains("HTTP accept failed");
    wait_until(WAIT, "the server to run out of file descriptors", || {
        logged(&server.proc)
    })
    .with_context(|| format!("{} fds open", open_fds(pid)))?;
    drop(attackers);
    server.proc.wait_http_ok(server.addr, "/healthz", WAIT)?;
    let name = format!("{}_accept_errors_total{{kind=\"emfile\"}}", server.prefix);
    let emfile = server.metric(&name)?;
    println!(
        "{}: {emfile} EMFILE accepts, then served again",
        server.prefix
    );
    ensure!(emfile > 0.0, "no EMFILE counted");
    Ok(())
}

/// Below the descriptor limit, `connections_max` holds: the accept loop waits instead of
/// running out, and serves again once the attackers leave.
fn caps_connections(server: &mut Server, cap: usize) -> Result<()> {
    let pid = server.proc.pid();
    let base = open_fds(pid);
    let attackers = hold_connections(server.addr, cap * 4);
    // The other attackers wait in the kernel's backlog, holding no descriptor of the server.
    // `base` may still count a probe's connection the server had not closed yet: allow for it.
    wait_until(WAIT, "the server to take connections up to its cap", || {
        open_fds(pid) + 4 >= base + cap
    })?;
    let fds = open_fds(pid);
    ensure!(
        fds <= base + cap + 8,
        "{fds} descriptors open with a cap of {cap} (base {base})"
    );
    drop(attackers);
    server.proc.wait_http_ok(server.addr, "/healthz", WAIT)?;
    let waited = server.metric(&format!("{}_connections_waited_total", server.prefix))?;
    println!(
        "{}: {fds} fds at the cap of {cap}, accept loop waited {waited} times",
        server.prefix
    );
    ensure!(waited > 0.0, "the accept loop never waited at the cap");
    Ok(())
}

/// Long head and idle timeouts, so that only the attackers leaving frees the descriptors.
const PATIENT: &str = "header_timeout = \"5m\"\nidle_timeout = \"5m\"\nconnections_max = 100000\n";

#[test]
fn agent_recovers_from_fd_exhaustion_and_caps_connections() -> Result<()> {
    recovers_from_fd_exhaustion(&mut agent(PATIENT, false)?)?;
    let capped = "header_timeout = \"5m\"\nidle_timeout = \"5m\"\nconnections_max = 16\n";
    caps_connections(&mut agent(capped, false)?, 16)
}

#[test]
fn hub_recovers_from_fd_exhaustion_and_caps_connections() -> Result<()> {
    recovers_from_fd_exhaustion(&mut hub(PATIENT, false)?)?;
    let capped = "header_timeout = \"5m\"\nidle_timeout = \"5m\"\nconnections_max = 16\n";
    caps_connections(&mut hub(capped, false)?, 16)
}
