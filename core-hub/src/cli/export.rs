//! `core-hub export STREAM --from T --to T --out FILE.parquet`: every record committed with an
//! event time in `[from, to)`, whether tier 2 holds it yet or not.
//!
//! Tier 2 is read directly; the records after its end come from the running hub's API (the
//! config's `listen.http`), or, with no hub running, from its data directory opened here. When
//! neither is possible the export refuses (exit 6) rather than write a file short of records:
//! `--tier2-only` asks for tier 2 alone. An empty window writes no file and exits 0.

use super::error::{Exit, coded};
use super::output;
use super::target;
use anyhow::{Context as _, Result};
use core_hub::client::{self, ApiTarget};
use core_hub::read::ReadRecord;
use core_hub::tiering::export::{
    ExportError, ExportOptions, ExportProgress, TierTwoOnly, Untiered, Window, export_committed,
};
use core_hub::{Hub, HubConfig};
use std::path::PathBuf;
use std::sync::Arc;
use sync::record::Value;

#[derive(clap::Args, Debug)]
pub struct ExportArgs {
    pub stream: String,
    /// Start of the window (inclusive): RFC 3339 (`2026-11-29T00:00:00Z`), ns since the Unix
    /// epoch, or relative (`-1h`).
    #[arg(long, allow_hyphen_values = true)]
    pub from: String,
    /// End of the window (exclusive), in the same forms.
    #[arg(long, allow_hyphen_values = true)]
    pub to: String,
    #[arg(long)]
    pub out: PathBuf,
    /// Leave out chunks whose tier-2 object is damaged or missing (each is named and
    /// counted) instead of failing the export.
    #[arg(long)]
    pub skip_damaged: bool,
    /// Export tier 2 alone: leave out records committed but not yet tiered.
    #[arg(long)]
    pub tier2_only: bool,
    #[arg(long, default_value = "hub.toml")]
    pub config: PathBuf,
}

/// Records per page asked of the untiered source.
const PAGE_RECORDS: usize = 10_000;

pub fn export(a: &ExportArgs) -> Result<()> {
    let cfg = target::load_config(&a.config)?;
    let window = Window {
        from_ns: super::time::parse("--from", &a.from)?,
        to_ns: super::time::parse("--to", &a.to)?,
    };
    if window.from_ns >= window.to_ns {
        anyhow::bail!("--from must be before --to: the window [from, to) is empty as given");
    }
    super::runtime()?.block_on(run(a, &cfg, window))
}

async fn run(a: &ExportArgs, cfg: &HubConfig, window: Window) -> Result<()> {
    let style = indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} chunks {msg}")?;
    let mut bar = Bar(indicatif::ProgressBar::new(0).with_style(style));
    let opts = ExportOptions {
        skip_damaged: a.skip_damaged,
        ..ExportOptions::default()
    };
    let mut source = source(a, cfg).await?;
    let result = export_committed(
        cfg,
        &a.stream,
        window,
        &a.out,
        &mut bar,
        &opts,
        source.as_mut(),
    )
    .await;
    bar.0.finish_and_clear();
    let report = match result {
        Err(ExportError::Empty { stream }) => {
            return Ok(output::print(&format!(
                "no records of `{stream}` have an event time in [{}, {}): no file written\n",
                output::time(Some(window.from_ns)),
                output::time(Some(window.to_ns)),
            ))?);
        }
        r => r?,
    };
    let mut text = format!(
        "wrote {} records ({}) from {} tier-2 chunks and {} records not yet tiered to {}\n",
        report.records,
        output::size(report.bytes),
        report.chunks_read,
        report.untiered_records,
        a.out.display()
    );
    if report.skipped_chunks > 0 {
        text.push_str(&format!(
            "left out {} damaged or missing chunks ({} records); the log names each\n",
            report.skipped_chunks, report.skipped_records
        ));
    }
    output::print(&text)?;
    Ok(())
}

