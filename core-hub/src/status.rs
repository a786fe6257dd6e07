//! The operator status page at `/`: one server-rendered HTML page, no JavaScript.
//!
//! It shows what an operator checks first:
//! - **devices:** connected or offline (no contact for `completeness.offline_after`), retired,
//!   fenced, revoked (by device or by serial: the rule, and where and when the hub refused
//!   it, [`crate::refusals`]); last seen; event-time lag (now minus the newest event time committed from the
//!   device); backlog (blocks, bytes, oldest unsent event time) as last reported;
//! - **streams:** records committed and ingest rates (last 10 s and 60 s, from the block
//!   index), the segment graph over time (an inline SVG: x = wall time from each segment's
//!   creation to its sealing, y = its key-hash range) with per-segment rates;
//! - **completeness:** per stream the watermark and "complete through" time, and per device
//!   how far it is settled (see [`crate::completeness`]).
//!
//! The page refreshes itself every 5 s (`<meta http-equiv=refresh>`). Element ids
//! (`devices`, `device-{name}`, `stream-{name}`) are stable so tests and scripts can find
//! things.

#[path = "status_devices.rs"]
mod devices;
#[path = "status_login.rs"]
pub mod login;

use crate::completeness::{StreamSummary, Tracker, format_time};
use crate::ingest::Hub;
use rusqlite::params;
use serde::Serialize;
use std::collections::HashMap;
use std::fmt::Write;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

/// Ingest rates of one stream, from the block index.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct Rates {
    pub records_per_s_10s: f64,
    pub records_per_s_60s: f64,
    pub bytes_per_s_60s: f64,
}

/// Most recent blocks scanned for the rates (newest first).
const RATE_SCAN_BLOCKS: i64 = 20_000;

fn now_ns() -> i64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// Records and bytes per second over the last 10 s and 60 s of hub ingest time.
///
/// Hub offsets and ingest times grow together within a stream, so the newest blocks by
/// offset are the newest by ingest time: one index range scan from the end.
pub fn stream_rates(hub: &Hub, stream: &str) -> Rates {
    let Some(sid) = hub.lookup_stream(stream) else {
        return Rates::default();
    };
    let now = now_ns();
    let rows: Vec<(i64, i64, i64)> = hub
        .catalog()
        .with_read_conn(|c| {
            let mut st = c.prepare_cached(
                "SELECT count, frame_len, ingest_ts FROM blocks WHERE stream = ?1
                 ORDER BY hub_offset_base DESC LIMIT ?2",
            )?;
            let rows = st.query_map(params![i64::from(sid), RATE_SCAN_BLOCKS], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?))
            })?;
            rows.collect::<Result<Vec<_>, _>>()
        })
        .unwrap_or_default();
    let (mut r10, mut r60, mut b60) = (0i64, 0i64, 0i64);
    for (count, bytes, ingest) in rows {
        let age = now.saturating_sub(ingest);
        if age > 60_000_000_000 {
            break;
        }
        r60 += count;
        b60 += bytes;
        if age <= 10_000_000_000 {
            r10 += count;
        }
    }
    Rates {
        records_per_s_10s: r10 as f64 / 10.0,
        records_per_s_60s: r60 as f64 / 60.0,
        bytes_per_s_60s: b60 as f64 / 60.0,
    }
}

