//! Fuzz target bodies for the replication protocol: the wire frame decoder, the stream
//! splitter in front of it, and the two sans-IO state machines fed arbitrary frame sequences.
//! (The block, segment and parser targets keep their bodies in `sync::fuzzing`.)
//!
//! This file is the `sync/fuzz` crate's library, so each cargo-fuzz target is a one-line
//! wrapper, and `sync/tests/fuzz_protocol_corpus.rs` compiles the very same file (by path) to
//! replay every committed corpus file on stable Rust. Each function must never panic on any
//! input, and asserts what must hold whatever the peer sends: decoded frames re-encode, the
//! machines only ever transmit valid frames, close at most once, and the hub never hands the
//! same seq of a lane to its log twice.
//!
//! The machine targets read their input as a program of operations (one op byte, then its
//! arguments) rather than raw frames only, so that mutations reach the states behind a
//! handshake: an op either feeds raw bytes, or builds a well-formed frame (Hello, Welcome, a
//! block that passes its checksums, ...) from a few argument bytes, or moves the virtual clock,
//! or answers the machine's requests as a driver would. Missing argument bytes read as zero.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use sync::block::{self, DecodeLimits, VERSION_ROWS};
use sync::protocol::frame::{
    self, ErrorFrame, Frame, FrameBuffer, FrameError, Hello, LEN_PREFIX, LaneWelcome,
    StreamRefused, Welcome,
};
use sync::protocol::{
    Backlog, BacklogEntry, CommitItem, DecodedBlock, ErrorCode, GapMarker, GapReason, Instant,
    LaneAnnounce, LaneMarks, Marks, MarksQuery, Receiver, ReceiverConfig, ReceiverEvent, Sender,
    SenderConfig, SenderEvent, Timeouts, TransmitKind,
};
use sync::{Record, Value};

/// The frame size limit the targets configure: small, so that `TooLarge` is reachable.
const FRAME_MAX: u32 = 1 << 16;
/// Stream names the generated frames use (all valid).
const STREAMS: [&str; 3] = ["telemetry", "status", "a.b-c_9"];

/// Arbitrary bytes as one frame (`Frame::decode`), as they are and behind a correct length
/// prefix. Decoded frames must re-encode to the same frame.
pub fn frame_decode(data: &[u8]) {
    check_frame(data);
    if !data.is_empty() && data.len() <= FRAME_MAX as usize {
        let mut framed = (data.len() as u32).to_le_bytes().to_vec();
        framed.extend_from_slice(data);
        check_frame(&framed);
    }
}

fn check_frame(bytes: &[u8]) {
    let versions = frame::hello_versions(bytes);
    match Frame::decode(bytes, FRAME_MAX) {
        Ok(f) => {
            if let Frame::Block { block, .. } = &f {
                // The block a frame carries obeys the decoded-size contract too.
                let _ = sync::fuzzing::decode_sized_with(block, &sync::fuzzing::fuzz_limits());
            }
            let encoded = f.encode();
            let again = Frame::decode(&encoded, u32::MAX).expect("an encoded frame decodes");
            match (&f, &again) {
                // Messages are decoded lossily (invalid UTF-8 grows) and cut on encode.
                (Frame::Error(a), Frame::Error(b)) => {
                    assert_eq!(a.code, b.code, "error codes round-trip");
                    assert!(a.message.starts_with(&b.message), "messages are only cut");
                }
                (Frame::StreamRefused(a), Frame::StreamRefused(b)) => {
                    assert_eq!((&a.stream, a.epoch, a.code), (&b.stream, b.epoch, b.code));
                    assert_eq!(a.retry_after_ms, b.retry_after_ms);
                    assert!(a.message.starts_with(&b.message), "messages are only cut");
                }
                _ => assert_eq!(again, f, "decode(encode(frame)) == frame"),
            }
            if let Frame::Hello(h) = &f {
                assert_eq!(versions, Some((h.version_min, h.version_max)));
            }
        }
        Err(e) => {
            assert!(!e.to_string().is_empty(), "errors say what is wrong");
            if let FrameError::Malformed { offset, .. } = e {
                assert!(
                    offset <= bytes.len(),
                    "error offset {offset} past the frame"
                );
            }
        }
    }
}

