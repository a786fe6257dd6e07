//! Streams the hub refuses right now, as `/metrics` and the status show them.

use std::fmt::Write as _;
use std::sync::atomic::Ordering;
use std::time::Duration;

use sync::protocol::ErrorCode;

use super::LinkStatus;

/// One stream the hub refused: why, and when the agent offers it again.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct RefusedStream {
    pub stream: String,
    /// The hub's code, as the protocol spells it (`UNAUTHORIZED_STREAM`, `QUOTA_EXCEEDED`).
    pub code: String,
    /// The hub's message.
    pub reason: String,
    /// Unix ms of the next offer.
    pub next_retry_ms: u64,
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
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
        self.streams_refused.fetch_add(1, Ordering::Relaxed);
        let entry = RefusedStream {
            stream: stream.to_owned(),
            code: code_name(code),
            reason: message.to_owned(),
            next_retry_ms: now_ms().saturating_add(retry_after.as_millis() as u64),
        };
        tracing::warn!(
            %stream,
            code = %entry.code,
            reason = %message,
            retry_in = ?retry_after,
            "hub refused a stream; the other streams carry on, it is offered again after the retry time"
        );
        let mut refused = self.refused_now.lock().expect("refused streams lock");
        refused.insert(stream.to_owned(), entry);
    }

    /// The hub acknowledged `stream`: once past its retry time, it is no longer refused.
    pub(super) fn stream_shipping(&self, stream: &str) {
        let mut refused = self.refused_now.lock().expect("refused streams lock");
        if refused
            .get(stream)
            .is_some_and(|r| now_ms() >= r.next_retry_ms)
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
}
