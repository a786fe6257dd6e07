//! Wire-frame tests: round trips, truncation, size limits, version negotiation, and the
//! checked-in protocol version 1 fixtures.
//!
//! The fixtures under `tests/fixtures/protocol/v1/` are one file per frame type, written by
//! `TRIBUTARY_WRITE_FIXTURES=1 cargo test -p tributary-sync --test protocol_frames` and never
//! rewritten once released: a newer build must keep decoding them, which is how an old agent
//! and a new hub are tested together.

use std::path::PathBuf;
use sync::block::{self, VERSION_ROWS};
use sync::protocol::frame::{
    self, BacklogEntry, ErrorFrame, FrameBuffer, Hello, LaneWelcome, StreamRefused, Welcome,
    frame_len, hello_versions,
};
use sync::protocol::{
    Backlog, ErrorCode, Frame, FrameError, GapMarker, GapReason, Instant, LaneAnnounce, Marks,
    Receiver, ReceiverConfig, ReceiverEvent, Sender, SenderConfig, SenderEvent,
};
use sync::{Record, Value};

fn records() -> Vec<Record> {
    (0..3)
        .map(|i| Record {
            tags: Vec::new(),
            key: format!("truck-0042/engine{i}"),
            ts: 1_764_374_400_000_000_000 + i,
            fields: vec![
                ("temp_c".into(), Value::F64(71.25)),
                ("rpm".into(), Value::I64(1800 + i)),
            ],
        })
        .collect()
}

fn lane() -> LaneAnnounce {
    LaneAnnounce {
        stream: "telemetry".into(),
        epoch: 7,
        first_seq: 1,
        last_seq: 120,
        acked_seq: 100,
        backlog: Backlog {
            blocks: 3,
            bytes: 4096,
            oldest_unsent_ts: Some(1_764_374_400_000_000_000),
        },
        gaps: vec![GapMarker {
            first_seq: 10,
            last_seq: 19,
            reason: GapReason::DiskFull,
            count: 10,
        }],
    }
}

/// One sample of every version-1 frame type, named as its fixture file.
fn samples() -> Vec<(&'static str, Frame)> {
    let block = block::encode_block(VERSION_ROWS, 7, 101, &records()).unwrap();
    vec![
        (
            "hello",
            Frame::Hello(Hello {
                version_min: 1,
                version_max: 1,
                current_epoch: 7,
                lanes: vec![lane()],
                capabilities: 0,
            }),
        ),
        (
            "welcome",
            Frame::Welcome(Welcome {
                version: 1,
                window_bytes: 32 << 20,
                window_items: 4096,
                epoch_max: 7,
                lanes: vec![(
                    "telemetry".into(),
                    7,
                    LaneWelcome {
                        durable_seq: 100,
                        tiered_seq: 90,
                        resume_from: 95,
                    },
                )],
            }),
        ),
        (
            "block",
            Frame::Block {
                stream: "telemetry".into(),
                block,
            },
        ),
        (
            "gap",
            Frame::Gap {
                stream: "telemetry".into(),
                epoch: 7,
                gap: GapMarker {
                    first_seq: 121,
                    last_seq: 130,
                    reason: GapReason::Corrupt,
                    count: 10,
                },
            },
        ),
        (
            "ack",
            Frame::Ack {
                stream: "telemetry".into(),
                epoch: 7,
                durable_seq: 104,
                tiered_seq: 90,
            },
        ),
        (
            "backlog",
            Frame::Backlog(vec![
                BacklogEntry {
                    stream: "telemetry".into(),
                    epoch: 7,
                    backlog: lane().backlog,
                },
                BacklogEntry {
                    stream: "status".into(),
                    epoch: 7,
                    backlog: Backlog::default(),
                },
            ]),
        ),
        ("ping", Frame::Ping),
        (
            "verdict",
            Frame::Verdict {
                stream: "telemetry".into(),
                epoch: 6,
                matched_through: 55,
            },
        ),
        (
            "error",
            Frame::Error(ErrorFrame {
                code: ErrorCode::ConflictFenced,
                message: "seqs 1..=4 differ".into(),
            }),
        ),
        (
            "stream_refused",
            Frame::StreamRefused(StreamRefused {
                stream: "telemetry".into(),
                epoch: 7,
                code: ErrorCode::UnauthorizedStream,
                retry_after_ms: 30_000,
                message: "device may not write stream `telemetry`".into(),
            }),
        ),
    ]
}

const MAX: u32 = frame::FRAME_BYTES_MAX_DEFAULT;

#[test]
fn every_frame_round_trips() {
    for (name, f) in samples() {
        let bytes = f.encode();
        assert_eq!(Frame::decode(&bytes, MAX).unwrap(), f, "{name}");
        assert_eq!(
            frame_len(&bytes, MAX).unwrap(),
            bytes.len() - frame::LEN_PREFIX,
            "{name}"
        );
    }
}

