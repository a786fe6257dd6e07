//! A stream the hub refuses (StreamRefused): the session and the other streams carry on, the
//! refused stream's blocks are not acknowledged, and it is offered again from the hub's mark
//! on the same session once `retry_after` has passed. An edge that did not announce the
//! capability gets the old behaviour: the session closes with the code.

use std::collections::HashMap;
use std::time::Duration;

use sync::block::{self, VERSION_ROWS};
use sync::protocol::frame::capability;
use sync::protocol::{
    Backlog, CommitItem, ErrorCode, Frame, Instant, LaneAnnounce, LaneMarks, Marks, Receiver,
    ReceiverConfig, ReceiverEvent, Refusal, Sender, SenderConfig, SenderEvent,
};
use sync::{Record, Value};

const RETRY: Duration = Duration::from_secs(30);

fn block(epoch: u64, first: u64, n: u64) -> Vec<u8> {
    let records: Vec<Record> = (0..n)
        .map(|i| Record {
            tags: Vec::new(),
            key: format!("dev/k{i}"),
            ts: 1_764_374_400_000_000_000 + i as i64,
            fields: vec![("v".into(), Value::I64((first + i) as i64))],
        })
        .collect();
    block::encode_block(VERSION_ROWS, epoch, first, &records).unwrap()
}

fn lane(stream: &str, last_seq: u64) -> LaneAnnounce {
    LaneAnnounce {
        stream: stream.into(),
        epoch: 1,
        first_seq: 1,
        last_seq,
        acked_seq: 0,
        backlog: Backlog::default(),
        gaps: Vec::new(),
    }
}

/// Both machines and a tiny driver: a log of blocks per stream, a hub that refuses
/// `refused` while it is set, and what each side saw.
struct World {
    now: Instant,
    tx: Sender,
    rx: Receiver,
    log: HashMap<String, Vec<Vec<u8>>>,
    refused: Option<String>,
    /// Refuse when the marks are looked up (the allow-list), not when a block is committed
    /// (a quota, a forbidden key).
    at_marks: bool,
    committed: HashMap<String, u64>,
    acked: HashMap<String, u64>,
    edge_refusals: Vec<(String, ErrorCode, Duration)>,
    retries: Vec<String>,
    refusal_frames: u64,
}

impl World {
    fn new(capabilities: u64) -> World {
        let now = Instant::ZERO;
        let mut log = HashMap::new();
        log.insert("a".to_string(), vec![block(1, 1, 3), block(1, 4, 3)]);
        log.insert("b".to_string(), vec![block(1, 1, 3), block(1, 4, 3)]);
        let cfg = SenderConfig {
            capabilities,
            ..SenderConfig::default()
        };
        let tx = Sender::new(cfg, 1, vec![lane("a", 6), lane("b", 6)], now).unwrap();
        let rx = Receiver::new("dev".into(), ReceiverConfig::default(), now);
        World {
            now,
            tx,
            rx,
            log,
            refused: Some("b".into()),
            at_marks: false,
            committed: HashMap::new(),
            acked: HashMap::new(),
            edge_refusals: Vec::new(),
            retries: Vec::new(),
            refusal_frames: 0,
        }
    }

    /// Runs both machines until neither has anything to do.
    fn settle(&mut self) {
        for _ in 0..1000 {
            let mut progressed = false;
            while let Some(t) = self.tx.poll_transmit() {
                progressed = true;
                self.rx.handle_frame(self.now, &t.frame);
            }
            while let Some(t) = self.rx.poll_transmit() {
                progressed = true;
                if let Ok(Frame::StreamRefused(_)) = Frame::decode(&t.frame, 1 << 24) {
                    self.refusal_frames += 1;
                }
                self.tx.handle_frame(self.now, &t.frame);
            }
            while let Some(e) = self.rx.poll_event() {
                progressed = true;
                self.on_hub_event(e);
            }
            while let Some(e) = self.tx.poll_event() {
                progressed = true;
                self.on_edge_event(e);
            }
            if !progressed {
                return;
            }
        }
        panic!("the machines never settled");
    }

    fn refusal(stream: &str) -> Refusal {
        Refusal {
            code: ErrorCode::UnauthorizedStream,
            retry_after: RETRY,
            message: format!("device may not write stream `{stream}`"),
        }
    }

    fn on_hub_event(&mut self, e: ReceiverEvent) {
        match e {
            ReceiverEvent::NeedMarks { lanes, .. } => {
                let refuse = self
                    .refused
                    .clone()
                    .filter(|r| self.at_marks && lanes.iter().any(|q| &q.stream == r));
                let established = self.rx.is_established();
                if let Some(r) = refuse.as_deref().filter(|_| established) {
                    self.rx.refuse_stream(self.now, r, 0, &Self::refusal(r));
                }
                let lanes = lanes
                    .into_iter()
                    .map(|q| LaneMarks {
                        stream: q.stream.clone(),
                        epoch: q.epoch,
                        durable_seq: self.committed.get(&q.stream).copied().unwrap_or(0),
                        tiered_seq: 0,
                        gaps: Vec::new(),
                        ranges: Vec::new(),
                    })
                    .collect();
                self.rx.marks_loaded(
                    self.now,
                    Marks {
                        epoch_max: 1,
                        lanes,
                    },
                );
                if let Some(r) = refuse.as_deref().filter(|_| !established) {
                    self.rx.refuse_stream(self.now, r, 0, &Self::refusal(r));
                }
            }
            ReceiverEvent::Commit {
                stream,
                epoch,
                item,
            } => {
                let last = item.last_seq();
                if self.refused.as_deref() == Some(stream.as_str()) {
                    assert!(!self.at_marks, "{stream}: a refused stream was handed out");
                    let r = Self::refusal(&stream);
                    self.rx.refuse_stream(self.now, &stream, epoch, &r);
                    assert!(
                        self.rx.is_closed()
                            || self.rx.commit_failed(self.now, &stream, epoch, last)
                    );
                    return;
                }
                if let CommitItem::Block { skip_through, .. } = &item {
                    let have = self.committed.get(&stream).copied().unwrap_or(0);
                    assert_eq!(
                        *skip_through, have,
                        "{stream}: commits in order, exactly once"
                    );
                }
                self.committed.insert(stream.clone(), last);
                self.rx.committed(self.now, &stream, epoch, last, 0);
            }
            ReceiverEvent::Fenced { .. } => panic!("no conflict here"),
            ReceiverEvent::Closed(_)
            | ReceiverEvent::Established { .. }
            | ReceiverEvent::Backlog { .. } => {}
        }
    }