/// Arbitrary bytes as a transport stream, pushed into a `FrameBuffer` in chunks whose sizes
/// byte 0 seeds. The frames it yields must be exactly the ones a one-shot split of the whole
/// stream finds, and no byte may be lost or invented.
pub fn frame_buffer(data: &[u8]) {
    let Some((&seed, stream)) = data.split_first() else {
        return;
    };
    let max = 64 + u32::from(seed) * 8;
    // The reference: split the whole stream at once.
    let mut want = Vec::new();
    let mut want_err = None;
    let mut pos = 0;
    while stream.len() - pos >= LEN_PREFIX {
        match frame::frame_len(&stream[pos..], max) {
            Ok(len) if stream.len() - pos >= LEN_PREFIX + len => {
                want.push(&stream[pos..pos + LEN_PREFIX + len]);
                pos += LEN_PREFIX + len;
            }
            Ok(_) => break,
            Err(e) => {
                want_err = Some(e);
                break;
            }
        }
    }
    let mut buf = FrameBuffer::new(max);
    let mut got: Vec<Vec<u8>> = Vec::new();
    let mut got_err = None;
    let (mut pushed, mut taken) = (0usize, 0usize);
    let mut state = u32::from(seed) | 1;
    'push: for _ in 0..=stream.len() {
        state = state.wrapping_mul(1_103_515_245).wrapping_add(12_345);
        let n = (1 + (state >> 16) % 23) as usize;
        let chunk = &stream[pushed..(pushed + n).min(stream.len())];
        buf.push(chunk);
        pushed += chunk.len();
        loop {
            match buf.next_frame() {
                Ok(Some(f)) => {
                    taken += f.len();
                    if let Ok(Frame::Block { block, .. }) = Frame::decode(&f, max) {
                        let _ =
                            sync::fuzzing::decode_sized_with(&block, &sync::fuzzing::fuzz_limits());
                    }
                    got.push(f);
                }
                Ok(None) => break,
                Err(e) => {
                    got_err = Some(e);
                    break 'push;
                }
            }
        }
        assert_eq!(taken + buf.buffered(), pushed, "no byte lost or invented");
        if pushed == stream.len() {
            break;
        }
    }
    assert_eq!(got.len(), want.len(), "same frames as a one-shot split");
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(&g[..], *w);
    }
    assert_eq!(got_err, want_err, "the same bad length is refused");
}

/// `TRIBUTARY_FUZZ_TRACE=1` prints every event and frame the machines emit, to see what a
/// corpus input does (`cargo test -p tributary-sync --test fuzz_protocol_corpus -- --nocapture`).
fn trace(what: impl FnOnce() -> String) {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if *ON.get_or_init(|| std::env::var_os("TRIBUTARY_FUZZ_TRACE").is_some()) {
        eprintln!("{}", what());
    }
}

/// Reads op arguments; missing bytes read as zero, so every input is a valid program.
struct Input<'a> {
    data: &'a [u8],
}

impl<'a> Input<'a> {
    fn next(&mut self) -> Option<u8> {
        let (&b, rest) = self.data.split_first()?;
        self.data = rest;
        Some(b)
    }

    fn u8(&mut self) -> u8 {
        self.next().unwrap_or(0)
    }

    fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }

    /// Mostly small numbers (seqs, epochs), sometimes the edges of the range.
    fn num(&mut self) -> u64 {
        match self.u8() {
            b @ 0..=239 => u64::from(b),
            240..=247 => u64::from(self.u16()),
            248 => u64::from(u32::from_le_bytes([
                self.u8(),
                self.u8(),
                self.u8(),
                self.u8(),
            ])),
            249 => u64::MAX,
            250 => u64::MAX - 1,
            251 => i64::MAX as u64,
            b => u64::from(b - 251) * 1000,
        }
    }

    fn take(&mut self, n: usize) -> &'a [u8] {
        let (head, rest) = self.data.split_at(n.min(self.data.len()));
        self.data = rest;
        head
    }

    fn stream(&mut self) -> String {
        STREAMS[usize::from(self.u8()) % STREAMS.len()].to_owned()
    }

    /// A frame from a type byte and a payload of the input's choosing, correctly prefixed.
    fn typed_frame(&mut self) -> Vec<u8> {
        let t = self.u8() % 11;
        let n = usize::from(self.u8());
        let payload = self.take(n);
        let mut f = ((payload.len() + 1) as u32).to_le_bytes().to_vec();
        f.push(t);
        f.extend_from_slice(payload);
        f
    }

    /// Raw bytes as one frame, length prefix included (or not).
    fn raw_frame(&mut self) -> &'a [u8] {
        let n = usize::from(self.u16() % 512);
        self.take(n)
    }

    fn gap(&mut self) -> GapMarker {
        let first_seq = self.num();
        let last_seq = first_seq.saturating_add(self.num());
        GapMarker {
            first_seq,
            last_seq,
            reason: GapReason::from_u8(self.u8() % 5),
            count: self.num(),
        }
    }

    fn backlog(&mut self) -> Backlog {
        Backlog {
            blocks: self.num(),
            bytes: self.num(),
            oldest_unsent_ts: (self.u8() & 1 == 1).then(|| self.num() as i64),
        }
    }

    fn hello(&mut self) -> Frame {
        let (version_min, version_max) = match self.u8() % 8 {
            0 => (0, 0),
            1 => (2, 9),
            2 => (self.u16(), self.u16()),
            _ => (1, 1),
        };
        let current_epoch = self.num();
        let lanes = (0..self.u8() % 4)
            .map(|_| {
                let stream = self.stream();
                let epoch = self.num();
                let first_seq = self.num();
                let last_seq = first_seq.saturating_add(self.num());
                LaneAnnounce {
                    stream,
                    epoch,
                    first_seq,
                    last_seq,
                    acked_seq: self.num(),
                    backlog: self.backlog(),
                    gaps: (0..self.u8() % 2).map(|_| self.gap()).collect(),
                }
            })
            .collect();
        Frame::Hello(Hello {
            version_min,
            version_max,
            current_epoch,
            lanes,
            capabilities: 0,
        })
    }

    fn error(&mut self) -> Frame {
        let code = ErrorCode::from_u16(u16::from(self.u8() % 16));
        let n = usize::from(self.u8() % 64);
        let message = String::from_utf8_lossy(self.take(n)).into_owned();
        Frame::Error(ErrorFrame { code, message })
    }

    /// Control frames either side may get unexpectedly.
    fn other_frame(&mut self) -> Frame {
        match self.u8() % 8 {
            0 => Frame::Ping,
            1 => Frame::Backlog(
                (0..self.u8() % 3)
                    .map(|_| BacklogEntry {
                        stream: self.stream(),
                        epoch: self.num(),
                        backlog: self.backlog(),
                    })
                    .collect(),
            ),
            2 => self.error(),
            3 => Frame::Ack {
                stream: self.stream(),
                epoch: self.num(),
                durable_seq: self.num(),
                tiered_seq: self.num(),
            },
            4 => Frame::Verdict {
                stream: self.stream(),
                epoch: self.num(),
                matched_through: self.num(),
            },
            5 => Frame::Gap {
                stream: self.stream(),
                epoch: self.num(),
                gap: self.gap(),
            },
            6 => Frame::StreamRefused(StreamRefused {
                stream: self.stream(),
                epoch: self.num(),
                code: ErrorCode::from_u16(u16::from(self.u8() % 20)),
                retry_after_ms: u64::from(self.u8()) * 1000,
                message: "refused".into(),
            }),
            _ => self.hello(),
        }
    }
}

/// Records `first..first + n` of a block: a few keys, every value type.
fn records(first: u64, n: u64) -> Vec<Record> {
    (first..first.saturating_add(n))
        .map(|seq| Record {
            tags: Vec::new(),
            key: format!("k{}", seq % 3),
            ts: (seq as i64).wrapping_mul(1000),
            fields: vec![
                ("v".into(), Value::I64(seq as i64)),
                ("f".into(), Value::F64(seq as f64 / 2.0)),
            ],
        })
        .collect()
}

