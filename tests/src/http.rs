//! A tiny blocking HTTP/1.1 client over `std::net::TcpStream`, enough for `/healthz`,
//! `/metrics`, NDJSON ingest posts and NDJSON reads in system tests.
//!
//! It sends one request per connection with `Connection: close` and understands Content-Length,
//! chunked and read-to-EOF bodies. A dedicated client keeps the harness free of an HTTP stack,
//! and [`request_on`] works on any stream, e.g. one opened inside a network namespace.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};

/// Connect, read and write timeout of the convenience functions.
pub const TIMEOUT: Duration = Duration::from_secs(10);

/// Bound on the status line plus headers.
const HEAD_BYTES_MAX: usize = 64 * 1024;
/// Bound on a body, so a broken server cannot exhaust the test's memory.
const BODY_BYTES_MAX: u64 = 1 << 30;

/// A complete answer.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    pub reason: String,
    /// Header names as sent; look them up with [`Response::header`], which ignores case.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    /// The first header called `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The body as text (invalid UTF-8 replaced).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The body parsed as one JSON value.
    pub fn json(&self) -> Result<serde_json::Value> {
        serde_json::from_slice(&self.body)
            .with_context(|| format!("status {} body is not JSON: {}", self.status, self.text()))
    }

    /// The body parsed as NDJSON: one JSON value per non-empty line.
    pub fn ndjson(&self) -> Result<Vec<serde_json::Value>> {
        let text = std::str::from_utf8(&self.body).context("NDJSON body is not UTF-8")?;
        text.lines()
            .enumerate()
            .filter(|(_, line)| !line.trim().is_empty())
            .map(|(i, line)| {
                serde_json::from_str(line).with_context(|| format!("NDJSON line {}: {line}", i + 1))
            })
            .collect()
    }

    pub fn is_success(&self) -> bool {
        (200..300).contains(&self.status)
    }
}

/// `GET path`.
pub fn get(addr: SocketAddr, path: &str) -> Result<Response> {
    request_timeout(addr, "GET", path, &[], None, TIMEOUT)
}

/// `POST path` with a body of the given content type.
pub fn post(addr: SocketAddr, path: &str, content_type: &str, body: &[u8]) -> Result<Response> {
    request_timeout(
        addr,
        "POST",
        path,
        &[("Content-Type", content_type)],
        Some(body),
        TIMEOUT,
    )
}

/// `POST path` with an NDJSON body (`application/x-ndjson`).
pub fn post_ndjson(addr: SocketAddr, path: &str, body: &[u8]) -> Result<Response> {
    post(addr, path, "application/x-ndjson", body)
}

/// Any request, with extra headers and the default timeout.
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> Result<Response> {
    request_timeout(addr, method, path, headers, body, TIMEOUT)
}

/// Any request, with a timeout for connecting and for each read and write.
pub fn request_timeout(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
    timeout: Duration,
) -> Result<Response> {
    let stream = TcpStream::connect_timeout(&addr, timeout)
        .with_context(|| format!("connecting to {addr}"))?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    request_on(stream, &addr.to_string(), method, path, headers, body)
        .with_context(|| format!("{method} http://{addr}{path}"))
}

