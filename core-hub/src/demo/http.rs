//! The few HTTP calls the demo makes: POST batches to an edge, read its status, read the hub.
//!
//! GETs go through the hub's own CLI client ([`crate::client`]). That client only does GET,
//! so the POST to an edge's ingest API is a few lines here over a tokio `TcpStream`, which
//! keeps a full HTTP client stack out of the hub binary.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde::Deserialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::client::{self, ApiTarget, HttpResponse};

/// No single request of the demo may hang it: a stuck child becomes a clear error instead.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(20);

/// `GET` with [`REQUEST_TIMEOUT`].
async fn get(target: &ApiTarget, path: &str) -> Result<HttpResponse> {
    match tokio::time::timeout(REQUEST_TIMEOUT, client::get(target, path)).await {
        Ok(r) => Ok(r?),
        Err(_) => bail!(
            "GET http://{}{path} did not answer within {REQUEST_TIMEOUT:?}",
            target.authority
        ),
    }
}

/// The edge's answer to an ingest POST, once the batch is durable on the edge.
#[derive(Debug, Clone, Deserialize)]
pub struct IngestAck {
    pub stream: String,
    /// 16 hex digits, a string, as the agent writes every epoch.
    #[serde(with = "sync::epoch::serde_hex")]
    pub epoch: u64,
    pub first_seq: u64,
    pub last_seq: u64,
    pub count: u64,
}

/// The parts of an edge's `GET /v1/status` the demo shows and waits on.
#[derive(Debug, Clone, Deserialize)]
pub struct EdgeStatus {
    pub link: String,
    pub disk_bytes: u64,
    pub streams: Vec<EdgeStream>,
}

/// One stream of [`EdgeStatus`].
#[derive(Debug, Clone, Deserialize)]
pub struct EdgeStream {
    pub stream: String,
    #[serde(with = "sync::epoch::serde_hex")]
    pub epoch: u64,
    pub next_seq: u64,
    pub durable_seq: u64,
    pub acked_seq: u64,
    pub backlog_bytes: u64,
    pub backlog_blocks: u64,
}

/// POSTs an NDJSON body to `stream` on the edge at `addr` and returns its acknowledgement.
pub async fn post_ndjson(addr: SocketAddr, stream: &str, body: &[u8]) -> Result<IngestAck> {
    match tokio::time::timeout(REQUEST_TIMEOUT, post_inner(addr, stream, body)).await {
        Ok(r) => r,
        Err(_) => {
            bail!("the edge at {addr} did not acknowledge a batch within {REQUEST_TIMEOUT:?}")
        }
    }
}

async fn post_inner(addr: SocketAddr, stream: &str, body: &[u8]) -> Result<IngestAck> {
    let mut tcp = tokio::net::TcpStream::connect(addr)
        .await
        .with_context(|| format!("connecting to the edge at {addr}"))?;
    let head = format!(
        "POST /v1/streams/{stream}/records HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/x-ndjson\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    tcp.write_all(head.as_bytes()).await?;
    tcp.write_all(body).await?;
    let mut raw = Vec::new();
    tcp.read_to_end(&mut raw).await?;
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .context("malformed HTTP response from the edge")?;
    let head = String::from_utf8_lossy(&raw[..split]);
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .context("malformed HTTP status line from the edge")?;
    let body = &raw[split + 4..];
    if status != 200 {
        bail!(
            "the edge at {addr} answered {status}: {}",
            String::from_utf8_lossy(body).trim()
        );
    }
    serde_json::from_slice(body).with_context(|| {
        format!(
            "the edge's answer is not an ingest acknowledgement: {}",
            String::from_utf8_lossy(body)
        )
    })
}

/// An edge's status.
pub async fn edge_status(addr: SocketAddr) -> Result<EdgeStatus> {
    let resp = get(&ApiTarget::from_listen(addr, None), "/v1/status").await?;
    if resp.status != 200 {
        bail!("status {} from the edge at {addr}", resp.status);
    }
    Ok(serde_json::from_slice(&resp.body)?)
}

/// A GET that must answer 200 (e.g. `/healthz`).
pub async fn get_ok(addr: SocketAddr, path: &str) -> Result<Vec<u8>> {
    let resp = get(&ApiTarget::from_listen(addr, None), path).await?;
    if resp.status != 200 {
        bail!(
            "GET {path}: status {}: {}",
            resp.status,
            String::from_utf8_lossy(&resp.body).trim()
        );
    }
    Ok(resp.body)
}

/// The value of an unlabelled counter or gauge in Prometheus text.
pub fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
}

