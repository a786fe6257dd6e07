//! Streams the hub refuses right now, as `/metrics`, `/v1/status` and `edge-agent status` show
//! them: each until the hub acknowledges it again.

use std::fmt::Write as _;
use std::sync::atomic::Ordering;
use std::time::Duration;

use sync::protocol::ErrorCode;

use super::LinkStatus;
use crate::http::status::{RefusedReport, now_ms, rfc3339_ms};

/// One stream the hub refused: why, since when, and when the agent offers it again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefusedStream {
    pub stream: String,
    /// The hub's code, as the protocol spells it (`UNAUTHORIZED_STREAM`, `QUOTA_EXCEEDED`).
    pub code: String,
    /// The hub's message.
    pub reason: String,
    /// Unix ms of the first refusal since the stream last shipped (the hub repeats its
    /// refusal once per retry period; that keeps this).
    pub since_ms: u64,
    /// Unix ms of the next offer.
    pub next_retry_ms: u64,
    /// `sessions_established` when the hub last refused it: an ack in a later session is
    /// the hub taking the stream, whatever the retry time.
    session: u64,
}

impl RefusedStream {
    /// The status report's view at `now_ms`.
    pub fn detail(&self, now_ms: u64) -> RefusedReport {
        RefusedReport {
            stream: self.stream.clone(),
            code: self.code.clone(),
            message: self.reason.clone(),
            since: rfc3339_ms(self.since_ms),
            since_s: now_ms.saturating_sub(self.since_ms) as f64 / 1e3,
            next_retry: rfc3339_ms(self.next_retry_ms),
            next_retry_in_s: self.next_retry_ms.saturating_sub(now_ms) as f64 / 1e3,
        }
    }
}

/// `QuotaExceeded` as the protocol doc spells it: `QUOTA_EXCEEDED`.
fn code_name(code: ErrorCode) -> String {
    let mut out = String::new();
    for (i, c) in format!("{code:?}").chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_uppercase());
    }
    out
}

impl LinkStatus {
    /// The hub refused `stream`; counted once per refusal (the hub repeats one per retry
    /// period at most).
    pub(super) fn stream_refused(
        &self,
        stream: &str,
        code: ErrorCode,
        retry_after: Duration,
        message: &str,
    ) {
        self.stream_refused_at(stream, code, retry_after, message, now_ms());
    }

    fn stream_refused_at(
        &self,
        stream: &str,
        code: ErrorCode,
        retry_after: Duration,
        message: &str,
        now_ms: u64,
    ) {
        self.streams_refused.fetch_add(1, Ordering::Relaxed);
        let mut refused = self.refused_now.lock().expect("refused streams lock");
        let entry = RefusedStream {
            stream: stream.to_owned(),
            code: code_name(code),
            reason: message.to_owned(),
            since_ms: refused.get(stream).map_or(now_ms, |r| r.since_ms),
            next_retry_ms: now_ms.saturating_add(retry_after.as_millis() as u64),
            session: self.sessions_established.load(Ordering::Relaxed),
        };
        tracing::warn!(
            %stream,
            code = %entry.code,
            reason = %message,
            retry_in = ?retry_after,
            "hub refused a stream; the other streams carry on, it is offered again after the retry time"
        );
        refused.insert(stream.to_owned(), entry);
    }

    /// The hub acknowledged `stream`: once past its retry time, or in a later session than
    /// the refusal, it is no longer refused. (An ack in the refusal's session before the retry
    /// time is for blocks sent before the refusal.)
    pub(super) fn stream_shipping(&self, stream: &str) {
        self.stream_shipping_at(stream, now_ms());
    }

    fn stream_shipping_at(&self, stream: &str, now_ms: u64) {
        let session = self.sessions_established.load(Ordering::Relaxed);
        let mut refused = self.refused_now.lock().expect("refused streams lock");
        if refused
            .get(stream)
            .is_some_and(|r| now_ms >= r.next_retry_ms || session > r.session)
        {
            refused.remove(stream);
        }
    }

    /// The streams the hub refuses now, by name.
    pub fn refused_streams(&self) -> Vec<RefusedStream> {
        let refused = self.refused_now.lock().expect("refused streams lock");
        refused.values().cloned().collect()
    }
}

