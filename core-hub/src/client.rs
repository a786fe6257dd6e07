//! A minimal HTTP/1.1 client for the CLI (`core-hub read`, `core-hub devices`) and tests.
//!
//! The CLI issues GETs (and one POST, `devices retire`) to the hub's own API over plain HTTP
//! (the API listens on loopback by default), so a small client over a tokio `TcpStream` is enough and keeps a full HTTP
//! client stack out of the hub. It handles `Content-Length`, chunked and close-delimited bodies.

use thiserror::Error;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Largest response body accepted.
pub const RESPONSE_BYTES_MAX: usize = 1 << 30;

/// Why a request failed.
#[derive(Debug, Error)]
pub enum ClientError {
    #[error("`{0}` is not an http://host:port URL")]
    BadUrl(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("malformed HTTP response: {0}")]
    Malformed(&'static str),
    #[error("response larger than {RESPONSE_BYTES_MAX} bytes")]
    TooLarge,
}

/// Where the hub's API lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiTarget {
    /// `host:port`.
    pub authority: String,
    /// Path prefix, without a trailing slash (usually empty).
    pub base_path: String,
    pub token: Option<String>,
}

impl ApiTarget {
    /// Parses `http://host:port[/prefix]`.
    pub fn parse(url: &str, token: Option<String>) -> Result<ApiTarget, ClientError> {
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| ClientError::BadUrl(url.to_string()))?;
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
            None => (rest, ""),
        };
        if authority.is_empty() || !authority.contains(':') {
            return Err(ClientError::BadUrl(url.to_string()));
        }
        Ok(ApiTarget {
            authority: authority.to_string(),
            base_path: path.to_string(),
            token,
        })
    }

    /// The API of a hub listening on `addr`; a wildcard address is reached over loopback.
    pub fn from_listen(addr: std::net::SocketAddr, token: Option<String>) -> ApiTarget {
        let ip = match addr.ip() {
            ip if ip.is_unspecified() && ip.is_ipv4() => "127.0.0.1".to_string(),
            ip if ip.is_unspecified() => "[::1]".to_string(),
            std::net::IpAddr::V6(ip) => format!("[{ip}]"),
            std::net::IpAddr::V4(ip) => ip.to_string(),
        };
        ApiTarget {
            authority: format!("{ip}:{}", addr.port()),
            base_path: String::new(),
            token,
        }
    }
}

/// A response.
#[derive(Debug, Clone)]
pub struct HttpResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl HttpResponse {
    /// The first header named `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// `GET {base}{path_and_query}`.
pub async fn get(target: &ApiTarget, path_and_query: &str) -> Result<HttpResponse, ClientError> {
    request(target, "GET", path_and_query).await
}

/// `POST {base}{path_and_query}` with an empty body (`core-hub devices retire`).
pub async fn post(target: &ApiTarget, path_and_query: &str) -> Result<HttpResponse, ClientError> {
    request(target, "POST", path_and_query).await
}

async fn request(
    target: &ApiTarget,
    method: &str,
    path_and_query: &str,
) -> Result<HttpResponse, ClientError> {
    let mut stream = tokio::net::TcpStream::connect(&target.authority).await?;
    let mut req = format!(
        "{method} {}{} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nAccept: */*\r\n",
        target.base_path, path_and_query, target.authority
    );
    if method == "POST" {
        req.push_str("Content-Length: 0\r\n");
    }
    if let Some(token) = &target.token {
        req.push_str(&format!("Authorization: Bearer {token}\r\n"));
    }
    req.push_str("\r\n");
    stream.write_all(req.as_bytes()).await?;
    let mut raw = Vec::new();
    let mut chunk = vec![0u8; 64 << 10];
    loop {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        if raw.len() + n > RESPONSE_BYTES_MAX {
            return Err(ClientError::TooLarge);
        }
        raw.extend_from_slice(&chunk[..n]);
    }
    parse_response(&raw)
}

/// `GET` whose body is handed to `on_data` as it arrives (chunked or close-delimited), for
/// `core-hub read --follow`. Stops when the server ends the body or `on_data` returns `false`.
/// Returns the status and headers; a non-200 answer's body is returned whole instead.
pub async fn get_streaming(
    target: &ApiTarget,
    path_and_query: &str,
    mut on_data: impl FnMut(&[u8]) -> bool,
) -> Result<HttpResponse, ClientError> {
    let mut stream = tokio::net::TcpStream::connect(&target.authority).await?;
    let mut req = format!(
        "GET {}{} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nAccept: */*\r\n",
        target.base_path, path_and_query, target.authority
    );
    if let Some(token) = &target.token {
        req.push_str(&format!("Authorization: Bearer {token}\r\n"));
    }
    req.push_str("\r\n");
    stream.write_all(req.as_bytes()).await?;
    let mut buf = Vec::new();
    let mut chunk = vec![0u8; 64 << 10];
    // Headers first.
    let split = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Err(ClientError::Malformed("no header end"));
        }
        if buf.len() + n > RESPONSE_BYTES_MAX {
            return Err(ClientError::TooLarge);
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let mut head = parse_head(&buf[..split])?;
    let mut rest = buf.split_off(split + 4);
    let chunked = head
        .header("transfer-encoding")
        .is_some_and(|v| v.eq_ignore_ascii_case("chunked"));
    if head.status != 200 {
        // Errors are short: read them whole.
        loop {
            let n = stream.read(&mut chunk).await?;
            if n == 0 || rest.len() > 1 << 20 {
                break;
            }
            rest.extend_from_slice(&chunk[..n]);
        }
        head.body = if chunked {
            dechunk(&rest).unwrap_or(rest)
        } else {
            rest
        };
        return Ok(head);
    }
    loop {
        if chunked {
            // Hand over every complete chunk in `rest`.
            while let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") {
                let size_text = std::str::from_utf8(&rest[..eol])
                    .map_err(|_| ClientError::Malformed("chunk size"))?;
                let size_text = size_text.split(';').next().unwrap_or("").trim();
                let size = usize::from_str_radix(size_text, 16)
                    .map_err(|_| ClientError::Malformed("chunk size"))?;
                if size == 0 {
                    return Ok(head);
                }
                if rest.len() < eol + 2 + size + 2 {
                    break;
                }
                if !on_data(&rest[eol + 2..eol + 2 + size]) {
                    return Ok(head);
                }
                rest.drain(..eol + 2 + size + 2);
            }
        } else if !rest.is_empty() {
            if !on_data(&rest) {
                return Ok(head);
            }
            rest.clear();
        }
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Ok(head);
        }
        if rest.len() + n > RESPONSE_BYTES_MAX {
            return Err(ClientError::TooLarge);
        }
        rest.extend_from_slice(&chunk[..n]);
    }
}