/// The hub's record count for `stream` (0 until the stream exists).
pub async fn hub_records(addr: SocketAddr, stream: &str) -> Result<u64> {
    #[derive(Deserialize)]
    struct Info {
        name: String,
        records: u64,
    }
    let body = get_ok(addr, "/v1/streams").await?;
    let list: Vec<Info> = serde_json::from_slice(&body)?;
    Ok(list
        .iter()
        .find(|s| s.name == stream)
        .map(|s| s.records)
        .unwrap_or(0))
}

/// One record as the hub's reader API returns it; only what the verification needs.
#[derive(Debug, Deserialize)]
pub struct HubRecord {
    pub device: String,
    #[serde(with = "sync::epoch::serde_hex")]
    pub epoch: u64,
    pub seq: u64,
}

/// Every record of `stream` at the hub, paged by offset.
pub async fn hub_read_all(addr: SocketAddr, stream: &str) -> Result<Vec<HubRecord>> {
    let target = ApiTarget::from_listen(addr, None);
    let mut out = Vec::new();
    let mut from = 0u64;
    loop {
        let path = format!(
            "/v1/streams/{stream}/records?from={from}&limit={}",
            crate::api::RECORDS_LIMIT_MAX
        );
        let resp = get(&target, &path).await?;
        if resp.status == 404 {
            // The stream does not exist yet: nothing was merged.
            return Ok(out);
        }
        if resp.status != 200 {
            bail!(
                "reading {stream} from the hub: status {}: {}",
                resp.status,
                String::from_utf8_lossy(&resp.body).trim()
            );
        }
        if resp.body.is_empty() {
            return Ok(out);
        }
        for line in resp.body.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
            out.push(serde_json::from_slice(line).context("a record line from the hub")?);
        }
        let next: u64 = resp
            .header(crate::api::NEXT_OFFSET_HEADER)
            .and_then(|v| v.parse().ok())
            .context("the hub's answer lacks the next-offset header")?;
        if next <= from {
            bail!("the hub's next offset {next} does not advance past {from}");
        }
        from = next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_unlabelled_metrics() {
        let text = "# HELP x\ntributary_hub_block_bytes_committed_total 1234\ntributary_hub_block_bytes_committed_total_other 9\n";
        assert_eq!(
            metric(text, "tributary_hub_block_bytes_committed_total"),
            Some(1234.0)
        );
        assert_eq!(metric(text, "missing"), None);
    }

    #[test]
    fn reads_the_agents_hex_epochs() {
        let ack: IngestAck = serde_json::from_str(
            r#"{"stream":"s","epoch":"f3a9c2e1b04d5700","first_seq":1,"last_seq":2,"count":2}"#,
        )
        .unwrap();
        assert_eq!(ack.epoch, 0xf3a9_c2e1_b04d_5700);
        let status: EdgeStatus = serde_json::from_str(
            r#"{"link":"up","disk_bytes":0,"streams":[{"stream":"s","epoch":"00000000000000ff",
                "next_seq":3,"durable_seq":2,"acked_seq":2,"backlog_bytes":0,"backlog_blocks":0}]}"#,
        )
        .unwrap();
        assert_eq!(status.streams[0].epoch, 0xff);
    }
}