fn block_bytes(epoch: u64, first: u64, n: u64) -> Option<Vec<u8>> {
    block::encode_block(VERSION_ROWS, epoch, first, &records(first, n)).ok()
}

const LIMITS: DecodeLimits = DecodeLimits {
    raw_bytes_max: 1 << 16,
    records_max: 1 << 10,
    body_bytes_max: 1 << 16,
    decoded_bytes_max: 1 << 20,
};

const TIMEOUTS: Timeouts = Timeouts {
    idle: Duration::from_secs(30),
    keepalive: Duration::from_secs(10),
};

/// The hub's side: a `Receiver` fed arbitrary frames and frame sequences, with a driver that
/// answers its mark look-ups and commits what it hands over, as core-hub does. Checks that
/// every frame it sends is valid, that it closes at most once, and that within a lane every
/// seq is handed over for commit exactly once, in order, after the stored mark.
pub fn receiver_machine(data: &[u8]) {
    let mut inp = Input { data };
    let config = ReceiverConfig {
        frame_bytes_max: FRAME_MAX,
        window_bytes: 16 << 10,
        window_items: 8,
        lanes_max: 6,
        checksum_ranges_max: 4,
        timeouts: TIMEOUTS,
        decode_limits: LIMITS,
        ..ReceiverConfig::default()
    };
    let mut now = Instant::from_nanos(1);
    let mut rx = Receiver::new("dev7".into(), config, now);
    let mut hub = Hub {
        mark_seed: inp.u8(),
        epoch_max: inp.num(),
        ..Hub::default()
    };
    hub.drain(&mut rx);
    while let Some(op) = inp.next() {
        match op % 9 {
            0 => rx.handle_frame(now, inp.raw_frame()),
            1 => rx.handle_frame(now, &inp.typed_frame()),
            2 | 3 => {
                let stream = inp.stream();
                let epoch = inp.num();
                let first = inp.num();
                let n = 1 + u64::from(inp.u8() % 6);
                let how = inp.u8();
                let Some(mut block) = block_bytes(epoch, first, n) else {
                    continue;
                };
                if how & 0x80 != 0 {
                    let at = usize::from(inp.u16()) % block.len();
                    block[at] ^= 1 << (how & 7);
                }
                let _ = sync::fuzzing::decode_sized_with(&block, &LIMITS);
                if how & 0x40 != 0 {
                    // The driver may verify and decode off the control task.
                    match DecodedBlock::decode(block.clone(), &LIMITS, Vec::new()) {
                        Ok(d) => rx.handle_decoded_block(now, stream, d),
                        Err(_) => rx.handle_frame(now, &Frame::Block { stream, block }.encode()),
                    }
                } else {
                    rx.handle_frame(now, &Frame::Block { stream, block }.encode());
                }
            }
            4 => {
                let f = Frame::Gap {
                    stream: inp.stream(),
                    epoch: inp.num(),
                    gap: inp.gap(),
                };
                rx.handle_frame(now, &f.encode());
            }
            5 => rx.handle_frame(now, &inp.hello().encode()),
            6 => {
                now = now + Duration::from_millis(u64::from(inp.u8()) * 250);
                rx.handle_timeout(now);
            }
            7 => hub.act(&mut rx, &mut inp, now),
            _ => match inp.u8() % 4 {
                0 => rx.close(now, ErrorCode::from_u16(inp.u16()), "driver closes"),
                1 => {
                    let f = Frame::Welcome(Welcome {
                        version: 1,
                        window_bytes: inp.num(),
                        window_items: inp.num(),
                        epoch_max: inp.num(),
                        lanes: vec![],
                    });
                    rx.handle_frame(now, &f.encode());
                }
                _ => rx.handle_frame(now, &inp.other_frame().encode()),
            },
        }
        hub.drain(&mut rx);
    }
}