#[test]
fn every_truncation_errors_cleanly() {
    for (name, f) in samples() {
        let bytes = f.encode();
        for n in 0..bytes.len() {
            // Length prefix intact, bytes missing: always an error.
            assert!(
                Frame::decode(&bytes[..n], MAX).is_err(),
                "{name} cut at {n}"
            );
            // Length prefix rewritten to match: the payload itself is short.
            if n <= frame::LEN_PREFIX {
                continue;
            }
            let mut cut = bytes[..n].to_vec();
            let len = (n - frame::LEN_PREFIX) as u32;
            cut[..4].copy_from_slice(&len.to_le_bytes());
            match (Frame::decode(&cut, MAX), &f) {
                // A Block's payload ends with the block: a short one is caught by its checksum.
                (Ok(Frame::Block { block, .. }), Frame::Block { .. }) => {
                    assert!(
                        block::verify_block(&block, &Default::default()).is_err(),
                        "{name} cut at {n}"
                    );
                }
                (Ok(other), _) => panic!("{name} cut at {n} decoded as {other:?}"),
                (Err(_), _) => {}
            }
        }
    }
}

#[test]
fn oversize_frame_is_rejected_from_its_prefix() {
    let prefix = (MAX + 1).to_le_bytes();
    assert!(matches!(
        frame_len(&prefix, MAX),
        Err(FrameError::TooLarge { .. })
    ));
    assert!(matches!(
        frame_len(&0u32.to_le_bytes(), MAX),
        Err(FrameError::Empty)
    ));
    // The stream splitter refuses after 4 bytes, without buffering what the prefix announced.
    let mut buf = FrameBuffer::new(1024);
    buf.push(&u32::MAX.to_le_bytes());
    assert!(matches!(buf.next_frame(), Err(FrameError::TooLarge { .. })));
    assert_eq!(buf.buffered(), 4);
}

#[test]
fn frame_buffer_splits_a_stream() {
    let frames: Vec<Vec<u8>> = samples().into_iter().map(|(_, f)| f.encode()).collect();
    let stream: Vec<u8> = frames.concat();
    let mut buf = FrameBuffer::new(MAX);
    let mut out = Vec::new();
    for chunk in stream.chunks(7) {
        buf.push(chunk);
        while let Some(f) = buf.next_frame().unwrap() {
            out.push(f);
        }
    }
    assert_eq!(out, frames);
}

#[test]
fn junk_never_panics() {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for _ in 0..20_000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let len = (x % 64) as usize;
        let mut bytes: Vec<u8> = (0..len).map(|i| (x >> (i % 8 * 8)) as u8).collect();
        if bytes.len() >= 5 {
            let l = (bytes.len() - 4) as u32;
            bytes[..4].copy_from_slice(&l.to_le_bytes());
            bytes[4] = (x % 11) as u8;
        }
        let _ = Frame::decode(&bytes, MAX);
    }
}

fn fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/protocol/v1")
}

#[test]
fn version_1_fixtures_still_decode() {
    let dir = fixtures_dir();
    if std::env::var("TRIBUTARY_WRITE_FIXTURES").is_ok_and(|v| v == "1") {
        std::fs::create_dir_all(&dir).unwrap();
        for (name, f) in samples() {
            std::fs::write(dir.join(format!("{name}.bin")), f.encode()).unwrap();
        }
    }
    for (name, expected) in samples() {
        let path = dir.join(format!("{name}.bin"));
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let got = Frame::decode(&bytes, MAX).unwrap_or_else(|e| panic!("{name}: {e}"));
        match (&got, &expected) {
            // zstd output may change between library versions; the records may not.
            (
                Frame::Block {
                    stream: a,
                    block: x,
                },
                Frame::Block {
                    stream: b,
                    block: y,
                },
            ) => {
                assert_eq!(a, b);
                let (x, y) = (
                    block::decode_block(x, &Default::default()).unwrap(),
                    block::decode_block(y, &Default::default()).unwrap(),
                );
                assert_eq!(x.records, y.records);
                assert_eq!(
                    (x.header.epoch, x.header.first_seq, x.header.count),
                    (y.header.epoch, y.header.first_seq, y.header.count)
                );
            }
            _ => assert_eq!(got, expected, "{name}"),
        }
        assert_eq!(got.encode(), bytes, "{name}: re-encoding changed the bytes");
    }
}

