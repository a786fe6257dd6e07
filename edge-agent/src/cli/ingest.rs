//! `edge-agent ingest --stream S`: reads NDJSON or line protocol from stdin and sends it to the
//! running agent's HTTP API in batches of `--batch-lines` lines. Each batch is one atomic,
//! durable append. On the first refusal it stops and exits non-zero with the agent's reason,
//! the stdin line it points at, and how many records were stored before it.
//!
//! Batches are cut at line boundaries, so a line-protocol string field holding a raw newline
//! must not straddle a `--batch-lines` boundary.
//!
//! A 503 with `Retry-After` (disk budget full under `on_full = "block"`) is retried a few times
//! before giving up, so a short full period does not abort a long pipe.

use std::io::BufRead as _;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use edge_agent::http::client::{Client, Response};

/// How often a 503 with `Retry-After` is retried before giving up.
const FULL_RETRIES_MAX: u32 = 10;
/// The longest wait honoured from a `Retry-After` header.
const RETRY_AFTER_MAX: Duration = Duration::from_secs(30);

#[derive(Debug)]
pub struct Args {
    pub stream: String,
    pub line_protocol: bool,
    pub config: Option<PathBuf>,
    pub url: Option<String>,
    pub batch_lines: usize,
    pub token: Option<String>,
}

/// What was sent so far, for the summary and for error messages.
#[derive(Debug, Default)]
struct Progress {
    records: u64,
    batches: u64,
    first_seq: Option<u64>,
    last_seq: u64,
    epoch: u64,
}

pub fn ingest(args: Args) -> anyhow::Result<()> {
    let client = super::agent_client(args.config.as_deref(), args.url.clone(), args.token.clone())?;
    let runtime = super::runtime()?;
    let content_type = if args.line_protocol {
        "text/plain; charset=utf-8"
    } else {
        "application/x-ndjson"
    };
    let path = format!("/v1/streams/{}/records", args.stream);
    let mut progress = Progress::default();
    let stdin = std::io::stdin().lock();
    let mut batch = String::new();
    let (mut lines_in_batch, mut batch_first_line, mut line_no) = (0usize, 1usize, 0usize);
    for line in stdin.lines() {
        let line = line.with_context(|| format!("reading stdin at line {}", line_no + 1))?;
        line_no += 1;
        batch.push_str(&line);
        batch.push('\n');
        lines_in_batch += 1;
        if lines_in_batch >= args.batch_lines {
            let body = std::mem::take(&mut batch);
            runtime.block_on(send(
                &client,
                &path,
                content_type,
                body,
                batch_first_line,
                &mut progress,
            ))?;
            (lines_in_batch, batch_first_line) = (0, line_no + 1);
        }
    }
    if !batch.trim().is_empty() {
        runtime.block_on(send(
            &client,
            &path,
            content_type,
            batch,
            batch_first_line,
            &mut progress,
        ))?;
    }
    match progress.first_seq {
        Some(first) => eprintln!(
            "ingested {} records into stream {:?} in {} batch{} (epoch {:016x}, seqs {first}..={})",
            progress.records,
            args.stream,
            progress.batches,
            if progress.batches == 1 { "" } else { "es" },
            progress.epoch,
            progress.last_seq
        ),
        None => eprintln!("stdin held no records: nothing sent"),
    }
    Ok(())
}

/// Sends one batch whose first line is stdin line `first_line`.
async fn send(
    client: &Client,
    path: &str,
    content_type: &str,
    body: String,
    first_line: usize,
    progress: &mut Progress,
) -> anyhow::Result<()> {
    if body.trim().is_empty() {
        return Ok(());
    }
    let mut retries = 0;
    let response = loop {
        let r = client
            .post(path, content_type, body.clone())
            .await
            .map_err(|e| {
                if e.is_unreachable() {
                    super::unreachable(client, &e)
                } else {
                    anyhow::Error::new(e)
                }
            })?;
        match retry_after(&r) {
            Some(wait) if retries < FULL_RETRIES_MAX => {
                retries += 1;
                tokio::time::sleep(wait).await;
            }
            _ => break r,
        }
    };
    if response.status != 200 {
        return Err(refusal(&response, first_line, progress));
    }
    let ack: serde_json::Value = serde_json::from_slice(&response.body).with_context(|| {
        format!(
            "the agent answered 200 with an unreadable body: {}",
            response.text()
        )
    })?;
    let field = |k: &str| ack.get(k).and_then(serde_json::Value::as_u64).unwrap_or(0);
    progress.records += field("count");
    progress.batches += 1;
    progress.first_seq.get_or_insert(field("first_seq"));
    progress.last_seq = field("last_seq");
    progress.epoch = ack_epoch(&ack).unwrap_or(0);
    Ok(())
}

/// The ack's epoch: 16 hex digits (a plain number from older agents).
fn ack_epoch(ack: &serde_json::Value) -> Option<u64> {
    let epoch = ack.get("epoch")?;
    epoch
        .as_str()
        .and_then(sync::epoch::parse)
        .or_else(|| epoch.as_u64())
}

/// The wait a 503 asks for, when it asks for one.
fn retry_after(r: &Response) -> Option<Duration> {
    if r.status != 503 {
        return None;
    }
    let secs: u64 = r.header("retry-after")?.trim().parse().ok()?;
    Some(Duration::from_secs(secs).min(RETRY_AFTER_MAX))
}

/// The error for a refused batch: the agent's reason, mapped to stdin's line numbers.
fn refusal(r: &Response, first_line: usize, progress: &Progress) -> anyhow::Error {
    let body: Option<serde_json::Value> = serde_json::from_slice(&r.body).ok();
    let text = |k: &str| {
        body.as_ref()
            .and_then(|b| b.get(k))
            .and_then(|v| v.as_str())
            .map(str::to_owned)
    };
    // A parse error's own message counts lines within the batch; rebuild it from its parts.
    let message = match (text("expected"), text("found")) {
        (Some(expected), Some(found)) => format!("expected {expected}, found {found}"),
        _ => text("error").unwrap_or_else(|| r.text().trim().to_owned()),
    };
    let line = body
        .as_ref()
        .and_then(|b| b.get("line"))
        .and_then(serde_json::Value::as_u64);
    let column = body
        .as_ref()
        .and_then(|b| b.get("column"))
        .and_then(serde_json::Value::as_u64);
    let place = match (line, column) {
        (Some(l), Some(c)) => format!(" at stdin line {}, column {c}", first_line as u64 + l - 1),
        (Some(l), None) => format!(" at stdin line {}", first_line as u64 + l - 1),
        _ => format!(" (batch starting at stdin line {first_line})"),
    };
    let stored = if progress.records > 0 {
        format!(
            "; the {} records before this batch are stored",
            progress.records
        )
    } else {
        String::new()
    };
    anyhow::anyhow!(
        "the agent refused the batch{place} (HTTP {}): {message}{stored}",
        r.status
    )
}
