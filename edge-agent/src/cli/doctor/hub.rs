//! The hub check: a session the hub accepted, not only a finished TLS handshake.
//!
//! Under TLS 1.3 the client's handshake completes before the server has judged the client's
//! certificate, so a revoked certificate, or one from another CA, "connects"; the hub's verdict
//! arrives a moment later as a CONNECTION_CLOSE carrying the TLS alert. The check therefore
//! opens the control stream, sends a Hello that announces no lanes, and waits for the hub's
//! answer: a Welcome (accepted), an Error frame, or the connection's close, whose code names
//! the reason. It then closes with `SHUTDOWN`; a Hello without lanes leaves the hub's marks and
//! the device's backlog as they were.
//!
//! `TRIBUTARY_DOCTOR_HANDSHAKE_ONLY` (read only by builds with the `fault-injection` feature)
//! brings back the handshake-only check, for the mutation check in `tests/tests/doctor.rs`.

use std::net::SocketAddr;
use std::time::{Duration, Instant as StdInstant};

use edge_agent::link::{self, TlsPaths};
use sync::protocol::{ErrorCode, FrameBuffer, Instant, Sender, SenderConfig, SenderEvent};

/// TLS alerts (RFC 8446, section 6) the hub's certificate check sends; QUIC carries them as
/// `CRYPTO_ERROR` 0x100 + alert.
const ALERT_BAD_CERTIFICATE: u64 = 42;
const ALERT_CERTIFICATE_REVOKED: u64 = 44;
const ALERT_CERTIFICATE_EXPIRED: u64 = 45;
const ALERT_CERTIFICATE_UNKNOWN: u64 = 46;
const ALERT_UNKNOWN_CA: u64 = 48;
/// What rustls sends when a CA of the same name but another key signed the certificate.
const ALERT_DECRYPT_ERROR: u64 = 51;

const FIX_REVOKED: &str = "the hub revoked this certificate: issue a new one on the hub (`core-hub pki issue --dir PKI --device ID --out DIR`) and point [tls] at it";
const FIX_CA: &str = "the device certificate must come from the hub's fleet CA: issue it with `core-hub pki issue --dir PKI` on the hub and set tls.ca, tls.cert and tls.key to the files it writes";
const FIX_EXPIRED: &str =
    "re-issue the certificate (`core-hub pki issue`), and check the hub's clock";
const FIX_FENCED: &str = "the hub fenced this device after conflicting data: an operator must clear the fence on the hub (docs/operations.md)";
const FIX_NETWORK: &str = "check hub.addr and the network path (UDP must pass), and that hub.server_name matches the hub certificate";
const FIX_OTHER: &str = "see the hub's log for this device";