#[test]
fn unsupported_version_is_refused_with_its_code() {
    let now = Instant::ZERO;
    let mut rx = Receiver::new("dev".into(), ReceiverConfig::default(), now);
    let hello = Hello {
        version_min: 2,
        version_max: 3,
        current_epoch: 1,
        lanes: vec![],
        capabilities: 0,
    };
    rx.handle_frame(now, &Frame::Hello(hello).encode());
    let t = rx.poll_transmit().expect("error frame");
    let Frame::Error(e) = Frame::decode(&t.frame, MAX).unwrap() else {
        panic!("not an Error frame")
    };
    assert_eq!(e.code, ErrorCode::UnsupportedVersion);
    assert!(rx.is_closed());
    assert!(
        matches!(rx.poll_event(), Some(ReceiverEvent::Closed(r)) if r.code == ErrorCode::UnsupportedVersion)
    );
}

#[test]
fn future_hello_with_unknown_body_is_still_refused_by_version() {
    let mut bytes = vec![0u8; 4];
    bytes.push(frame::frame_type::HELLO);
    bytes.extend_from_slice(&frame::HELLO_MAGIC);
    bytes.extend_from_slice(&5u16.to_le_bytes());
    bytes.extend_from_slice(&9u16.to_le_bytes());
    bytes.extend_from_slice(&[0xff; 3]);
    let len = (bytes.len() - 4) as u32;
    bytes[..4].copy_from_slice(&len.to_le_bytes());
    assert_eq!(hello_versions(&bytes), Some((5, 9)));
    let mut rx = Receiver::new("dev".into(), ReceiverConfig::default(), Instant::ZERO);
    rx.handle_frame(Instant::ZERO, &bytes);
    let Frame::Error(e) = Frame::decode(&rx.poll_transmit().unwrap().frame, MAX).unwrap() else {
        panic!()
    };
    assert_eq!(e.code, ErrorCode::UnsupportedVersion);
}

#[test]
fn oversize_frame_closes_the_connection() {
    let config = ReceiverConfig {
        frame_bytes_max: 64,
        ..ReceiverConfig::default()
    };
    let mut rx = Receiver::new("dev".into(), config, Instant::ZERO);
    let big = Frame::Block {
        stream: "telemetry".into(),
        block: vec![0; 100],
    }
    .encode();
    rx.handle_frame(Instant::ZERO, &big);
    let Frame::Error(e) = Frame::decode(&rx.poll_transmit().unwrap().frame, MAX).unwrap() else {
        panic!()
    };
    assert_eq!(e.code, ErrorCode::FrameTooLarge);
    assert!(rx.is_closed());
}

#[test]
fn handshake_then_block_commit_then_ack() {
    let t0 = Instant::from_nanos(1);
    let block = block::encode_block(VERSION_ROWS, 7, 1, &records()).unwrap();
    let announce = LaneAnnounce {
        first_seq: 1,
        last_seq: 3,
        acked_seq: 0,
        gaps: vec![],
        ..lane()
    };
    let mut tx = Sender::new(SenderConfig::default(), 7, vec![announce], t0).unwrap();
    let mut rx = Receiver::new("dev".into(), ReceiverConfig::default(), t0);
    rx.handle_frame(t0, &tx.poll_transmit().unwrap().frame);
    assert!(matches!(
        rx.poll_event(),
        Some(ReceiverEvent::NeedMarks {
            current_epoch: 7,
            ..
        })
    ));
    rx.marks_loaded(t0, Marks::default());
    assert!(matches!(
        rx.poll_event(),
        Some(ReceiverEvent::Established { version: 1, .. })
    ));
    tx.handle_frame(t0, &rx.poll_transmit().unwrap().frame);
    assert!(matches!(
        tx.poll_event(),
        Some(SenderEvent::Established { version: 1, .. })
    ));
    let Some(SenderEvent::WantBlocks { after_seq: 0, .. }) = tx.poll_event() else {
        panic!("no WantBlocks")
    };
    tx.supply_blocks(t0, "telemetry", 7, vec![block.clone()])
        .unwrap();
    rx.handle_frame(t0, &tx.poll_transmit().unwrap().frame);
    let Some(ReceiverEvent::Commit { item, .. }) = rx.poll_event() else {
        panic!("no Commit")
    };
    assert_eq!(item.last_seq(), 3);
    assert!(
        rx.poll_transmit().is_none(),
        "no Ack before the driver reports durability"
    );
    rx.committed(t0, "telemetry", 7, 3, 0);
    tx.handle_frame(t0, &rx.poll_transmit().unwrap().frame);
    assert!(matches!(
        tx.poll_event(),
        Some(SenderEvent::Acked {
            durable_seq: 3,
            tiered_seq: 0,
            ..
        })
    ));
    assert_eq!(tx.inflight_bytes(), 0);
    // A tiered-only update later.
    rx.update_tiered(t0, "telemetry", 7, 3);
    tx.handle_frame(t0, &rx.poll_transmit().unwrap().frame);
    assert!(matches!(
        tx.poll_event(),
        Some(SenderEvent::Acked {
            durable_seq: 3,
            tiered_seq: 3,
            ..
        })
    ));
}
