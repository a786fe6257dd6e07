//! What the Modbus and OPC UA sources share for `/v1/status` and `/metrics`: the state of the
//! link to their device or server ([`Link`]), and the Prometheus text of their counters, one
//! family per counter with a `source` label ([`render_per_source`], [`render_labelled`]).

use std::fmt::Write as _;
use std::sync::{Mutex, MutexGuard};

use crate::http::status::{self, SourceReport};

/// A source's link as last seen: up, down with the reason, or not yet connected.
#[derive(Debug)]
pub struct Link(Mutex<Conn>);

#[derive(Debug, Default)]
struct Conn {
    connected: bool,
    last_error: Option<String>,
    /// When the state last changed.
    since_ms: u64,
}

/// What a source's `/v1/status` line says besides its link's state.
pub struct ReportLine<'a> {
    /// Its place among the sources of its kind (the `source` label).
    pub index: usize,
    pub kind: &'a str,
    /// The device or server, as an operator names it.
    pub peer: &'a str,
    pub stream: &'a str,
    /// Polls or data changes received.
    pub messages: u64,
    pub records: u64,
}

impl Default for Link {
    fn default() -> Self {
        Link(Mutex::new(Conn {
            since_ms: status::now_ms(),
            ..Conn::default()
        }))
    }
}

impl Link {
    fn lock(&self) -> MutexGuard<'_, Conn> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The peer answered: up, the last error cleared.
    pub fn set_up(&self) {
        let mut c = self.lock();
        if !c.connected {
            c.connected = true;
            c.since_ms = status::now_ms();
        }
        c.last_error = None;
    }

    /// The peer did not answer, or the link broke, because of `why`.
    pub fn set_down(&self, why: &str) {
        let mut c = self.lock();
        if c.connected || c.last_error.is_none() {
            c.since_ms = status::now_ms();
        }
        c.connected = false;
        c.last_error = Some(why.to_owned());
    }

    pub fn is_up(&self) -> bool {
        self.lock().connected
    }

    /// The source's line in `/v1/status`.
    pub fn report(&self, line: ReportLine<'_>) -> SourceReport {
        let c = self.lock();
        let state = match (c.connected, &c.last_error) {
            (true, _) => "connected",
            (false, Some(_)) => "disconnected",
            (false, None) => "connecting",
        };
        SourceReport {
            source: line.index,
            kind: line.kind.into(),
            broker: line.peer.into(),
            stream: line.stream.into(),
            state: state.into(),
            last_error: c.last_error.clone(),
            since: Some(status::rfc3339_ms(c.since_ms)),
            messages_received: line.messages,
            records: line.records,
        }
    }
}

/// A per-source metric: its name after the family prefix, Prometheus type, help text and
/// reader.
pub type Metric<S> = (&'static str, &'static str, &'static str, fn(&S) -> u64);

/// Each metric of `metrics` as one family `{prefix}{name}`, one line per source of `all`.
pub fn render_per_source<S>(
    out: &mut String,
    prefix: &str,
    metrics: &[Metric<S>],
    all: &[std::sync::Arc<S>],
) {
    for (name, kind, help, get) in metrics {
        let _ = writeln!(out, "# HELP {prefix}{name} {help}");
        let _ = writeln!(out, "# TYPE {prefix}{name} {kind}");
        for (i, s) in all.iter().enumerate() {
            let _ = writeln!(out, "{prefix}{name}{{source=\"{i}\"}} {}", get(s));
        }
    }
}

/// The counter family `name` with one line per `(source, label value, count)` of `rows`.
pub fn render_labelled<'a>(
    out: &mut String,
    name: &str,
    help: &str,
    label: &str,
    rows: impl Iterator<Item = (usize, &'a str, u64)>,
) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} counter");
    for (i, value, n) in rows {
        let value = value.replace('\\', "\\\\").replace('"', "\\\"");
        let _ = writeln!(out, "{name}{{source=\"{i}\",{label}=\"{value}\"}} {n}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn the_state_follows_the_last_answer() {
        let link = Link::default();
        let line = |l: &Link| {
            l.report(ReportLine {
                index: 0,
                kind: "modbus",
                peer: "plc:502",
                stream: "s",
                messages: 1,
                records: 1,
            })
        };
        assert_eq!(line(&link).state, "connecting");
        link.set_down("refused");
        let down = line(&link);
        assert_eq!(
            (down.state.as_str(), down.last_error.as_deref()),
            ("disconnected", Some("refused"))
        );
        link.set_up();
        assert!(link.is_up());
        let up = line(&link);
        assert_eq!((up.state.as_str(), up.last_error), ("connected", None));
    }

    #[test]
    fn families_have_one_line_per_source_and_labels_are_escaped() {
        let all = vec![Arc::new(3u64), Arc::new(5u64)];
        let mut out = String::new();
        let metrics: [Metric<u64>; 1] = [("polls_total", "counter", "polls", |s| *s)];
        render_per_source(&mut out, "tributary_edge_x_", &metrics, &all);
        render_labelled(
            &mut out,
            "tributary_edge_x_errors_total",
            "errors",
            "channel",
            [(1, "a\"b", 2)].into_iter(),
        );
        assert!(out.contains("# TYPE tributary_edge_x_polls_total counter\n"));
        assert!(out.contains("tributary_edge_x_polls_total{source=\"0\"} 3\n"));
        assert!(out.contains("tributary_edge_x_polls_total{source=\"1\"} 5\n"));
        assert!(out.contains("tributary_edge_x_errors_total{source=\"1\",channel=\"a\\\"b\"} 2\n"));
    }
}