/// What the hub said about this device.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    /// The hub answered the Hello with a Welcome.
    Accepted { version: u16 },
    /// The hub accepted the device but cannot take data now (storage full).
    Busy { reason: String },
    /// The hub refused the device: why, and what to do about it.
    Refused { reason: String, fix: &'static str },
    /// No verdict: the hub could not be reached or did not answer.
    Unreachable { reason: String, fix: &'static str },
}

/// Connects, says Hello and waits up to `wait` for each step's answer.
pub(super) async fn probe(
    addr: SocketAddr,
    server_name: &str,
    paths: &TlsPaths,
    wait: Duration,
) -> Verdict {
    let unreachable = |reason: String| Verdict::Unreachable {
        reason,
        fix: FIX_NETWORK,
    };
    let client = match link::client_config(paths) {
        Ok(c) => c,
        Err(e) => return unreachable(e.to_string()),
    };
    let endpoint = match link::client_endpoint("0.0.0.0:0".parse().expect("literal")) {
        Ok(e) => e,
        Err(e) => return unreachable(e.to_string()),
    };
    let connecting = match endpoint.connect_with(client, addr, server_name) {
        Ok(c) => c,
        Err(e) => return unreachable(e.to_string()),
    };
    let conn = match tokio::time::timeout(wait, connecting).await {
        Err(_) => return unreachable(format!("no answer from {addr} within {wait:?}")),
        Ok(Err(e)) => return classify(&e),
        Ok(Ok(conn)) => conn,
    };
    // Mutation check (test builds only): the old check, which took a finished TLS handshake
    // for acceptance.
    #[cfg(feature = "fault-injection")]
    if std::env::var_os("TRIBUTARY_DOCTOR_HANDSHAKE_ONLY").is_some() {
        conn.close(0u32.into(), b"doctor");
        return Verdict::Accepted { version: 0 };
    }
    let verdict = match tokio::time::timeout(wait, hello(&conn)).await {
        Ok(v) => v,
        Err(_) => unreachable(format!(
            "the TLS handshake completed but the hub gave no verdict on the Hello within {wait:?}"
        )),
    };
    conn.close(
        quinn::VarInt::from_u32(u32::from(ErrorCode::Shutdown.to_u16())),
        b"edge-agent doctor: check done",
    );
    // Let the close go out before the endpoint is dropped.
    let _ = tokio::time::timeout(Duration::from_millis(200), endpoint.wait_idle()).await;
    verdict
}

/// Sends the Hello and reads until the hub's verdict.
async fn hello(conn: &quinn::Connection) -> Verdict {
    let clock = StdInstant::now();
    let now = || Instant::from_nanos(clock.elapsed().as_nanos() as u64);
    let config = SenderConfig::default();
    let mut frames = FrameBuffer::new(config.frame_bytes_max);
    let mut sender = Sender::new(config, 0, Vec::new(), now()).expect("a Hello without lanes");
    let (mut tx, mut rx) = match conn.open_bi().await {
        Ok(s) => s,
        Err(e) => return classify(&e),
    };
    let mut buf = vec![0u8; 16 << 10];
    loop {
        while let Some(t) = sender.poll_transmit() {
            if tx.write_all(&t.frame).await.is_err() {
                return classify(&conn.closed().await);
            }
        }
        while let Some(event) = sender.poll_event() {
            match event {
                SenderEvent::Established { version, .. } => return Verdict::Accepted { version },
                SenderEvent::Closed(reason) => return refused(reason.code, &reason.message),
                _ => {}
            }
        }
        tokio::select! {
            read = rx.read(&mut buf) => match read {
                Ok(Some(n)) => {
                    frames.push(&buf[..n]);
                    loop {
                        match frames.next_frame() {
                            Ok(Some(f)) => sender.handle_frame(now(), &f),
                            Ok(None) => break,
                            Err(e) => return Verdict::Refused {
                                reason: format!("the hub sent a bad frame: {e}"),
                                fix: FIX_OTHER,
                            },
                        }
                    }
                }
                // The hub ended the stream: its verdict is the connection's close.
                Ok(None) | Err(_) => return classify(&conn.closed().await),
            },
            closed = conn.closed() => return classify(&closed),
        }
    }
}

/// The verdict a connection's end carries.
fn classify(e: &quinn::ConnectionError) -> Verdict {
    match e {
        quinn::ConnectionError::ConnectionClosed(c) => {
            let code = u64::from(c.error_code);
            if (0x100..0x200).contains(&code) {
                return with_detail(alert(code - 0x100), &c.reason);
            }
            Verdict::Unreachable {
                reason: format!("the hub closed the connection: {c}"),
                fix: FIX_NETWORK,
            }
        }
        quinn::ConnectionError::ApplicationClosed(a) => {
            let code = u16::try_from(a.error_code.into_inner()).unwrap_or(u16::MAX);
            refused(
                ErrorCode::from_u16(code),
                &String::from_utf8_lossy(&a.reason),
            )
        }
        // This side refused the hub's certificate during the handshake.
        quinn::ConnectionError::TransportError(t)
            if (0x100..0x200).contains(&u64::from(t.code)) =>
        {
            local_alert(&t.to_string())
        }
        quinn::ConnectionError::TimedOut => Verdict::Unreachable {
            reason: "no answer from the hub (timed out)".into(),
            fix: FIX_NETWORK,
        },
        other => Verdict::Unreachable {
            reason: other.to_string(),
            fix: FIX_NETWORK,
        },
    }
}

/// The verdict when this device refused the hub's certificate (`error` names rustls' reason).
fn local_alert(error: &str) -> Verdict {
    let (what, fix) = if error.contains("NotValidForName") {
        (
            "the hub's certificate does not name hub.server_name",
            "set hub.server_name to a name in the hub certificate (`pki init` writes localhost, 127.0.0.1 and each --san)",
        )
    } else if error.contains("Expired") || error.contains("NotValidYet") {
        (
            "the hub's certificate is expired or not yet valid",
            FIX_EXPIRED,
        )
    } else {
        (
            "this device does not trust the hub's certificate: it is not signed by tls.ca, so the device and the hub are from different fleet CAs",
            FIX_CA,
        )
    };
    Verdict::Refused {
        reason: format!("{what} ({error})"),
        fix,
    }
}

/// `verdict` with the hub's own words for it appended, when it sent some.
fn with_detail(verdict: Verdict, hub_text: &[u8]) -> Verdict {
    let text = String::from_utf8_lossy(hub_text);
    match verdict {
        Verdict::Refused { reason, fix } if !text.is_empty() => Verdict::Refused {
            reason: format!("{reason}: {text}"),
            fix,
        },
        v => v,
    }
}

/// The verdict of a TLS alert the hub sent about the device certificate.
fn alert(alert: u64) -> Verdict {
    let (reason, fix) = match alert {
        ALERT_CERTIFICATE_REVOKED => (
            "the hub refused the certificate: it is revoked",
            FIX_REVOKED,
        ),
        ALERT_UNKNOWN_CA | ALERT_DECRYPT_ERROR => (
            "the hub refused the certificate: it is not signed by the hub's fleet CA (unknown CA)",
            FIX_CA,
        ),
        ALERT_CERTIFICATE_EXPIRED => (
            "the hub refused the certificate: expired or not yet valid",
            FIX_EXPIRED,
        ),
        ALERT_BAD_CERTIFICATE | ALERT_CERTIFICATE_UNKNOWN => {
            ("the hub refused the certificate as invalid", FIX_CA)
        }
        _ => {
            return Verdict::Refused {
                reason: format!("the TLS handshake failed: TLS alert {alert}"),
                fix: FIX_CA,
            };
        }
    };
    Verdict::Refused {
        reason: format!("{reason} (TLS alert {alert})"),
        fix,
    }
}

/// The verdict of a protocol error code the hub closed with.
fn refused(code: ErrorCode, message: &str) -> Verdict {
    let reason = format!("the hub refused the session: {code:?}: {message}");
    match code {
        ErrorCode::Revoked => Verdict::Refused {
            reason,
            fix: FIX_REVOKED,
        },
        ErrorCode::DeviceFenced | ErrorCode::ConflictFenced => Verdict::Refused {
            reason,
            fix: FIX_FENCED,
        },
        ErrorCode::StorageFull => Verdict::Busy { reason },
        ErrorCode::LimitExceeded | ErrorCode::Superseded => Verdict::Busy { reason },
        _ => Verdict::Refused {
            reason,
            fix: FIX_OTHER,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alerts_name_their_cause() {
        let Verdict::Refused { reason, fix } = alert(ALERT_CERTIFICATE_REVOKED) else {
            panic!("revoked is a refusal");
        };
        assert!(reason.contains("revoked"), "{reason}");
        assert_eq!(fix, FIX_REVOKED);
        let Verdict::Refused { reason, fix } = alert(ALERT_UNKNOWN_CA) else {
            panic!("unknown CA is a refusal");
        };
        assert!(reason.contains("unknown CA"), "{reason}");
        assert_eq!(fix, FIX_CA);
        let Verdict::Refused { reason, .. } =
            with_detail(alert(ALERT_DECRYPT_ERROR), b"BadSignature")
        else {
            panic!("a bad signature is a refusal");
        };
        assert!(
            reason.contains("fleet CA") && reason.ends_with(": BadSignature"),
            "{reason}"
        );
        assert!(matches!(
            refused(ErrorCode::StorageFull, "disk full"),
            Verdict::Busy { .. }
        ));
        assert!(matches!(
            refused(ErrorCode::Revoked, "certificate revoked"),
            Verdict::Refused {
                fix: FIX_REVOKED,
                ..
            }
        ));
    }
}