/// Where the records after tier 2's end come from.
async fn source(a: &ExportArgs, cfg: &HubConfig) -> Result<Box<dyn Untiered>> {
    if a.tier2_only {
        return Ok(Box::new(TierTwoOnly));
    }
    let token = cfg
        .http
        .reader_tokens
        .first()
        .or(cfg.http.admin_tokens.first())
        .cloned();
    let api = ApiTarget::from_listen(cfg.listen.http, token);
    match client::get(&api, "/v1/streams").await {
        Ok(resp) if resp.status == 200 => {
            let end = committed_end(&resp.body, &a.stream)?;
            return Ok(Box::new(FromApi {
                api,
                stream: a.stream.clone(),
                end,
            }));
        }
        Ok(resp) => return Err(target::api_error(&resp)),
        Err(_) => {}
    }
    // No hub answers: read its data directory, which fails if a hub holds it after all.
    let local = {
        let cfg = cfg.clone();
        tokio::task::spawn_blocking(move || Hub::open(&cfg)).await?
    };
    match local {
        Ok(hub) => Ok(Box::new(FromDataDir {
            hub,
            stream: a.stream.clone(),
        })),
        Err(e) => Err(coded(
            Exit::Incomplete,
            format!(
                "cannot include the records not yet tiered: the hub API at http://{} does not \
                 answer and its data directory cannot be opened ({e}); start the hub, or pass \
                 --tier2-only to export tier 2 alone",
                api.authority
            ),
        )),
    }
}

/// The stream's next hub offset when the export starts, from `GET /v1/streams`.
fn committed_end(body: &[u8], stream: &str) -> Result<u64> {
    let list: Vec<core_hub::api::StreamInfo> =
        serde_json::from_slice(body).context("the hub's stream list is not what it should be")?;
    Ok(list
        .into_iter()
        .find(|s| s.name == stream)
        .map_or(0, |s| s.next_offset))
}

/// Untiered records through a running hub's reader API, up to what was committed at start.
struct FromApi {
    api: ApiTarget,
    stream: String,
    end: u64,
}

#[async_trait::async_trait]
impl Untiered for FromApi {
    async fn page(&mut self, from: u64) -> Result<Vec<ReadRecord>, String> {
        if from >= self.end {
            return Ok(Vec::new());
        }
        let limit = PAGE_RECORDS.min(usize::try_from(self.end - from).unwrap_or(usize::MAX));
        let path = format!(
            "/v1/streams/{}/records?from={from}&limit={limit}",
            client::query_escape(&self.stream)
        );
        let resp = client::get(&self.api, &path)
            .await
            .map_err(|e| format!("the hub at http://{}: {e}", self.api.authority))?;
        if resp.status != 200 {
            return Err(format!(
                "the hub answered {}: {}",
                resp.status,
                String::from_utf8_lossy(&resp.body).trim()
            ));
        }
        let mut page = Vec::new();
        for line in resp.body.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
            let r = record_of(line).map_err(|e| format!("a record line of the hub: {e}"))?;
            if r.offset < self.end {
                page.push(r);
            }
        }
        Ok(page)
    }
}

/// Untiered records from the data directory of a hub that is not running.
struct FromDataDir {
    hub: Arc<Hub>,
    stream: String,
}

#[async_trait::async_trait]
impl Untiered for FromDataDir {
    async fn page(&mut self, from: u64) -> Result<Vec<ReadRecord>, String> {
        let (hub, stream) = (self.hub.clone(), self.stream.clone());
        tokio::task::spawn_blocking(move || {
            match core_hub::read::read_records(&hub, &stream, from, PAGE_RECORDS) {
                Ok(page) => Ok(page.records),
                Err(core_hub::read::ReadError::UnknownStream(_)) => Ok(Vec::new()),
                Err(e) => Err(e.to_string()),
            }
        })
        .await
        .map_err(|e| e.to_string())?
    }
}