/// The status line and headers of a response (no body).
fn parse_head(raw: &[u8]) -> Result<HttpResponse, ClientError> {
    let head = std::str::from_utf8(raw).map_err(|_| ClientError::Malformed("non-UTF-8 header"))?;
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .ok_or(ClientError::Malformed("bad status line"))?;
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    Ok(HttpResponse {
        status,
        headers,
        body: Vec::new(),
    })
}

/// Percent-encodes a query value (RFC 3986 unreserved characters stay as they are).
pub fn query_escape(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for b in v.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn parse_response(raw: &[u8]) -> Result<HttpResponse, ClientError> {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or(ClientError::Malformed("no header end"))?;
    let head = std::str::from_utf8(&raw[..split])
        .map_err(|_| ClientError::Malformed("non-UTF-8 header"))?;
    let mut lines = head.split("\r\n");
    let status_line = lines
        .next()
        .ok_or(ClientError::Malformed("no status line"))?;
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or(ClientError::Malformed("bad status line"))?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    let mut resp = HttpResponse {
        status,
        headers,
        body: Vec::new(),
    };
    let rest = &raw[split + 4..];
    resp.body = if resp
        .header("transfer-encoding")
        .is_some_and(|v| v.eq_ignore_ascii_case("chunked"))
    {
        dechunk(rest)?
    } else if let Some(len) = resp.header("content-length") {
        let len: usize = len
            .parse()
            .map_err(|_| ClientError::Malformed("bad content-length"))?;
        rest.get(..len)
            .ok_or(ClientError::Malformed("short body"))?
            .to_vec()
    } else {
        rest.to_vec()
    };
    Ok(resp)
}

fn dechunk(mut rest: &[u8]) -> Result<Vec<u8>, ClientError> {
    let mut body = Vec::new();
    loop {
        let eol = rest
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or(ClientError::Malformed("chunk size"))?;
        let size_text =
            std::str::from_utf8(&rest[..eol]).map_err(|_| ClientError::Malformed("chunk size"))?;
        let size_text = size_text.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size_text, 16)
            .map_err(|_| ClientError::Malformed("chunk size"))?;
        rest = &rest[eol + 2..];
        if size == 0 {
            return Ok(body);
        }
        let data = rest
            .get(..size)
            .ok_or(ClientError::Malformed("short chunk"))?;
        body.extend_from_slice(data);
        rest = rest
            .get(size + 2..)
            .ok_or(ClientError::Malformed("short chunk"))?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_urls() {
        let t = ApiTarget::parse("http://127.0.0.1:7480/", None).unwrap();
        assert_eq!(t.authority, "127.0.0.1:7480");
        assert_eq!(t.base_path, "");
        let t = ApiTarget::parse("http://hub:80/api", None).unwrap();
        assert_eq!(t.base_path, "/api");
        assert!(ApiTarget::parse("https://hub:1", None).is_err());
        assert!(ApiTarget::parse("http://hub", None).is_err());
        let t = ApiTarget::from_listen("0.0.0.0:7480".parse().unwrap(), None);
        assert_eq!(t.authority, "127.0.0.1:7480");
    }

    #[test]
    fn parses_bodies() {
        let r = parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nX-A: b\r\n\r\nabcdef")
            .unwrap();
        assert_eq!(
            (r.status, r.body.as_slice(), r.header("x-a")),
            (200, &b"abc"[..], Some("b"))
        );
        let r = parse_response(b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
            .unwrap();
        assert_eq!((r.status, r.body.as_slice()), (404, &b"abcde"[..]));
        assert!(parse_response(b"garbage").is_err());
    }
}
