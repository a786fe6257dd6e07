//! Counters of the per-connection limits, exported on `/metrics` (names documented in
//! docs/security.md, so the adversarial suites can assert them).

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

use sync::protocol::ErrorCode;

use crate::metrics::{counter, gauge};

/// Wire codes counted one by one in `tributary_hub_sessions_ended_total`; higher (unknown)
/// codes share the last slot.
const ENDED_CODES: usize = 32;

/// What the connection limits did, since start.
#[derive(Debug, Default)]
pub struct ConnStats {
    /// Connections closed with `SUPERSEDED`: a newer connection of their device took their place.
    pub superseded: AtomicU64,
    /// Connections closed with `HELLO_TIMEOUT`: no control stream or Hello within the deadline.
    pub hello_timeouts: AtomicU64,
    /// Sessions closed with `IDLE_TIMEOUT`: the control stream or a data stream made no progress.
    pub idle_timeouts: AtomicU64,
    /// Connections refused with `LIMIT_EXCEEDED` at the hub's connection capacity.
    pub refused: AtomicU64,
    /// Times a connection stopped taking data streams at `ingest.blocks_in_flight_max`.
    pub blocks_in_flight_limited: AtomicU64,
    /// Data streams that waited for the ingest budget before their bytes were read.
    pub memory_waits: AtomicU64,
    /// QUIC Retry packets sent to validate client addresses under handshake load.
    pub retries: AtomicU64,
    /// Handshakes in progress now.
    pub handshakes: AtomicU64,
    /// The QUIC receive windows of live connections together, reserved from the ingest budget.
    pub window_reserved_bytes: AtomicU64,
    /// Connections admitted with less than the full receive window (the budget was short).
    pub windows_reduced: AtomicU64,
    /// Connections and sessions the hub ended with an error code, by wire code: every
    /// refusal, the receiver's own (a bad block, a protocol violation, a limit) included.
    pub ended: [AtomicU64; ENDED_CODES],
    /// Streams refused without ending the session (StreamRefused), by wire code.
    pub streams_refused: [AtomicU64; ENDED_CODES],
}

impl ConnStats {
    pub(super) fn bump(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a connection or session the hub ended with `code`.
    pub(super) fn ended(&self, code: ErrorCode) {
        let i = usize::from(code.to_u16()).min(ENDED_CODES - 1);
        Self::bump(&self.ended[i]);
    }

    /// Counts a stream refused with `code` while its session carried on.
    pub(super) fn stream_refused(&self, code: ErrorCode) {
        let i = usize::from(code.to_u16()).min(ENDED_CODES - 1);
        Self::bump(&self.streams_refused[i]);
    }
}

/// `BadBlock` as the docs spell codes: `BAD_BLOCK`.
fn code_label(code: ErrorCode) -> String {
    let mut out = String::new();
    for (i, c) in format!("{code:?}").chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_uppercase());
    }
    out
}

fn ended_metrics(out: &mut String, c: &ConnStats) {
    let name = "tributary_hub_sessions_ended_total";
    let help = "Connections and sessions the hub ended with an error code, by code.";
    by_code(out, name, help, &c.ended);
    let name = "tributary_hub_streams_refused_total";
    let help = "Streams refused (StreamRefused) while their device's session carried on, by code.";
    by_code(out, name, help, &c.streams_refused);
}

fn by_code(out: &mut String, name: &str, help: &str, counts: &[AtomicU64; ENDED_CODES]) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
    for (i, n) in counts.iter().enumerate().skip(1) {
        let n = n.load(Ordering::Relaxed);
        if n > 0 {
            let code = code_label(ErrorCode::from_u16(i as u16));
            let _ = writeln!(out, "{name}{{code=\"{code}\"}} {n}");
        }
    }
}

/// Writes the connection-limit families.
pub fn connection_metrics(out: &mut String, c: &ConnStats) {
    let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let families: [(&str, &str, &AtomicU64); 8] = [
        (
            "tributary_hub_connections_superseded_total",
            "Connections closed with SUPERSEDED because a newer connection of the same device took their place.",
            &c.superseded,
        ),
        (
            "tributary_hub_connections_hello_timeout_total",
            "Connections closed with HELLO_TIMEOUT: no control stream or Hello within ingest.hello_timeout.",
            &c.hello_timeouts,
        ),
        (
            "tributary_hub_sessions_idle_timeout_total",
            "Sessions closed with IDLE_TIMEOUT: a control or data stream made no progress within ingest.control_idle_timeout.",
            &c.idle_timeouts,
        ),
        (
            "tributary_hub_connections_refused_total",
            "Connections refused with LIMIT_EXCEEDED at the hub's connection capacity.",
            &c.refused,
        ),
        (
            "tributary_hub_blocks_in_flight_limited_total",
            "Times a connection stopped taking data streams at ingest.blocks_in_flight_max.",
            &c.blocks_in_flight_limited,
        ),
        (
            "tributary_hub_data_memory_waits_total",
            "Data streams that waited for the ingest memory budget before their bytes were read.",
            &c.memory_waits,
        ),
        (
            "tributary_hub_quic_retries_total",
            "QUIC Retry packets sent to validate client addresses under handshake load.",
            &c.retries,
        ),
        (
            "tributary_hub_ingest_windows_reduced_total",
            "Connections admitted with less than the full QUIC receive window because the ingest budget was short.",
            &c.windows_reduced,
        ),
    ];
    for (name, help, v) in families {
        counter(out, name, help, load(v));
    }
    ended_metrics(out, c);
    gauge(
        out,
        "tributary_hub_quic_handshakes_in_progress",
        "QUIC handshakes in progress now.",
        load(&c.handshakes),
    );
    gauge(
        out,
        "tributary_hub_ingest_window_reserved_bytes",
        "QUIC receive windows of live connections, reserved from ingest.memory_bytes_max.",
        load(&c.window_reserved_bytes),
    );
}