impl Drop for FromDataDir {
    fn drop(&mut self) {
        self.hub.shutdown();
    }
}

/// One NDJSON line of `GET /v1/streams/{s}/records` back into a record.
fn record_of(line: &[u8]) -> Result<ReadRecord, String> {
    let v: serde_json::Value = serde_json::from_slice(line).map_err(|e| e.to_string())?;
    let int = |k: &str| v[k].as_i64().ok_or_else(|| format!("no integer `{k}`"));
    let uint = |k: &str| v[k].as_u64().ok_or_else(|| format!("no integer `{k}`"));
    let text = |k: &str| {
        v[k].as_str()
            .map(str::to_string)
            .ok_or_else(|| format!("no string `{k}`"))
    };
    let epoch = match &v["epoch"] {
        serde_json::Value::String(s) => sync::epoch::parse(s).ok_or("a bad `epoch`")?,
        e => e.as_u64().ok_or("no `epoch`")?,
    };
    let fields = v["fields"]
        .as_object()
        .ok_or("no object `fields`")?
        .iter()
        .filter_map(|(k, f)| value_of(f).map(|f| (k.clone(), f)))
        .collect();
    let tags = match v.get("tags") {
        None => Vec::new(),
        Some(t) => t
            .as_object()
            .ok_or("`tags` is not an object")?
            .iter()
            .map(|(k, t)| {
                Ok((
                    k.clone(),
                    t.as_str()
                        .ok_or("a tag value that is not a string")?
                        .to_owned(),
                ))
            })
            .collect::<Result<_, &str>>()?,
    };
    Ok(ReadRecord {
        tags,
        device: text("device")?,
        epoch,
        seq: uint("seq")?,
        key: text("key")?,
        ts: int("ts")?,
        fields,
        offset: uint("offset")?,
        ingest_ts: int("ingest_ts")?,
        segment: u32::try_from(uint("segment")?).map_err(|_| "a bad `segment`")?,
    })
}

/// A field value as the NDJSON writes it: integers without a fraction, floats with one,
/// bytes as an array of numbers; `null` (a NaN) is left out, as a missing field.
fn value_of(f: &serde_json::Value) -> Option<Value> {
    use serde_json::Value as J;
    match f {
        J::Bool(b) => Some(Value::Bool(*b)),
        J::String(s) => Some(Value::Str(s.clone())),
        J::Number(n) if n.is_i64() => n.as_i64().map(Value::I64),
        J::Number(n) => n.as_f64().map(Value::F64),
        J::Array(a) => a
            .iter()
            .map(|b| b.as_u64().and_then(|b| u8::try_from(b).ok()))
            .collect::<Option<Vec<u8>>>()
            .map(Value::Bytes),
        J::Null | J::Object(_) => None,
    }
}

/// Drives an indicatif bar from the export's progress.
struct Bar(indicatif::ProgressBar);

impl ExportProgress for Bar {
    fn start(&mut self, total: u64) {
        self.0.set_length(total);
    }
    fn chunk(&mut self, records: u64) {
        self.0.inc(1);
        self.0.set_message(format!("{records} records"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ndjson_lines_come_back_as_records() {
        let line = br#"{"device":"d1","epoch":"0000000000000002","seq":3,"key":"k/1","ts":-4,"fields":{"z":1.5,"a":-7,"b":true,"s":"x","raw":[0,255],"nan":null},"offset":9,"ingest_ts":10,"segment":4}"#;
        let r = record_of(line).unwrap();
        assert_eq!(
            (r.epoch, r.seq, r.offset, r.ts, r.segment),
            (2, 3, 9, -4, 4)
        );
        assert_eq!(
            r.fields,
            vec![
                ("a".into(), Value::I64(-7)),
                ("b".into(), Value::Bool(true)),
                ("raw".into(), Value::Bytes(vec![0, 255])),
                ("s".into(), Value::Str("x".into())),
                ("z".into(), Value::F64(1.5)),
            ]
        );
    }
}