/// `tributary_edge_stream_refused{stream,code}`: 1 per refused stream, with the Unix time of
/// its next offer in `tributary_edge_stream_refused_retry_at_seconds`.
pub(super) fn render(out: &mut String, refused: &[RefusedStream]) {
    let name = "tributary_edge_stream_refused";
    let _ = writeln!(
        out,
        "# HELP {name} 1 for each stream the hub refuses now (label code: why).\n# TYPE {name} gauge"
    );
    for r in refused {
        let _ = writeln!(
            out,
            "{name}{{stream=\"{}\",code=\"{}\"}} 1",
            r.stream, r.code
        );
    }
    let name = "tributary_edge_stream_refused_retry_at_seconds";
    let _ = writeln!(
        out,
        "# HELP {name} Unix time at which a refused stream is offered to the hub again.\n# TYPE {name} gauge"
    );
    for r in refused {
        let _ = writeln!(
            out,
            "{name}{{stream=\"{}\"}} {}",
            r.stream,
            r.next_retry_ms / 1000
        );
    }
}

/// The capability bits the Hello announces. Test-only mutation switch (`fault-injection`
/// builds only): with `TRIBUTARY_TEST_EDGE_NO_STREAM_REFUSED=1` the agent announces none, as
/// an agent from before StreamRefused, so `tests/tests/stream_refusal.rs` can show that its
/// checks catch a hub that closes the session over a refused stream.
pub(super) fn capabilities(bits: u64) -> u64 {
    #[cfg(feature = "fault-injection")]
    {
        const ENV: &str = "TRIBUTARY_TEST_EDGE_NO_STREAM_REFUSED";
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let on = *ON.get_or_init(|| {
            let on = std::env::var_os(ENV).is_some_and(|v| v == "1");
            if on {
                tracing::error!(
                    "{ENV}=1: NO STREAMREFUSED CAPABILITY ANNOUNCED (test-only mutation switch)"
                );
            }
            on
        });
        if on {
            return 0;
        }
    }
    bits
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_stream_is_listed_until_it_ships_after_its_retry() {
        let s = LinkStatus::default();
        s.stream_refused(
            "secret",
            ErrorCode::UnauthorizedStream,
            Duration::ZERO,
            "no",
        );
        let r = s.refused_streams();
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].code, "UNAUTHORIZED_STREAM");
        let text = s.render();
        assert!(
            text.contains(
                "tributary_edge_stream_refused{stream=\"secret\",code=\"UNAUTHORIZED_STREAM\"} 1"
            ),
            "{text}"
        );
        s.stream_shipping("secret");
        assert!(s.refused_streams().is_empty());
        // Before the retry time an ack (of blocks sent before the refusal) changes nothing.
        s.stream_refused(
            "q",
            ErrorCode::QuotaExceeded,
            Duration::from_secs(60),
            "quota",
        );
        s.stream_shipping("q");
        assert_eq!(s.refused_streams()[0].code, "QUOTA_EXCEEDED");
    }

    #[test]
    fn a_repeated_refusal_keeps_its_since_and_a_later_session_clears_it() {
        let s = LinkStatus::default();
        let retry = Duration::from_secs(10);
        s.stream_refused_at("q", ErrorCode::QuotaExceeded, retry, "quota", 1_000);
        s.stream_refused_at("q", ErrorCode::QuotaExceeded, retry, "quota, again", 11_000);
        let d = s.refused_streams()[0].detail(12_500);
        assert_eq!(
            d,
            RefusedReport {
                stream: "q".into(),
                code: "QUOTA_EXCEEDED".into(),
                message: "quota, again".into(),
                since: "1970-01-01T00:00:01.000Z".into(),
                since_s: 11.5,
                next_retry: "1970-01-01T00:00:21.000Z".into(),
                next_retry_in_s: 8.5,
            }
        );
        // An ack of the same session before the retry time is for blocks sent before it.
        s.stream_shipping_at("q", 12_500);
        assert_eq!(s.refused_streams().len(), 1);
        // A new session's ack is the hub taking the stream, retry time or not.
        s.sessions_established.fetch_add(1, Ordering::Relaxed);
        s.stream_shipping_at("q", 13_000);
        assert!(s.refused_streams().is_empty());
        // Refused again later: a new since.
        s.stream_refused_at("q", ErrorCode::QuotaExceeded, retry, "quota", 50_000);
        assert_eq!(s.refused_streams()[0].since_ms, 50_000);
    }
}
