//! Replays the committed corpora of the replication protocol's cargo-fuzz targets
//! (`sync/fuzz/corpus/{frame_decode,frame_buffer,receiver_machine,sender_machine}/`) on stable
//! Rust, through the same functions the targets call (`sync/fuzz/bodies.rs`, compiled here by
//! path). A crash `cargo fuzz` finds is fixed, then its input goes into the target's corpus,
//! where this test keeps it fixed. See docs/fuzzing.md.
//!
//! `TRIBUTARY_WRITE_FIXTURES=1` (re)writes the hand-made seeds (`seed-*`): every v1 frame
//! fixture, frame streams, and short programs for the state-machine targets that complete a
//! handshake and move data (the op encoding is described in `bodies.rs`). Without it, the test
//! checks that they are all present (seeds are inputs, not golden outputs).

#[path = "../fuzz/bodies.rs"]
mod bodies;
#[path = "../fuzz/replay.rs"]
mod replay;

use std::path::PathBuf;

use replay::Target;

const TARGETS: [(&str, Target); 4] = [
    ("frame_decode", bodies::frame_decode),
    ("frame_buffer", bodies::frame_buffer),
    ("receiver_machine", bodies::receiver_machine),
    ("sender_machine", bodies::sender_machine),
];

const FRAMES: [&str; 10] = [
    "hello",
    "welcome",
    "block",
    "gap",
    "ack",
    "backlog",
    "ping",
    "verdict",
    "error",
    "stream_refused",
];