/// Escapes text for HTML element content and attribute values.
pub fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// An id-safe form of a name (device and stream names are already restricted, but be safe).
fn slug(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// "3.2 s ago" style age of a past ns timestamp.
fn ago(now: i64, then: Option<i64>) -> String {
    match then {
        None => "never".into(),
        Some(t) => {
            let d = Duration::from_nanos(now.saturating_sub(t).max(0) as u64);
            if d < Duration::from_secs(1) {
                format!("{} ms ago", d.as_millis())
            } else if d < Duration::from_secs(120) {
                format!("{:.1} s ago", d.as_secs_f64())
            } else {
                format!("{} ago", span(now.saturating_sub(t)))
            }
        }
    }
}

fn span(ns: i64) -> String {
    let d = Duration::from_nanos(ns.max(0) as u64);
    if d < Duration::from_secs(1) {
        format!("{} ms", d.as_millis())
    } else if d < Duration::from_secs(120) {
        format!("{:.1} s", d.as_secs_f64())
    } else if d < Duration::from_secs(7200) {
        format!("{} min", d.as_secs() / 60)
    } else if d < Duration::from_secs(3 * 86400) {
        format!("{} h", d.as_secs() / 3600)
    } else {
        format!("{} days", d.as_secs() / 86400)
    }
}

fn bytes(n: u64) -> String {
    match n {
        n if n >= 1 << 30 => format!("{:.1} GiB", n as f64 / f64::from(1u32 << 30)),
        n if n >= 1 << 20 => format!("{:.1} MiB", n as f64 / f64::from(1u32 << 20)),
        n if n >= 1 << 10 => format!("{:.1} KiB", n as f64 / 1024.0),
        n => format!("{n} B"),
    }
}

fn time_cell(ns: Option<i64>) -> String {
    match ns {
        Some(t) if t > i64::MIN => format!("<time>{}</time>", esc(&format_time(t))),
        Some(_) => "not heard from".into(),
        None => "&mdash;".into(),
    }
}

const STYLE: &str = "body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1em}
td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left;font-size:14px}
th{background:#f0f0f0}
.ok{color:#11772d;font-weight:600}.bad{color:#b00020;font-weight:600}.dim{color:#777}
section.stream{border-top:2px solid #ddd;margin-top:1.5em}
svg{border:1px solid #ccc;background:#fafafa}
td.why{max-width:42em}details{margin:.5em 0 1em}summary{cursor:pointer}";

/// Renders the page.
pub fn render(hub: &Hub, tracker: &Tracker) -> String {
    let now = now_ns();
    let offline_after =
        i64::try_from(tracker.config().offline_after.as_nanos()).unwrap_or(i64::MAX);
    let cat = hub.catalog();
    let devices = devices::with_refused(hub, cat.devices().unwrap_or_default());
    let streams = cat.streams().unwrap_or_default();
    let summaries: Vec<(crate::catalog::StreamRow, Option<StreamSummary>)> = streams
        .into_iter()
        .map(|s| {
            let sum = tracker.summary(hub, &s.name).ok();
            (s, sum)
        })
        .collect();
    // Newest event time per device over all streams, for the lag column.
    let mut newest: HashMap<&str, i64> = HashMap::new();
    for (_, sum) in &summaries {
        for d in sum.iter().flat_map(|s| &s.devices) {
            if let Some(t) = d.max_event_ts {
                let e = newest.entry(d.device.as_str()).or_insert(t);
                *e = (*e).max(t);
            }
        }
    }
    let connected = devices
        .iter()
        .filter(|d| !d.retired && d.last_contact_ns.is_some_and(|t| now - t <= offline_after))
        .count();
    let mut h = String::with_capacity(16 << 10);
    let _ = write!(
        h,
        "<!doctype html>\n<html lang=en><head><meta charset=utf-8><meta http-equiv=refresh content=5>\
         <title>Tributary hub status</title><style>{STYLE}</style></head><body>\n\
         <h1>Tributary hub</h1>\n<p id=summary>{} devices ({connected} connected), {} streams. \
         Generated <time>{}</time>; refreshes every 5 s.</p>\n",
        devices.len(),
        summaries.len(),
        esc(&format_time(now))
    );

    let gaps = devices::gaps_by_device(hub, &devices);
    let views = devices::classify(hub, &devices, &gaps, now, offline_after);
    devices::section(&mut h, hub, &views, &newest, now);
    h.push_str("<h2>Streams</h2>\n");
    for (s, sum) in &summaries {
        stream_section(&mut h, hub, s, sum.as_ref(), &gaps, now);
    }
    h.push_str("</body></html>\n");
    h
}

fn stream_section(
    h: &mut String,
    hub: &Hub,
    s: &crate::catalog::StreamRow,
    sum: Option<&StreamSummary>,
    gaps: &HashMap<String, Vec<crate::catalog::GapRow>>,
    now: i64,
) {
    let rates = stream_rates(hub, &s.name);
    let _ = writeln!(
        h,
        "<section class=stream id=\"stream-{}\"><h3>{}</h3>\n<p>{} records committed; \
         {:.1} records/s (10 s), {:.1} records/s and {}/s (60 s).</p>",
        slug(&s.name),
        esc(&s.name),
        s.next_offset,
        rates.records_per_s_10s,
        rates.records_per_s_60s,
        bytes(rates.bytes_per_s_60s as u64)
    );
    match crate::streams::api::segments_info(hub, &s.name) {
        Ok(info) => segments_svg(h, &info, now),
        Err(e) => {
            let _ = writeln!(
                h,
                "<p class=dim>segment graph unavailable: {}</p>",
                esc(&e.to_string())
            );
        }
    }
    let Some(sum) = sum else {
        h.push_str("</section>\n");
        return;
    };
    let _ = writeln!(
        h,
        "<h4>Completeness</h4>\n<p>Watermark {} &middot; complete through {} &middot; {} active devices</p>\n\
         <table class=completeness><thead><tr><th>Device</th><th>Complete through</th><th>Newest event</th>\
         <th>Last block</th><th>Backlog</th><th>Active</th></tr></thead><tbody>",
        time_cell(sum.watermark_ns),
        time_cell(sum.complete_through_ns),
        sum.active_devices
    );
    for d in &sum.devices {
        let behind = d.complete_through_ns < now - 60_000_000_000;
        // Records its agent dropped never arrive: such a device is not complete, whatever
        // its watermark says.
        let lost = gaps
            .get(&d.device)
            .and_then(|g| devices::gap_summary(hub, g, Some(s.id)));
        let through = match &lost {
            Some(why) => format!(
                "incomplete: {} (settled to {})",
                esc(why),
                time_cell(Some(d.complete_through_ns))
            ),
            None => time_cell(Some(d.complete_through_ns)),
        };
        let _ = writeln!(
            h,
            "<tr id=\"completeness-{}-{}\"><td>{}</td><td class={}>{}</td><td>{}</td><td>{}</td><td>{} blocks, {}</td><td>{}</td></tr>",
            slug(&s.name),
            slug(&d.device),
            esc(&d.device),
            if behind || lost.is_some() {
                "bad"
            } else {
                "ok"
            },
            through,
            time_cell(d.max_event_ts),
            ago(now, d.last_ingest_ns),
            d.backlog_blocks,
            bytes(d.backlog_bytes),
            if d.active { "yes" } else { "idle" }
        );
    }
    h.push_str("</tbody></table></section>\n");
}

/// The segments of a stream over time, and a table of them with their rates.
fn segments_svg(h: &mut String, info: &crate::streams::api::SegmentsInfo, now: i64) {
    const W: f64 = 720.0;
    const H: f64 = 160.0;
    const SPACE: f64 = 4_294_967_296.0;
    let t0 = info
        .segments
        .iter()
        .map(|s| s.created_ns)
        .min()
        .unwrap_or(now);
    let t1 = now.max(t0 + 1);
    let x = |t: i64| (t.clamp(t0, t1) - t0) as f64 / (t1 - t0) as f64 * W;
    let open = info.segments.iter().filter(|s| s.end.is_none()).count();
    let _ = writeln!(
        h,
        "<h4>Segments</h4>\n<p>{open} open, {} in all; readable end {}.</p>\n\
         <svg class=segments width={W} height={H} viewBox=\"0 0 {W} {H}\" role=img \
         aria-label=\"segments over time\">",
        info.segments.len(),
        info.end
    );
    for seg in &info.segments {
        let (x0, x1) = (x(seg.created_ns), x(seg.sealed_ns.unwrap_or(now)));
        let (y0, y1) = (seg.lo as f64 / SPACE * H, seg.hi as f64 / SPACE * H);
        let fill = if seg.end.is_none() {
            "#4c8bf5"
        } else {
            "#b8c7e0"
        };
        let _ = writeln!(
            h,
            "<rect x=\"{x0:.1}\" y=\"{y0:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{fill}\" stroke=\"#fff\">\
             <title>segment {} [{}, {}) offsets {}..{}</title></rect>",
            (x1 - x0).max(1.0),
            (y1 - y0).max(1.0),
            seg.id,
            seg.lo,
            seg.hi,
            seg.start,
            seg.end.map_or("open".to_string(), |e| e.to_string())
        );
    }
    let _ = writeln!(
        h,
        "</svg>\n<p class=dim>x: wall time from <time>{}</time> to now; y: key-hash range \
         0 (top) to 2<sup>32</sup> (bottom); dark = open, light = sealed.</p>",
        esc(&format_time(t0))
    );
    h.push_str(
        "<table class=segments><thead><tr><th>Segment</th><th>Key-hash range</th><th>Offsets</th>\
        <th>Records/s</th><th>Bytes/s</th><th>Load</th></tr></thead><tbody>\n",
    );
    for seg in info.segments.iter().rev().take(32) {
        let rate = info.rates.iter().find(|r| r.segment == seg.id);
        let _ = writeln!(
            h,
            "<tr><td>{}</td><td>[{:#010x}, {:#011x})</td><td>{}..{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            seg.id,
            seg.lo,
            seg.hi,
            seg.start,
            seg.end.map_or("open".to_string(), |e| e.to_string()),
            rate.map_or("&mdash;".into(), |r| format!("{:.1}", r.records_per_s)),
            rate.map_or("&mdash;".into(), |r| bytes(r.bytes_per_s as u64)),
            rate.map_or("&mdash;".into(), |r| format!("{:.2}", r.load)),
        );
    }
    h.push_str("</tbody></table>\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes() {
        assert_eq!(
            esc("<a href=\"x\">&'"),
            "&lt;a href=&quot;x&quot;&gt;&amp;&#39;"
        );
        assert_eq!(slug("truck 1/x"), "truck_1_x");
        assert_eq!(bytes(2048), "2.0 KiB");
        assert_eq!(ago(10_000_000_000, Some(7_000_000_000)), "3.0 s ago");
        assert_eq!(ago(1, None), "never");
    }
}

/// Where the hub's start-up is: `/healthz` says not ready, with the reason, until tier 2 is
/// open (`core-hub run` opens it with retries, see `main.rs`). A hub opened as a library
/// (tests, tools) is ready from the start.
#[derive(Debug, Default)]
pub struct Startup {
    not_ready: std::sync::RwLock<Option<String>>,
    tier2_open_failures: std::sync::atomic::AtomicU64,
}

impl Startup {
    /// Not ready, for `why` (shown by `/healthz`).
    pub fn not_ready(&self, why: String) {
        *self.not_ready.write().expect("startup lock") = Some(why);
    }

    /// A transient failure to open tier 2: counted, and shown by `/healthz` as `why`.
    pub fn tier2_open_failed(&self, why: String) {
        self.tier2_open_failures
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.not_ready(why);
    }

    /// Start-up is over.
    pub fn ready(&self) {
        *self.not_ready.write().expect("startup lock") = None;
    }

    /// Why the hub is not ready yet, `None` once it is.
    pub fn why_not_ready(&self) -> Option<String> {
        self.not_ready.read().expect("startup lock").clone()
    }

    /// `tributary_hub_ready` and `tributary_hub_tier2_open_failures_total`.
    pub fn render_metrics(&self, out: &mut String) {
        let ready = u64::from(self.why_not_ready().is_none());
        let failures = self
            .tier2_open_failures
            .load(std::sync::atomic::Ordering::Relaxed);
        let _ = write!(
            out,
            "# HELP tributary_hub_ready 1 once start-up is over (tier 2 open); /healthz says why not.\n\
             # TYPE tributary_hub_ready gauge\ntributary_hub_ready {ready}\n\
             # HELP tributary_hub_tier2_open_failures_total Start-up attempts to open tier 2 that failed and were retried.\n\
             # TYPE tributary_hub_tier2_open_failures_total counter\n\
             tributary_hub_tier2_open_failures_total {failures}\n"
        );
    }
}

/// First wait after a failed attempt to open tier 2 at start-up; it doubles per failure.
pub const TIER2_OPEN_BACKOFF_INITIAL: Duration = Duration::from_millis(250);
/// Longest wait between two attempts to open tier 2.
pub const TIER2_OPEN_BACKOFF_MAX: Duration = Duration::from_secs(10);

/// Opens tier 2 for `core-hub run`, retrying what may clear by itself (out of descriptors, a
/// catalog or disk error, an S3 endpoint not up yet: the bucket is listed once, so an
/// unreachable store shows here and not at the first upload) with backoff. Each failure is
/// logged with its reason, counted and shown by `/healthz` until an attempt succeeds; then
/// the hub is ready. A misconfiguration (a bad `tier2.url`, missing or malformed
/// credentials, a tier-2 directory the hub may not create) is returned at once.
pub async fn open_tiering(
    hub: &Arc<Hub>,
    cfg: &crate::HubConfig,
) -> Result<Arc<crate::tiering::Tiering>, crate::tiering::TierOpenError> {
    let faults = crate::tiering::faults::hook_from_env();
    let mut backoff = TIER2_OPEN_BACKOFF_INITIAL;
    hub.startup().not_ready("opening tier 2".into());
    for attempt in 1u64.. {
        let why = match probe_store(&cfg.tier2).await {
            Ok(()) => match crate::tiering::Tiering::open(hub.clone(), cfg, faults.clone()).await {
                Ok(t) => {
                    hub.startup().ready();
                    tracing::info!(url = %cfg.tier2.url, attempt, "tiering to tier 2; the hub is ready");
                    return Ok(t);
                }
                Err(e) if is_permanent(&e) => return Err(e),
                Err(e) => e.to_string(),
            },
            Err(Probe::Permanent(e)) => return Err(e),
            Err(Probe::Transient(why)) => why,
        };
        tracing::warn!(
            url = %cfg.tier2.url, attempt, retry_in = %humantime::format_duration(backoff), error = %why,
            "cannot open tier 2 yet; the hub is not ready and retries"
        );
        hub.startup().tier2_open_failed(format!(
            "opening tier 2 ({}): attempt {attempt} failed, retrying in {backoff:?}: {why}",
            cfg.tier2.url
        ));
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(TIER2_OPEN_BACKOFF_MAX);
    }
    unreachable!("the attempts never run out")
}

enum Probe {
    Permanent(crate::tiering::TierOpenError),
    Transient(String),
}

/// For an S3 tier 2, one listing of the hub's own prefix: the endpoint answers and the
/// credentials are accepted. A local directory is checked by `Tiering::open` itself.
async fn probe_store(cfg: &crate::config::Tier2Config) -> Result<(), Probe> {
    if cfg.url.starts_with("file://") {
        return Ok(());
    }
    let store = crate::tiering::open_store(cfg).map_err(|e| {
        if is_permanent(&e) {
            Probe::Permanent(e)
        } else {
            Probe::Transient(e.to_string())
        }
    })?;
    match store.list("_tributary/").await {
        Ok(_) => Ok(()),
        Err(e) => Err(Probe::Transient(format!("tier 2 does not answer: {e}"))),
    }
}

/// Whether a failure to open tier 2 is a misconfiguration that no retry fixes.
fn is_permanent(e: &crate::tiering::TierOpenError) -> bool {
    use crate::tiering::TierOpenError as E;
    match e {
        E::Config(_) | E::Lake(_) => true,
        E::Store(tier::OpenError::MissingCredential { .. } | tier::OpenError::Store { .. }) => true,
        E::Store(_) | E::Catalog(_) => false,
        E::Reconcile { source, .. } => !matches!(**source, tier::TierError::List(_)),
        E::LocalRoot { source, .. } | E::Io(source) => !is_transient_io(source),
    }
}

/// IO errors that clear without the operator: descriptors, space, interrupted or timed-out
/// calls, a device error that may pass. Anything else (permissions, a missing parent) is
/// configuration.
fn is_transient_io(e: &std::io::Error) -> bool {
    use std::io::ErrorKind as K;
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOMEM | libc::EAGAIN | libc::EIO)
    ) || matches!(
        e.kind(),
        K::StorageFull | K::QuotaExceeded | K::Interrupted | K::TimedOut | K::WouldBlock
    )
}