/// core-hub's part, reduced to what the receiver relies on.
#[derive(Default)]
struct Hub {
    mark_seed: u8,
    epoch_max: u64,
    queries: VecDeque<Vec<MarksQuery>>,
    /// Handed over for commit, not yet reported durable: (stream, epoch, last_seq).
    uncommitted: VecDeque<(String, u64, u64)>,
    /// Per lane, the last seq handed over (or the stored mark).
    handed: HashMap<(String, u64), u64>,
    established: bool,
    closed: bool,
}

impl Hub {
    /// The durable mark this hub holds for a lane: arbitrary, but fixed for the run.
    fn mark(&self, stream: &str, epoch: u64) -> u64 {
        let h = stream.bytes().fold(u64::from(self.mark_seed), |h, b| {
            h.wrapping_mul(31).wrapping_add(u64::from(b))
        });
        (h ^ epoch) % 7
    }

    fn act(&mut self, rx: &mut Receiver, inp: &mut Input<'_>, now: Instant) {
        match inp.u8() % 4 {
            0 => {
                if let Some(q) = self.queries.pop_front() {
                    let lanes = q
                        .iter()
                        .map(|q| LaneMarks {
                            stream: q.stream.clone(),
                            epoch: q.epoch,
                            durable_seq: self.mark(&q.stream, q.epoch),
                            tiered_seq: 0,
                            ranges: vec![],
                            gaps: vec![],
                        })
                        .collect();
                    let epoch_max = self.epoch_max;
                    rx.marks_loaded(now, Marks { epoch_max, lanes });
                }
            }
            1 | 2 => {
                // Group commit: everything handed over so far becomes durable.
                while let Some((stream, epoch, last)) = self.uncommitted.pop_front() {
                    let tiered = last.saturating_sub(u64::from(inp.u8() % 4));
                    rx.committed(now, &stream, epoch, last, tiered);
                }
            }
            _ => {
                let (stream, epoch, seq) = (inp.stream(), inp.num(), inp.num());
                rx.update_tiered(now, &stream, epoch, seq);
            }
        }
    }

    fn drain(&mut self, rx: &mut Receiver) {
        while let Some(t) = rx.poll_transmit() {
            let f = Frame::decode(&t.frame, u32::MAX).expect("the receiver sends valid frames");
            trace(|| format!("hub sends {f:?}"));
            assert!(
                t.kind == TransmitKind::Control,
                "the receiver sends control frames only, not {}",
                f.name()
            );
        }
        while let Some(e) = rx.poll_event() {
            trace(|| format!("hub event {e:?}"));
            assert!(!self.closed, "an event after Closed: {e:?}");
            match e {
                ReceiverEvent::NeedMarks { lanes, .. } => self.queries.push_back(lanes),
                ReceiverEvent::Established { version, .. } => {
                    assert!(!self.established, "established twice");
                    assert_eq!(version, frame::PROTOCOL_VERSION);
                    self.established = true;
                }
                ReceiverEvent::Commit {
                    stream,
                    epoch,
                    item,
                } => {
                    assert!(self.established, "a commit before the handshake");
                    let mark = self.mark(&stream, epoch);
                    let handed = self.handed.entry((stream.clone(), epoch)).or_insert(mark);
                    let first = match &item {
                        CommitItem::Block {
                            header,
                            skip_through,
                            records,
                            ..
                        } => {
                            let first = header.first_seq.max(skip_through.saturating_add(1));
                            assert!(first <= header.last_seq(), "a commit of no records");
                            assert_eq!(
                                records.len() as u64,
                                header.last_seq() - first + 1,
                                "the records committed are those after skip_through"
                            );
                            first
                        }
                        CommitItem::Gap(g) => g.first_seq,
                    };
                    assert_eq!(
                        first,
                        handed.wrapping_add(1),
                        "lane {stream}/{epoch}: commit of {first}..={} after {}",
                        item.last_seq(),
                        *handed
                    );
                    *handed = item.last_seq();
                    self.uncommitted.push_back((stream, epoch, item.last_seq()));
                }
                ReceiverEvent::Backlog { .. } | ReceiverEvent::Fenced { .. } => {}
                ReceiverEvent::Closed(_) => self.closed = true,
            }
        }
        if rx.is_closed() {
            assert!(
                rx.poll_timeout().is_none(),
                "a closed receiver arms no timer"
            );
        }
    }
}