    fn on_edge_event(&mut self, e: SenderEvent) {
        match e {
            SenderEvent::WantBlocks {
                stream, after_seq, ..
            } => {
                let blocks = self.log[&stream]
                    .iter()
                    .filter(|b| block::decode_header(b).unwrap().last_seq() > after_seq)
                    .cloned()
                    .collect();
                self.tx.supply_blocks(self.now, &stream, 1, blocks).unwrap();
            }
            SenderEvent::Acked {
                stream,
                durable_seq,
                ..
            } => {
                self.acked.insert(stream, durable_seq);
            }
            SenderEvent::StreamRefused {
                stream,
                code,
                retry_after,
                ..
            } => self.edge_refusals.push((stream, code, retry_after)),
            SenderEvent::StreamRetrying { stream } => self.retries.push(stream),
            SenderEvent::MintEpoch { .. } => panic!("nothing was restored: no new epoch"),
            SenderEvent::Established { .. } | SenderEvent::Closed(_) => {}
        }
    }

    fn advance(&mut self, d: Duration) {
        self.now = self.now + d;
        self.tx.handle_timeout(self.now);
        self.rx.handle_timeout(self.now);
        self.settle();
    }
}

#[test]
fn a_stream_refused_at_commit_leaves_the_session_and_the_other_stream_alone() {
    refused_then_allowed(false);
}

#[test]
fn a_stream_refused_by_the_allow_list_leaves_the_session_and_the_other_stream_alone() {
    refused_then_allowed(true);
}

fn refused_then_allowed(at_marks: bool) {
    let mut w = World::new(capability::ALL);
    w.at_marks = at_marks;
    w.settle();
    assert!(!w.tx.is_closed() && !w.rx.is_closed());
    assert_eq!(
        w.acked.get("a"),
        Some(&6),
        "the allowed stream is acknowledged"
    );
    assert_eq!(
        w.acked.get("b"),
        None,
        "nothing of the refused stream is acknowledged"
    );
    assert_eq!(
        w.edge_refusals,
        vec![("b".to_string(), ErrorCode::UnauthorizedStream, RETRY)]
    );
    assert_eq!(w.refusal_frames, 1, "one refusal, not one per block");
    assert_eq!(w.tx.inflight_bytes(), 0, "refused blocks leave the window");
    assert_eq!(w.rx.held_bytes(), 0, "and the hub holds nothing of them");

    // More data of both streams while the refusal holds: only `a` moves.
    let (a3, b3) = (block(1, 7, 2), block(1, 7, 2));
    w.log.get_mut("a").unwrap().push(a3.clone());
    w.log.get_mut("b").unwrap().push(b3.clone());
    w.tx.offer_block(w.now, "a", a3).unwrap();
    w.tx.offer_block(w.now, "b", b3).unwrap();
    w.settle();
    w.advance(RETRY / 2);
    assert_eq!(w.acked.get("a"), Some(&8));
    assert_eq!(w.acked.get("b"), None);
    assert!(w.retries.is_empty(), "no retry before retry_after");

    // The operator fixes the allow-list; after retry_after the same session ships `b` from 1.
    w.refused = None;
    w.advance(RETRY / 2);
    assert_eq!(w.retries, vec!["b".to_string()]);
    assert!(
        !w.tx.is_closed() && !w.rx.is_closed(),
        "still the same session"
    );
    assert_eq!(w.acked.get("b"), Some(&8), "the stream ships once allowed");
    assert_eq!(w.committed.get("b"), Some(&8));
}

#[test]
fn a_refusal_that_persists_is_repeated_once_per_retry_period() {
    for at_marks in [false, true] {
        refusal_persists(at_marks);
    }
}

fn refusal_persists(at_marks: bool) {
    let mut w = World::new(capability::ALL);
    w.at_marks = at_marks;
    w.settle();
    // Small steps: keepalives keep the session alive meanwhile.
    for _ in 0..3 * 6 {
        w.advance(RETRY / 6);
    }
    assert_eq!(w.refusal_frames, 4, "one refusal per retry period");
    assert_eq!(w.retries.len(), 3);
    assert_eq!(w.acked.get("b"), None);
    assert_eq!(w.acked.get("a"), Some(&6));
    assert!(!w.tx.is_closed());
}

#[test]
fn an_edge_without_the_capability_is_closed_as_before() {
    let mut w = World::new(0);
    w.settle();
    assert!(w.rx.is_closed() && w.tx.is_closed());
    let mut w = World::new(0);
    w.at_marks = true;
    w.settle();
    assert!(w.rx.is_closed() && w.tx.is_closed());
    assert_eq!(
        w.refusal_frames, 0,
        "an old edge never gets a frame it cannot decode"
    );
    assert!(w.edge_refusals.is_empty());
}
