//! `edge-agent status`: asks the running agent for `/v1/status` and prints streams, backlog
//! bytes and segments, the oldest unsent record's age, the last acknowledged seq, link state
//! (with its reason, since when and the next retry), one line per stream the hub refuses (its
//! code and message, since when, the next offer), the MQTT sources' connections and the
//! dropped counts (kept across restarts). `--json` prints the report as the agent sent it.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::Context as _;
use edge_agent::http::StatusReport;

pub fn status(config: Option<&Path>, url: Option<String>, json: bool) -> anyhow::Result<()> {
    let client = super::agent_client(config, url, None)?;
    let runtime = super::runtime()?;
    let response = runtime.block_on(client.get("/v1/status")).map_err(|e| {
        if e.is_unreachable() {
            super::unreachable(&client, &e)
        } else {
            e.into()
        }
    })?;
    if response.status != 200 {
        anyhow::bail!(
            "the agent at {} answered HTTP {}: {}",
            client.url(),
            response.status,
            response.text().trim()
        );
    }
    let report: StatusReport = serde_json::from_slice(&response.body)
        .with_context(|| format!("the agent at {} sent an unreadable status", client.url()))?;
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", render(&report, &client.url()));
    }
    Ok(())
}

/// The human-readable report.
pub fn render(r: &StatusReport, url: &str) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "agent     {url}");
    let _ = writeln!(out, "epoch     {:016x}", r.epoch);
    let _ = writeln!(out, "link      {}", link_line(r));
    for refused in &r.refused_streams {
        let _ = writeln!(out, "refused   {}", refused_line(refused));
    }
    for src in &r.sources {
        let _ = writeln!(out, "source    {}", source_line(src));
    }
    let _ = writeln!(
        out,
        "storage   fsync {}, on_full {}, disk {} of {}",
        r.fsync,
        r.on_full,
        bytes(r.disk_bytes),
        bytes(r.disk_bytes_max)
    );
    if let Some(why) = &r.poisoned {
        let _ = writeln!(
            out,
            "POISONED  {why} (restart the agent to re-verify the log)"
        );
    }
    let _ = writeln!(out);
    let header = [
        "STREAM",
        "NEXT SEQ",
        "DURABLE",
        "ACKED",
        "BACKLOG",
        "BLOCKS",
        "SEGMENTS",
        "OLDEST UNSENT",
        "DROPPED",
        "QUARANTINED",
    ];
    let mut rows: Vec<Vec<String>> = vec![header.iter().map(|h| h.to_string()).collect()];
    for s in &r.streams {
        rows.push(vec![
            s.stream.clone(),
            s.next_seq.to_string(),
            s.durable_seq.to_string(),
            if s.acked_seq == 0 {
                "-".into()
            } else {
                s.acked_seq.to_string()
            },
            bytes(s.backlog_bytes),
            s.backlog_blocks.to_string(),
            s.segments.to_string(),
            s.oldest_unsent_age_s.map_or_else(|| "-".into(), age),
            format!("{} records", s.dropped_records),
            format!("{} blocks", s.quarantined_blocks),
        ]);
    }
    let widths: Vec<usize> = (0..header.len())
        .map(|c| rows.iter().map(|r| r[c].len()).max().unwrap_or(0))
        .collect();
    for row in rows {
        let cells: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(cell, w)| format!("{cell:<w$}"))
            .collect();
        let _ = writeln!(out, "{}", cells.join("  ").trim_end());
    }
    out
}

/// `up since ...`, or `down since ... (12m 5s): reason; next retry in 3s (...)`.
fn link_line(r: &StatusReport) -> String {
    let mut line = r.link.label().to_owned();
    let Some(d) = &r.link_detail else {
        return line;
    };
    if d.state == "connecting" {
        line.push_str(" (connecting)");
    }
    if let (Some(since), Some(secs)) = (&d.since, d.since_s) {
        let _ = write!(line, " since {since} ({})", age(secs));
    }
    if let Some(reason) = &d.reason {
        let _ = write!(line, ": {reason}");
    }
    if let (Some(at), Some(secs)) = (&d.next_retry, d.next_retry_in_s) {
        let _ = write!(line, "; next retry in {} ({at})", age(secs.ceil()));
    }
    line
}

/// `telemetry: UNAUTHORIZED_STREAM since ... (5m 2s): message; next retry in 40s (...)`.
fn refused_line(r: &edge_agent::http::status::RefusedReport) -> String {
    format!(
        "{}: {} since {} ({}): {}; next retry in {} ({})",
        r.stream,
        r.code,
        r.since,
        age(r.since_s),
        r.message,
        age(r.next_retry_in_s.ceil()),
        r.next_retry
    )
}

/// `mqtt sources[0] mqtt://host:1883 -> telemetry: connected since ..., 120 messages`.
fn source_line(s: &edge_agent::http::status::SourceReport) -> String {
    let mut line = format!(
        "{} #{} {} -> {}: {}",
        s.kind, s.source, s.broker, s.stream, s.state
    );
    if let Some(since) = &s.since {
        let _ = write!(line, " since {since}");
    }
    let _ = write!(line, ", {} messages received", s.messages_received);
    if let Some(e) = &s.last_error {
        let _ = write!(line, "; last error: {e}");
    }
    line
}

/// Bytes in binary units.
fn bytes(n: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64;
    let mut unit = "B";
    for u in UNITS {
        if v < 1024.0 {
            break;
        }
        v /= 1024.0;
        unit = u;
    }
    format!("{v:.1} {unit}")
}

/// An age such as `42s`, `3m 20s`, `2h 5m` or `3d 4h`.
fn age(secs: f64) -> String {
    let s = secs.max(0.0) as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m {}s", s / 60, s % 60),
        3600..86400 => format!("{}h {}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d {}h", s / 86400, s % 86400 / 3600),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_stream_gets_a_line() {
        let report: StatusReport = serde_json::from_value(serde_json::json!({
            "epoch": "00000000000000ab", "link": "up", "fsync": "always", "on_full": "block",
            "disk_bytes": 0, "disk_bytes_max": 1024, "poisoned": null, "streams": [],
            "refused_streams": [{
                "stream": "telemetry", "code": "UNAUTHORIZED_STREAM",
                "message": "not on the allow-list", "since": "2026-12-02T03:00:00.000Z",
                "since_s": 65.0, "next_retry": "2026-12-02T03:01:10.000Z", "next_retry_in_s": 4.2
            }]
        }))
        .unwrap();
        let text = render(&report, "http://agent");
        assert!(text.contains("epoch     00000000000000ab"), "{text}");
        assert!(
            text.contains(
                "refused   telemetry: UNAUTHORIZED_STREAM since 2026-12-02T03:00:00.000Z (1m 5s): \
                 not on the allow-list; next retry in 5s (2026-12-02T03:01:10.000Z)"
            ),
            "{text}"
        );
    }

    #[test]
    fn units() {
        assert_eq!(bytes(10), "10 B");
        assert_eq!(bytes(1536), "1.5 KiB");
        assert_eq!(bytes(3 << 30), "3.0 GiB");
        assert_eq!(age(5.2), "5s");
        assert_eq!(age(200.0), "3m 20s");
        assert_eq!(age(7500.0), "2h 5m");
        assert_eq!(age(90000.0), "1d 1h");
    }
}