/// The edge's side: a `Sender` that announced some lanes, fed arbitrary hub frames and frame
/// sequences, with a driver that serves its block requests from an in-memory log, mints
/// epochs when asked and keeps appending blocks, as edge-agent does. Checks that every frame
/// it sends is valid (data frames only carry blocks and gaps), that it closes at most once, and
/// that the marks it reports as acknowledged never go backwards.
pub fn sender_machine(data: &[u8]) {
    let mut inp = Input { data };
    let config = SenderConfig {
        frame_bytes_max: FRAME_MAX,
        window_bytes_max: 16 << 10,
        window_items_max: 8,
        queue_bytes_max: 8 << 10,
        backlog_interval: Duration::from_secs(5),
        timeouts: TIMEOUTS,
        ..SenderConfig::default()
    };
    let mut now = Instant::from_nanos(1);
    let current_epoch = 1 + u64::from(inp.u8() % 4);
    let mut edge = Edge::default();
    let mut announced = Vec::new();
    for _ in 0..inp.u8() % 4 {
        let stream = inp.stream();
        let epoch = 1 + u64::from(inp.u8() % 4);
        if edge.log.contains_key(&(stream.clone(), epoch)) {
            continue;
        }
        let first = u64::from(inp.u8() % 8);
        let held = u64::from(inp.u8() % 16);
        let (first_seq, last_seq) = if first == 0 || held == 0 {
            (0, 0)
        } else {
            (first, first + held - 1)
        };
        let acked_seq = last_seq.min(u64::from(inp.u8() % 16));
        edge.append(&stream, epoch, first_seq, last_seq);
        announced.push(LaneAnnounce {
            stream,
            epoch,
            first_seq,
            last_seq,
            acked_seq,
            backlog: Backlog::default(),
            gaps: vec![],
        });
    }
    let mut tx = Sender::new(config, current_epoch, announced, now).expect("valid lanes");
    edge.current_epoch = current_epoch;
    edge.drain(&mut tx, now);
    while let Some(op) = inp.next() {
        match op % 9 {
            0 => tx.handle_frame(now, inp.raw_frame()),
            1 => tx.handle_frame(now, &inp.typed_frame()),
            2 => {
                let version = match inp.u8() % 8 {
                    0 => 0,
                    1 => 2,
                    _ => 1,
                };
                let window_bytes = inp.num().saturating_mul(256);
                let window_items = inp.num();
                let epoch_max = inp.num();
                let mut lanes: Vec<(String, u64, LaneWelcome)> = Vec::new();
                for ((stream, epoch), _) in edge.log.iter() {
                    if !inp.u8().is_multiple_of(4) {
                        let durable_seq = inp.num();
                        lanes.push((
                            stream.clone(),
                            *epoch,
                            LaneWelcome {
                                durable_seq,
                                tiered_seq: durable_seq.saturating_sub(inp.num()),
                                resume_from: durable_seq
                                    .saturating_add(1)
                                    .saturating_sub(inp.num()),
                            },
                        ));
                    }
                }
                if inp.u8().is_multiple_of(4) {
                    let durable_seq = inp.num();
                    lanes.push((
                        inp.stream(),
                        inp.num(),
                        LaneWelcome {
                            durable_seq,
                            tiered_seq: 0,
                            resume_from: durable_seq.saturating_add(1),
                        },
                    ));
                }
                let f = Frame::Welcome(Welcome {
                    version,
                    window_bytes,
                    window_items,
                    epoch_max,
                    lanes,
                });
                tx.handle_frame(now, &f.encode());
            }
            3 | 4 => {
                let f = match edge.pick_lane(&mut inp) {
                    Some((stream, epoch, last)) if op % 9 == 3 => {
                        let durable_seq = last.saturating_sub(inp.num());
                        Frame::Ack {
                            stream,
                            epoch,
                            durable_seq,
                            tiered_seq: durable_seq.saturating_sub(inp.num()),
                        }
                    }
                    Some((stream, epoch, last)) => Frame::Verdict {
                        stream,
                        epoch,
                        matched_through: last.saturating_sub(inp.num()),
                    },
                    None => inp.other_frame(),
                };
                tx.handle_frame(now, &f.encode());
            }
            5 => {
                now = now + Duration::from_millis(u64::from(inp.u8()) * 250);
                tx.handle_timeout(now);
            }
            6 | 7 => edge.act(&mut tx, &mut inp, now),
            _ => match inp.u8() % 4 {
                0 => tx.close(now, ErrorCode::from_u16(inp.u16()), "driver closes"),
                _ => tx.handle_frame(now, &inp.other_frame().encode()),
            },
        }
        edge.drain(&mut tx, now);
    }
}

