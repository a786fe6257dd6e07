//! What a peer can make the hub's receiver see at the edges of its bookkeeping, and that each
//! becomes a protocol error with a documented code rather than a panic or a wrapped integer:
//!
//! - a durable mark past this session's frontier (another session of the same device identity
//!   committed further: a clone, or the previous connection's commits landing late);
//! - Gap and Block frames, and Hello lanes, reaching past `SEQ_MAX`, where `seq + 1` would wrap
//!   and the hub catalog's signed integers would not hold the mark.

use sync::block::{self, VERSION_ROWS};
use sync::protocol::frame::Hello;
use sync::protocol::receiver::SEQ_MAX;
use sync::protocol::{
    Backlog, ErrorCode, Frame, GapMarker, GapReason, Instant, LaneAnnounce, Marks, Receiver,
    ReceiverConfig, ReceiverEvent,
};
use sync::{Record, Value};

const STREAM: &str = "telemetry";
const EPOCH: u64 = 3;

fn records(n: usize) -> Vec<Record> {
    (0..n)
        .map(|i| Record {
            tags: Vec::new(),
            key: "truck-7/engine".into(),
            ts: 1_764_374_400_000_000_000 + i as i64,
            fields: vec![("rpm".into(), Value::I64(1800 + i as i64))],
        })
        .collect()
}

fn announce(last_seq: u64) -> LaneAnnounce {
    LaneAnnounce {
        stream: STREAM.into(),
        epoch: EPOCH,
        first_seq: 1,
        last_seq,
        acked_seq: 0,
        backlog: Backlog::default(),
        gaps: Vec::new(),
    }
}

fn hello(lane: LaneAnnounce) -> Vec<u8> {
    Frame::Hello(Hello {
        version_min: 1,
        version_max: 1,
        current_epoch: EPOCH,
        lanes: vec![lane],
        capabilities: 0,
    })
    .encode()
}

/// A receiver with one established lane the hub holds nothing of.
fn established(t: Instant) -> Receiver {
    let mut rx = Receiver::new("truck-7".into(), ReceiverConfig::default(), t);
    rx.handle_frame(t, &hello(announce(10)));
    assert!(matches!(
        rx.poll_event(),
        Some(ReceiverEvent::NeedMarks { .. })
    ));
    rx.marks_loaded(t, Marks::default());
    assert!(matches!(
        rx.poll_event(),
        Some(ReceiverEvent::Established { .. })
    ));
    while rx.poll_transmit().is_some() {}
    rx
}

/// The reason of the session's close, if it closed.
fn closed(rx: &mut Receiver) -> Option<(ErrorCode, String)> {
    while let Some(ev) = rx.poll_event() {
        if let ReceiverEvent::Closed(r) = ev {
            assert!(!r.by_peer);
            return Some((r.code, r.message));
        }
    }
    None
}

/// The code the peer is told, from the Error frame the receiver queued.
fn error_frame(rx: &mut Receiver) -> Option<ErrorCode> {
    while let Some(t) = rx.poll_transmit() {
        if let Ok(Frame::Error(e)) = Frame::decode(&t.frame, 1 << 20) {
            return Some(e.code);
        }
    }
    None
}

fn gap_frame(first_seq: u64, last_seq: u64) -> Vec<u8> {
    Frame::Gap {
        stream: STREAM.into(),
        epoch: EPOCH,
        gap: GapMarker {
            first_seq,
            last_seq,
            reason: GapReason::Missing,
            count: 1,
        },
    }
    .encode()
}

#[test]
fn a_mark_past_the_frontier_closes_the_session_instead_of_panicking() {
    let t = Instant::from_nanos(1);
    let mut rx = established(t);
    let block = block::encode_block(VERSION_ROWS, EPOCH, 1, &records(4)).unwrap();
    let frame = Frame::Block {
        stream: STREAM.into(),
        block,
    };
    rx.handle_frame(t, &frame.encode());
    let Some(ReceiverEvent::Commit { item, .. }) = rx.poll_event() else {
        panic!("no Commit for the block");
    };
    assert_eq!(item.last_seq(), 4);
    // Another session of the same device committed through 9 meanwhile; the driver reports
    // the lane's mark, which is past the 4 this session handed out.
    rx.committed(t, STREAM, EPOCH, 9, 0);
    let (code, message) = closed(&mut rx).expect("the session is closed");
    assert_eq!(code, ErrorCode::ProtocolViolation);
    assert!(message.contains("another session"), "{message}");
    assert_eq!(error_frame(&mut rx), Some(ErrorCode::ProtocolViolation));
    assert!(rx.is_closed());
    // A mark within the frontier is the normal case and acknowledges.
    let mut rx = established(t);
    let block = block::encode_block(VERSION_ROWS, EPOCH, 1, &records(4)).unwrap();
    rx.handle_frame(
        t,
        &Frame::Block {
            stream: STREAM.into(),
            block,
        }
        .encode(),
    );
    assert!(matches!(
        rx.poll_event(),
        Some(ReceiverEvent::Commit { .. })
    ));
    rx.committed(t, STREAM, EPOCH, 4, 0);
    assert!(closed(&mut rx).is_none());
    let ack = Frame::decode(&rx.poll_transmit().expect("an Ack").frame, 1 << 20).unwrap();
    assert!(matches!(ack, Frame::Ack { durable_seq: 4, .. }), "{ack:?}");
}

#[test]
fn a_gap_to_u64_max_is_a_protocol_error() {
    let t = Instant::from_nanos(1);
    for last in [u64::MAX, SEQ_MAX + 1] {
        let mut rx = established(t);
        rx.handle_frame(t, &gap_frame(1, last));
        let (code, message) = closed(&mut rx).expect("the session is closed");
        assert_eq!(code, ErrorCode::ProtocolViolation, "gap to {last}");
        assert!(message.contains("past"), "{message}");
        assert_eq!(error_frame(&mut rx), Some(ErrorCode::ProtocolViolation));
    }
    // Up to SEQ_MAX is committed, and the lane still takes the next item without wrapping.
    let mut rx = established(t);
    rx.handle_frame(t, &gap_frame(1, SEQ_MAX));
    let Some(ReceiverEvent::Commit { item, .. }) = rx.poll_event() else {
        panic!("no Commit for the gap");
    };
    assert_eq!(item.last_seq(), SEQ_MAX);
    rx.handle_frame(t, &gap_frame(1, 5));
    assert!(
        closed(&mut rx).is_none(),
        "a replayed gap below the frontier is fine"
    );
}

#[test]
fn a_block_ending_at_u64_max_is_a_protocol_error() {
    let t = Instant::from_nanos(1);
    let mut rx = established(t);
    let block = block::encode_block(VERSION_ROWS, EPOCH, u64::MAX - 1, &records(2)).unwrap();
    let frame = Frame::Block {
        stream: STREAM.into(),
        block,
    };
    rx.handle_frame(t, &frame.encode());
    let (code, _) = closed(&mut rx).expect("the session is closed");
    assert_eq!(code, ErrorCode::ProtocolViolation);
}

#[test]
fn a_hello_announcing_seqs_past_the_bound_is_refused() {
    let t = Instant::from_nanos(1);
    let mut rx = Receiver::new("truck-7".into(), ReceiverConfig::default(), t);
    rx.handle_frame(t, &hello(announce(u64::MAX)));
    let (code, _) = closed(&mut rx).expect("the session is closed");
    assert_eq!(code, ErrorCode::ProtocolViolation);
}