/// Sends one request on an already connected stream (timeouts are the caller's) and reads the
/// answer. `host` fills the Host header.
pub fn request_on(
    mut stream: TcpStream,
    host: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> Result<Response> {
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n");
    for (name, value) in headers {
        ensure!(
            !name.contains(['\r', '\n', ':']) && !value.contains(['\r', '\n']),
            "bad header {name}"
        );
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    if let Some(body) = body {
        head.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    head.push_str("\r\n");
    let written = write_request(&mut stream, head.as_bytes(), body);
    // A server may answer early and close (e.g. 413 for an oversize body) while the body is still
    // being written; its answer matters more than the failed write.
    match read_response(BufReader::new(stream), method.eq_ignore_ascii_case("HEAD")) {
        Ok(response) => Ok(response),
        Err(read_error) => match written {
            Err(write_error) => Err(anyhow::Error::new(write_error).context("sending the request")),
            Ok(()) => Err(read_error),
        },
    }
}

fn write_request(stream: &mut TcpStream, head: &[u8], body: Option<&[u8]>) -> std::io::Result<()> {
    stream.write_all(head)?;
    if let Some(body) = body {
        stream.write_all(body)?;
    }
    stream.flush()
}

/// Reads one response, skipping interim `1xx` answers.
pub fn read_response(mut reader: impl BufRead, head_only: bool) -> Result<Response> {
    loop {
        let (status, reason, headers) = read_head(&mut reader)?;
        if (100..200).contains(&status) && status != 101 {
            continue;
        }
        let mut response = Response {
            status,
            reason,
            headers,
            body: Vec::new(),
        };
        if !(head_only || status == 204 || status == 304) {
            response.body = read_body(&mut reader, &response)?;
        }
        return Ok(response);
    }
}

/// The status code, reason phrase and headers of a response.
type Head = (u16, String, Vec<(String, String)>);

fn read_head(reader: &mut impl BufRead) -> Result<Head> {
    let mut budget = HEAD_BYTES_MAX;
    let status_line = read_line(reader, &mut budget)?;
    ensure!(
        !status_line.is_empty(),
        "connection closed before a status line"
    );
    let mut parts = status_line.splitn(3, ' ');
    let version = parts.next().unwrap_or_default();
    ensure!(
        version.starts_with("HTTP/1."),
        "not an HTTP/1 status line: {status_line:?}"
    );
    let status = parts
        .next()
        .unwrap_or_default()
        .parse::<u16>()
        .with_context(|| format!("bad status line {status_line:?}"))?;
    let reason = parts.next().unwrap_or_default().to_string();
    let mut headers = Vec::new();
    loop {
        let line = read_line(reader, &mut budget)?;
        if line.is_empty() {
            return Ok((status, reason, headers));
        }
        let Some((name, value)) = line.split_once(':') else {
            bail!("bad header line {line:?}")
        };
        headers.push((name.trim().to_string(), value.trim().to_string()));
    }
}

/// One CRLF- (or LF-) terminated line without its terminator, within the remaining budget.
fn read_line(reader: &mut impl BufRead, budget: &mut usize) -> Result<String> {
    let mut line = Vec::new();
    let limit = u64::try_from(*budget).unwrap_or(u64::MAX);
    reader.by_ref().take(limit).read_until(b'\n', &mut line)?;
    // A full budget without a newline means the head is too large; a short read is EOF.
    ensure!(
        line.ends_with(b"\n") || line.len() < *budget,
        "response head exceeds {HEAD_BYTES_MAX} bytes"
    );
    *budget = budget.saturating_sub(line.len());
    while line.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
        line.pop();
    }
    String::from_utf8(line).context("response head is not UTF-8")
}

fn read_body(reader: &mut impl BufRead, response: &Response) -> Result<Vec<u8>> {
    let chunked = response.header("transfer-encoding").is_some_and(|te| {
        te.split(',')
            .any(|c| c.trim().eq_ignore_ascii_case("chunked"))
    });
    if chunked {
        return read_chunked(reader);
    }
    let mut body = Vec::new();
    match response.header("content-length") {
        Some(len) => {
            let len: u64 = len
                .parse()
                .with_context(|| format!("bad Content-Length {len:?}"))?;
            ensure!(
                len <= BODY_BYTES_MAX,
                "body of {len} bytes exceeds the limit"
            );
            reader.take(len).read_to_end(&mut body)?;
            ensure!(
                body.len() as u64 == len,
                "body ended after {} of {len} bytes",
                body.len()
            );
        }
        None => {
            reader.take(BODY_BYTES_MAX + 1).read_to_end(&mut body)?;
            ensure!(
                body.len() as u64 <= BODY_BYTES_MAX,
                "body exceeds the limit"
            );
        }
    }
    Ok(body)
}

fn read_chunked(reader: &mut impl BufRead) -> Result<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        let mut budget = HEAD_BYTES_MAX;
        let line = read_line(reader, &mut budget)?;
        let size_text = line.split(';').next().unwrap_or_default().trim();
        let size = u64::from_str_radix(size_text, 16)
            .with_context(|| format!("bad chunk size line {line:?}"))?;
        if size == 0 {
            // Trailers, up to the empty line (or EOF from a lenient server).
            while !read_line(reader, &mut budget)?.is_empty() {}
            return Ok(body);
        }
        ensure!(
            body.len() as u64 + size <= BODY_BYTES_MAX,
            "chunked body exceeds the limit"
        );
        let before = body.len();
        reader.take(size).read_to_end(&mut body)?;
        ensure!((body.len() - before) as u64 == size, "chunk ended early");
        let end = read_line(reader, &mut budget)?;
        ensure!(end.is_empty(), "chunk not followed by CRLF");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// Serves one connection with a canned answer and returns the request it received.
    fn serve_once(answer: &'static [u8]) -> (SocketAddr, std::thread::JoinHandle<String>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let join = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            stream
                .set_read_timeout(Some(Duration::from_secs(5)))
                .unwrap();
            let mut request = Vec::new();
            let mut buf = [0u8; 4096];
            // Read the head and, when present, the body announced by Content-Length.
            loop {
                let n = stream.read(&mut buf).unwrap();
                request.extend_from_slice(&buf[..n]);
                let text = String::from_utf8_lossy(&request).to_string();
                if let Some(end) = text.find("\r\n\r\n") {
                    let len = text
                        .lines()
                        .find_map(|l| l.strip_prefix("Content-Length: "))
                        .map_or(0, |v| v.trim().parse::<usize>().unwrap());
                    if request.len() >= end + 4 + len {
                        break;
                    }
                }
                if n == 0 {
                    break;
                }
            }
            stream.write_all(answer).unwrap();
            String::from_utf8(request).unwrap()
        });
        (addr, join)
    }

    #[test]
    fn content_length_body() {
        let (addr, server) =
            serve_once(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-A: b\r\n\r\nhello");
        let response = get(addr, "/healthz").unwrap();
        assert_eq!(response.status, 200);
        assert_eq!(response.header("x-a"), Some("b"));
        assert_eq!(response.text(), "hello");
        assert!(
            server
                .join()
                .unwrap()
                .starts_with("GET /healthz HTTP/1.1\r\n")
        );
    }

    #[test]
    fn chunked_body_with_extension_and_trailer() {
        let (addr, server) = serve_once(
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n\
              4;ext=1\r\n{\"a\"\r\n3\r\n:1}\r\n0\r\nX-T: 1\r\n\r\n",
        );
        let response = post_ndjson(addr, "/v1/streams/s/records", b"{\"key\":\"k\"}\n").unwrap();
        assert_eq!(response.status, 201);
        assert_eq!(response.json().unwrap(), serde_json::json!({"a": 1}));
        let request = server.join().unwrap();
        assert!(
            request.contains("Content-Type: application/x-ndjson\r\n"),
            "{request}"
        );
        assert!(request.ends_with("\r\n\r\n{\"key\":\"k\"}\n"), "{request}");
    }

    #[test]
    fn body_until_eof_and_ndjson() {
        let (addr, server) = serve_once(b"HTTP/1.0 200 OK\r\n\r\n{\"seq\":1}\n\n{\"seq\":2}\n");
        let response = get(addr, "/records").unwrap();
        assert_eq!(response.ndjson().unwrap().len(), 2);
        server.join().unwrap();
    }

    #[test]
    fn malformed_answers_are_errors() {
        let cases: [&'static [u8]; 4] = [
            b"garbage\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            b"",
        ];
        for answer in cases {
            let (addr, server) = serve_once(answer);
            assert!(
                get(addr, "/").is_err(),
                "accepted {:?}",
                String::from_utf8_lossy(answer)
            );
            server.join().unwrap();
        }
    }
}