/// A lane's log: blocks in seq order as (first_seq, last_seq, bytes); empty bytes stand for a
/// gap marker.
type LaneLog = Vec<(u64, u64, Vec<u8>)>;

/// edge-agent's part, reduced to what the sender relies on: a log of sealed blocks per lane.
#[derive(Default)]
struct Edge {
    current_epoch: u64,
    log: std::collections::BTreeMap<(String, u64), LaneLog>,
    wants: VecDeque<(String, u64, u64, u64)>,
    acked: HashMap<(String, u64), (u64, u64)>,
    closed: bool,
}

impl Edge {
    /// Seals seqs `first..=last` of a lane into blocks of up to three records.
    fn append(&mut self, stream: &str, epoch: u64, first: u64, last: u64) {
        let lane = self.log.entry((stream.to_owned(), epoch)).or_default();
        let mut seq = first;
        while first > 0 && seq <= last {
            let n = (last - seq + 1).min(3);
            let bytes = block_bytes(epoch, seq, n).expect("small seqs encode");
            lane.push((seq, seq + n - 1, bytes));
            seq += n;
        }
    }

    fn held_last(&self, stream: &str, epoch: u64) -> u64 {
        self.log
            .get(&(stream.to_owned(), epoch))
            .and_then(|l| l.last())
            .map_or(0, |b| b.1)
    }

    fn pick_lane(&self, inp: &mut Input<'_>) -> Option<(String, u64, u64)> {
        let n = self.log.len();
        if n == 0 {
            return None;
        }
        let ((stream, epoch), blocks) = self.log.iter().nth(usize::from(inp.u8()) % n)?;
        let last = blocks.last().map_or(0, |b| b.1);
        Some((stream.clone(), *epoch, last))
    }

    fn act(&mut self, tx: &mut Sender, inp: &mut Input<'_>, now: Instant) {
        match inp.u8() % 5 {
            0 | 1 => {
                let Some((stream, epoch, after, bytes_max)) = self.wants.pop_front() else {
                    return;
                };
                let mut out = Vec::new();
                let mut bytes = 0u64;
                for (_, last, b) in self.log.get(&(stream.clone(), epoch)).into_iter().flatten() {
                    if *last <= after || b.is_empty() {
                        continue;
                    }
                    if !out.is_empty() && bytes + b.len() as u64 > bytes_max {
                        break;
                    }
                    bytes += b.len() as u64;
                    out.push(b.clone());
                }
                tx.supply_blocks(now, &stream, epoch, out)
                    .expect("the sender asked for this lane's blocks");
            }
            2 => {
                // A new block is sealed in the current epoch.
                let stream = inp.stream();
                let epoch = self.current_epoch;
                let first = self.held_last(&stream, epoch) + 1;
                let last = first + u64::from(inp.u8() % 3);
                self.append(&stream, epoch, first, last);
                let block = self.log[&(stream.clone(), epoch)]
                    .last()
                    .expect("appended")
                    .2
                    .clone();
                tx.offer_block(now, &stream, block)
                    .expect("a sealed block is accepted");
            }
            3 => {
                let stream = inp.stream();
                let epoch = self.current_epoch;
                let first = self.held_last(&stream, epoch) + 1;
                let gap = GapMarker {
                    first_seq: first,
                    last_seq: first + u64::from(inp.u8() % 3),
                    reason: GapReason::DiskFull,
                    count: 1,
                };
                tx.offer_gap(now, &stream, epoch, gap)
                    .expect("a gap marker is accepted");
                // The log now holds those seqs as lost (an entry without a block): later
                // blocks start after them.
                let lane = self.log.entry((stream, epoch)).or_default();
                lane.push((gap.first_seq, gap.last_seq, Vec::new()));
            }
            _ => tx.set_priority(&inp.stream(), inp.u8()),
        }
    }