fn fixture(name: &str) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/protocol/v1")
        .join(format!("{name}.bin"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

// Op codes of the machine targets (`op % 9` in bodies.rs).
const RX_BLOCK: u8 = 2;
const RX_GAP: u8 = 4;
const RX_HELLO: u8 = 5;
const TIMEOUT_RX: u8 = 6;
const RX_DRIVER: u8 = 7;
const TX_WELCOME: u8 = 2;
const TX_ACK: u8 = 3;
const TX_VERDICT: u8 = 4;
const TX_TIMEOUT: u8 = 5;
const TX_DRIVER: u8 = 6;

/// A hub session: Hello for telemetry/1 holding 1..=10, marks answered, three blocks, a
/// group commit, a gap marker, keepalive time, another commit.
fn receiver_session() -> Vec<u8> {
    let mut p = vec![0, 0]; // mark seed, epoch_max
    // Hello: version 1..=1, current epoch 1, one lane: telemetry/1, 1..=11, acked 0,
    // backlog (0, 0, none), no gaps.
    p.extend([RX_HELLO, 3, 1, 1, 0, 1, 1, 10, 0, 0, 0, 0, 0]);
    p.extend([RX_DRIVER, 0]); // answer the marks query
    for first in [1, 4, 7] {
        p.extend([RX_BLOCK, 0, 1, first, 2, 0]); // telemetry/1, 3 records from `first`
    }
    p.extend([RX_DRIVER, 1, 0, 0, 0]); // group commit
    p.extend([RX_GAP, 0, 1, 10, 1, 1, 2]); // gap 10..=11, disk full, 2 records
    p.extend([TIMEOUT_RX, 44]); // 11 s: a keepalive Ping
    p.extend([RX_BLOCK, 0, 1, 12, 0, 0x40]); // decoded by the driver
    p.extend([RX_DRIVER, 2, 1, 1]);
    p
}

/// The same session with blocks out of order, one corrupted, and a second lane.
fn receiver_reorder() -> Vec<u8> {
    let mut p = vec![3, 5];
    p.extend([
        RX_HELLO, 3, 2, 2, 0, 1, 1, 20, 0, 0, 0, 0, 0, 1, 2, 1, 5, 0, 0, 0, 0, 0,
    ]);
    p.extend([RX_DRIVER, 0]);
    p.extend([RX_BLOCK, 0, 1, 7, 2, 0]);
    p.extend([RX_BLOCK, 1, 2, 1, 1, 0]);
    p.extend([RX_BLOCK, 0, 1, 1, 5, 0]);
    p.extend([RX_BLOCK, 0, 1, 4, 2, 0x85, 30, 0]); // a flipped bit: BAD_BLOCK
    p.extend([RX_DRIVER, 1, 0, 0, 0, 0]);
    p
}

/// An edge session: one lane telemetry/1 holding 1..=9, the hub at 3, blocks served, acks,
/// a new block sealed, keepalive time.
fn sender_session() -> Vec<u8> {
    // Epoch 1; one lane: telemetry, epoch 1, first 1, 9 held, acked 0.
    let mut p = vec![0, 1, 0, 0, 1, 9, 0];
    // Welcome: version 1, window 40*256 bytes, 8 items, epoch_max 1; the lane at durable 3,
    // tiered 3, resume 4; no extra lane.
    p.extend([TX_WELCOME, 2, 40, 8, 1, 1, 3, 0, 0, 1]);
    p.extend([TX_DRIVER, 0, TX_DRIVER, 0]); // serve the block requests
    p.extend([TX_ACK, 0, 3, 0]); // ack 6
    p.extend([TX_DRIVER, 2, 0, 1]); // seal telemetry/1 10..=11 and offer it
    p.extend([TX_DRIVER, 0]);
    p.extend([TX_ACK, 0, 0, 2]);
    p.extend([TX_TIMEOUT, 44]);
    p
}

/// An edge whose hub is ahead (a restored data directory): Verdict, MintEpoch, rekey.
fn sender_behind() -> Vec<u8> {
    let mut p = vec![0, 1, 0, 0, 1, 9, 0];
    p.extend([TX_WELCOME, 2, 40, 8, 1, 1, 20, 0, 0, 1]);
    p.extend([TX_DRIVER, 0]);
    p.extend([TX_VERDICT, 0, 4]); // matched through 5
    p.extend([TX_DRIVER, 0, TX_DRIVER, 0]);
    p.extend([TX_DRIVER, 3, 1, 0]); // a gap marker in the new epoch
    p
}

fn seeds() -> Vec<(&'static str, String, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stream = vec![7u8];
    for name in FRAMES {
        let f = fixture(name);
        // frame_decode takes whole frames, and also type + payload (it adds the prefix).
        out.push(("frame_decode", format!("seed-{name}.bin"), f.clone()));
        stream.extend_from_slice(&f);
    }
    out.push((
        "frame_decode",
        "seed-hello-payload.bin".into(),
        fixture("hello")[4..].to_vec(),
    ));
    out.push((
        "frame_buffer",
        "seed-every-frame.bin".into(),
        stream.clone(),
    ));
    let mut oversized = vec![0u8];
    oversized.extend_from_slice(&fixture("ping"));
    oversized.extend_from_slice(&[0xff, 0xff, 0, 0, 1]);
    out.push(("frame_buffer", "seed-oversized.bin".into(), oversized));
    let mut torn = stream.clone();
    torn.truncate(stream.len() - 3);
    torn[0] = 200;
    out.push(("frame_buffer", "seed-torn.bin".into(), torn));
    out.push((
        "receiver_machine",
        "seed-session.bin".into(),
        receiver_session(),
    ));
    out.push((
        "receiver_machine",
        "seed-reorder.bin".into(),
        receiver_reorder(),
    ));
    let mut frames = vec![0, 0, 0];
    for name in ["hello", "block", "gap", "ack", "ping", "error"] {
        let f = fixture(name);
        frames.extend([0, f.len() as u8, 0]);
        frames.extend_from_slice(&f);
    }
    out.push(("receiver_machine", "seed-raw-frames.bin".into(), frames));
    out.push((
        "sender_machine",
        "seed-session.bin".into(),
        sender_session(),
    ));
    out.push(("sender_machine", "seed-behind.bin".into(), sender_behind()));
    let welcome = fixture("welcome");
    let mut raw = vec![0, 1, 0, 0, 1, 9, 0, 0, welcome.len() as u8, 0];
    raw.extend_from_slice(&welcome);
    out.push(("sender_machine", "seed-raw-welcome.bin".into(), raw));
    out
}

#[test]
fn every_corpus_file_passes_its_target() {
    replay::replay(env!("CARGO_MANIFEST_DIR"), &TARGETS);
}

#[test]
fn seeds_are_on_disk() {
    replay::seeds_on_disk(env!("CARGO_MANIFEST_DIR"), seeds());
}
