//! A minimal HTTP/1.1 client for talking to a running agent on loopback.
//!
//! `edge-agent ingest` and `edge-agent status` use it, and so do the process tests. It is hyper's
//! connection-level client (already in the tree through axum), one request per connection:
//! the agent is local, so connection reuse buys nothing and a fresh connection per request keeps
//! failure reporting simple ("could not reach the agent" means exactly that).

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper::header::{AUTHORIZATION, CONTENT_TYPE, HOST};
use hyper_util::rt::TokioIo;
use thiserror::Error;
use tokio::net::TcpStream;

/// Why a request did not produce a response.
#[derive(Debug, Error)]
pub enum ClientError {
    #[error("{0:?} is not an http://host:port URL")]
    BadUrl(String),
    /// Nothing accepted the connection: the agent is not running or listens elsewhere.
    #[error("could not connect to {addr}: {source}")]
    Connect {
        addr: String,
        source: std::io::Error,
    },
    #[error("request to {addr} failed: {message}")]
    Request { addr: String, message: String },
    #[error("no answer from {addr} within {timeout:?}")]
    Timeout { addr: String, timeout: Duration },
}

impl ClientError {
    /// True when the agent could not be reached at all, as opposed to failing mid-request.
    pub fn is_unreachable(&self) -> bool {
        matches!(self, ClientError::Connect { .. } | ClientError::BadUrl(_))
    }
}

/// A response with its body read in full.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    pub headers: hyper::HeaderMap,
    pub body: Bytes,
}

impl Response {
    /// The body as text, lossily.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// A header's value as text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

/// Where an agent's API is: `http://host:port`, parsed once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Client {
    /// `host:port`, as given.
    authority: String,
    token: Option<String>,
    timeout: Duration,
}

impl Client {
    /// Accepts `http://host:port`, `http://host:port/` or a bare `host:port`.
    pub fn new(url: &str) -> Result<Self, ClientError> {
        let rest = url.strip_prefix("http://").unwrap_or(url);
        if rest.contains("://") {
            return Err(ClientError::BadUrl(url.to_owned()));
        }
        let authority = rest.trim_end_matches('/');
        let valid = authority
            .rsplit_once(':')
            .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
        if !valid || authority.contains('/') {
            return Err(ClientError::BadUrl(url.to_owned()));
        }
        Ok(Client {
            authority: authority.to_owned(),
            token: None,
            timeout: Duration::from_secs(60),
        })
    }

    /// Sends `Authorization: Bearer <token>` with every request.
    pub fn with_token(mut self, token: Option<String>) -> Self {
        self.token = token;
        self
    }

    /// Bounds each request, connection included.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// `http://host:port`, for messages.
    pub fn url(&self) -> String {
        format!("http://{}", self.authority)
    }

    pub async fn get(&self, path: &str) -> Result<Response, ClientError> {
        self.send("GET", path, None, Bytes::new()).await
    }

    pub async fn post(
        &self,
        path: &str,
        content_type: &str,
        body: impl Into<Bytes>,
    ) -> Result<Response, ClientError> {
        self.send("POST", path, Some(content_type), body.into())
            .await
    }

    /// Sends one request on a fresh connection and reads the whole answer.
    pub async fn send(
        &self,
        method: &str,
        path: &str,
        content_type: Option<&str>,
        body: Bytes,
    ) -> Result<Response, ClientError> {
        let timeout = self.timeout;
        tokio::time::timeout(timeout, self.send_inner(method, path, content_type, body))
            .await
            .map_err(|_| ClientError::Timeout {
                addr: self.authority.clone(),
                timeout,
            })?
    }

    async fn send_inner(
        &self,
        method: &str,
        path: &str,
        content_type: Option<&str>,
        body: Bytes,
    ) -> Result<Response, ClientError> {
        let addr = &self.authority;
        let failed = |e: &dyn std::fmt::Display| ClientError::Request {
            addr: addr.clone(),
            message: e.to_string(),
        };
        let stream =
            TcpStream::connect(addr.as_str())
                .await
                .map_err(|source| ClientError::Connect {
                    addr: addr.clone(),
                    source,
                })?;
        stream.set_nodelay(true).map_err(|e| failed(&e))?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| failed(&e))?;
        // The connection future drives the socket; it ends when the request is done.
        tokio::spawn(connection);
        let mut request = Request::builder()
            .method(method)
            .uri(path)
            .header(HOST, addr.as_str());
        if let Some(ct) = content_type {
            request = request.header(CONTENT_TYPE, ct);
        }
        if let Some(token) = &self.token {
            request = request.header(AUTHORIZATION, format!("Bearer {token}"));
        }
        let request = request.body(Full::new(body)).map_err(|e| failed(&e))?;
        let response = sender.send_request(request).await.map_err(|e| failed(&e))?;
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| failed(&e))?
            .to_bytes();
        Ok(Response {
            status,
            headers,
            body,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        assert_eq!(
            Client::new("http://127.0.0.1:7401").unwrap().url(),
            "http://127.0.0.1:7401"
        );
        assert_eq!(
            Client::new("http://localhost:7401/").unwrap().url(),
            "http://localhost:7401"
        );
        assert_eq!(
            Client::new("127.0.0.1:1").unwrap().url(),
            "http://127.0.0.1:1"
        );
        for bad in [
            "https://h:1",
            "http://h",
            "http://:1",
            "http://h:1/x",
            "h:port",
        ] {
            assert!(Client::new(bad).is_err(), "{bad}");
        }
    }
}