    /// The driver's answer to MintEpoch: the records to move are copied into the new epoch,
    /// first, then new data goes there.
    fn mint(
        &mut self,
        tx: &mut Sender,
        now: Instant,
        epoch_min: u64,
        rekey: Vec<sync::protocol::Rekey>,
    ) {
        let epoch = epoch_min;
        for rk in rekey {
            // Seqs of the old lane at or after `from_seq` that hold records (not gap markers).
            let moved: u64 = self
                .log
                .get(&(rk.stream.clone(), rk.epoch))
                .into_iter()
                .flatten()
                .filter(|(_, last, bytes)| !bytes.is_empty() && *last >= rk.from_seq)
                .map(|(first, last, _)| last - first.max(&rk.from_seq) + 1)
                .sum();
            if moved == 0 {
                continue;
            }
            let first = self.held_last(&rk.stream, epoch) + 1;
            self.append(&rk.stream, epoch, first, first + moved - 1);
            let blocks: Vec<Vec<u8>> = self.log[&(rk.stream.clone(), epoch)]
                .iter()
                .filter(|b| b.0 >= first)
                .map(|b| b.2.clone())
                .collect();
            for b in blocks {
                tx.offer_block(now, &rk.stream, b)
                    .expect("a moved block is accepted");
            }
        }
        self.current_epoch = epoch;
        tx.epoch_minted(now, epoch);
    }

    fn drain(&mut self, tx: &mut Sender, now: Instant) {
        loop {
            while let Some(t) = tx.poll_transmit() {
                let f = Frame::decode(&t.frame, u32::MAX).expect("the sender sends valid frames");
                trace(|| format!("edge sends {f:?}"));
                match (&f, t.kind) {
                    (Frame::Block { block, .. }, _) => {
                        block::decode_header(block).expect("the sender sends the blocks it got");
                    }
                    (Frame::Gap { .. }, _) | (_, TransmitKind::Control) => {}
                    (other, TransmitKind::Data) => {
                        panic!("a {} frame offered as data", other.name())
                    }
                }
            }
            let Some(e) = tx.poll_event() else {
                break;
            };
            trace(|| format!("edge event {e:?}"));
            assert!(!self.closed, "an event after Closed: {e:?}");
            match e {
                SenderEvent::WantBlocks {
                    stream,
                    epoch,
                    after_seq,
                    bytes_max,
                } => self.wants.push_back((stream, epoch, after_seq, bytes_max)),
                SenderEvent::Acked {
                    stream,
                    epoch,
                    durable_seq,
                    tiered_seq,
                } => {
                    let before = self.acked.entry((stream.clone(), epoch)).or_default();
                    assert!(
                        durable_seq >= before.0 && tiered_seq >= before.1,
                        "lane {stream}/{epoch}: acknowledged marks went back from {before:?} to ({durable_seq}, {tiered_seq})"
                    );
                    *before = (durable_seq, tiered_seq);
                }
                SenderEvent::MintEpoch { epoch_min, rekey } => {
                    assert!(
                        epoch_min > self.current_epoch,
                        "a minted epoch must be new: {epoch_min} after {}",
                        self.current_epoch
                    );
                    self.mint(tx, now, epoch_min, rekey);
                }
                SenderEvent::Established { .. }
                | SenderEvent::StreamRefused { .. }
                | SenderEvent::StreamRetrying { .. } => {}
                SenderEvent::Closed(_) => self.closed = true,
            }
        }
    }
}
