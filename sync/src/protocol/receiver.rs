//! The hub side of the replication protocol: a sans-IO state machine per connection.
//!
//! The receiver negotiates the version, asks the driver for the durable marks of the lanes the
//! edge announces ([`ReceiverEvent::NeedMarks`] answered by [`Receiver::marks_loaded`]),
//! verifies every block that overlaps what the hub already holds against stored range
//! checksums, trims a block that straddles the mark, puts blocks that arrive out of order into
//! a bounded reorder buffer, and hands the contiguous next records to the driver
//! ([`ReceiverEvent::Commit`]). It acknowledges only after the driver reports the records
//! durable ([`Receiver::committed`]), so an Ack always means "fsynced and in the catalog".
//!
//! The device id is given at construction by the driver, from the TLS client certificate; no
//! frame can name it. Everything this machine holds is per connection and disposable: a fresh
//! receiver built from the hub's persisted marks and checksums converges with a fresh sender.

use super::checksum::{RangeChecksum, record_hash, record_hashes_into};
use super::frame::{
    BacklogEntry, ErrorCode, ErrorFrame, Frame, FrameError, GapMarker, Hello, LaneAnnounce,
    LaneWelcome, Welcome, hello_versions,
};
use super::{CloseReason, Instant, Liveness, Timeouts, Transmit, TransmitKind, frame};
use crate::block::{self, BlockHeader, DecodeLimits};
use crate::record::Record;
use std::collections::{BTreeMap, HashMap, VecDeque};

mod refusal;
pub use refusal::Refusal;

/// The highest seq a lane may use: 2^63 - 2, so that every seq and the one after it fit the
/// hub catalog's signed 64-bit integers and `seq + 1` never wraps. A Block or Gap frame (or a
/// Hello lane) reaching past it is refused with `PROTOCOL_VIOLATION`: at a million records a
/// second a device needs 290,000 years to get there, so only a broken or hostile peer does.
pub const SEQ_MAX: u64 = i64::MAX as u64 - 1;

/// Limits and timers of a receiver. Every buffer has a bound.
#[derive(Debug, Clone)]
pub struct ReceiverConfig {
    pub version_min: u16,
    pub version_max: u16,
    /// Largest frame accepted (the `len` field); checked before allocating.
    pub frame_bytes_max: u32,
    /// Block bytes the edge may have unacknowledged; advertised in Welcome. It bounds this
    /// connection's reorder buffer plus blocks handed over for commit but not yet durable.
    pub window_bytes: u64,
    /// Blocks and gap markers the edge may have unacknowledged; advertised in Welcome.
    pub window_items: u64,
    /// Most `(stream, epoch)` lanes per connection.
    pub lanes_max: usize,
    /// Most stored range checksums kept per lane for verification.
    pub checksum_ranges_max: usize,
    pub timeouts: Timeouts,
    /// Limits for decoding untrusted blocks (zstd bombs, record counts).
    pub decode_limits: DecodeLimits,
}

impl Default for ReceiverConfig {
    fn default() -> Self {
        ReceiverConfig {
            version_min: frame::PROTOCOL_VERSION,
            version_max: frame::PROTOCOL_VERSION,
            frame_bytes_max: frame::FRAME_BYTES_MAX_DEFAULT,
            window_bytes: 32 << 20,
            window_items: 4096,
            lanes_max: 1024,
            checksum_ranges_max: 4096,
            timeouts: Timeouts::default(),
            decode_limits: DecodeLimits::default(),
        }
    }
}

/// One lane the driver must look up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MarksQuery {
    pub stream: String,
    pub epoch: u64,
    /// Return stored range checksums with `last_seq >= checksums_from` (earliest first, at
    /// most `checksum_ranges_max`), plus always the range ending at the mark.
    pub checksums_from: u64,
}

/// The driver's answer to one [`ReceiverEvent::NeedMarks`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Marks {
    /// Highest epoch the hub has seen from this device (0 if none).
    pub epoch_max: u64,
    /// The queried lanes (a missing one counts as never seen: marks 0, no checksums), plus,
    /// for the Hello's query, every lane the hub knows in the device's current epoch.
    pub lanes: Vec<LaneMarks>,
}

/// What the hub has persisted for one `(device, stream, epoch)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaneMarks {
    pub stream: String,
    pub epoch: u64,
    /// The contiguous committed prefix: every seq up to it is durable (as data or as a gap).
    pub durable_seq: u64,
    pub tiered_seq: u64,
    /// Stored checksums of committed block ranges, ascending.
    pub ranges: Vec<RangeChecksum>,
    /// Committed gap ranges (`first_seq..=last_seq`, as committed after clipping) in the same
    /// window as `ranges`: seqs the hub holds as lost, which records can neither confirm nor
    /// contradict.
    pub gaps: Vec<(u64, u64)>,
}

/// Something to append to the hub's log, in this order, per lane.
#[derive(Debug, Clone, PartialEq)]
pub enum CommitItem {
    /// Records `skip_through + 1 ..= header.last_seq()` of `block`.
    Block {
        header: BlockHeader,
        /// The block as received (verified). Records at or below `skip_through` are not to
        /// be committed: the hub already holds them.
        block: Vec<u8>,
        skip_through: u64,
        /// The decoded records being committed, already trimmed.
        records: Vec<Record>,
        /// To store with the range, so that later arrivals can be verified.
        checksum: RangeChecksum,
    },
    /// Seqs the edge lost, already clipped to what the hub does not hold.
    Gap(GapMarker),
}

impl CommitItem {
    /// The highest seq this item covers; report it back through [`Receiver::committed`].
    pub fn last_seq(&self) -> u64 {
        match self {
            CommitItem::Block { header, .. } => header.last_seq(),
            CommitItem::Gap(g) => g.last_seq,
        }
    }
}

/// What the receiver asks of, or reports to, the driver.
#[derive(Debug, Clone, PartialEq)]
pub enum ReceiverEvent {
    /// Look these lanes up (and authorize the streams); answer with [`Receiver::marks_loaded`]
    /// once per event, in order. To refuse a stream, call [`Receiver::close`] with
    /// [`ErrorCode::UnauthorizedStream`] instead.
    NeedMarks {
        current_epoch: u64,
        lanes: Vec<MarksQuery>,
    },
    /// The handshake completed with this version.
    Established { version: u16, current_epoch: u64 },
    /// Append to the log; once fsynced and in the catalog, call [`Receiver::committed`].
    Commit {
        stream: String,
        epoch: u64,
        item: CommitItem,
    },
    /// The edge's periodic backlog report, for completeness tracking.
    Backlog {
        entries: Vec<BacklogEntry>,
        received_at: Instant,
    },
    /// Same seqs, different content: raise the alarm and persist the fence. The receiver has
    /// already queued an Error frame (`CONFLICT_FENCED`) and closed.
    Fenced {
        stream: String,
        epoch: u64,
        first_seq: u64,
        last_seq: u64,
    },
    /// The session is over; flush pending transmits and close the connection.
    Closed(CloseReason),
}

/// Counters for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReceiverStats {
    pub blocks_committed: u64,
    pub gaps_committed: u64,
    /// Blocks entirely at or below the mark, acknowledged without a commit.
    pub replays: u64,
    /// Stored ranges compared equal.
    pub ranges_verified: u64,
    /// Overlapping records that could not be compared (no stored range aligned with them).
    pub records_unverified: u64,
    /// The most block bytes held at once (reorder buffer plus uncommitted).
    pub held_bytes_peak: u64,
    /// StreamRefused frames sent.
    pub streams_refused: u64,
    /// Block and gap frames of a refused stream dropped unacknowledged.
    pub refused_items_dropped: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    AwaitHello,
    AwaitMarks,
    Established,
    Closed,
}

/// A Block frame's block, verified, decoded and its records hashed by the driver, off the
/// task that drives the receiver: decoding is most of the per-block CPU, and a driver can run
/// it on worker threads for several blocks at once. Feed it with
/// [`Receiver::handle_decoded_block`]; the outcome is exactly that of the Block frame.
#[derive(Debug, Clone)]
pub struct DecodedBlock {
    pub header: BlockHeader,
    pub block: Vec<u8>,
    /// All records of the block.
    pub records: Vec<Record>,
    /// `record_hash(header.first_seq + k, records[k])` for every k.
    pub hashes: Vec<u64>,
}

impl DecodedBlock {
    /// Verifies and decodes `block` within `limits`, and hashes its records. CPU-heavy: meant
    /// for a worker thread. The error is what the receiver would report for the frame.
    /// `records` is a buffer to decode into: records it already holds are decoded over, which
    /// reuses their allocations ([`block::decode_block_into`]).
    pub fn decode(
        block: Vec<u8>,
        limits: &DecodeLimits,
        records: Vec<Record>,
    ) -> Result<DecodedBlock, block::BlockError> {
        let sized = block::size_block(&block, limits)?;
        DecodedBlock::from_sized(block, &sized, records)
    }

    /// As [`DecodedBlock::decode`], for a block already sized by [`block::size_block`] (so
    /// that the driver could reserve memory for its decoded size first).
    pub fn from_sized(
        block: Vec<u8>,
        sized: &block::SizedBlock,
        mut records: Vec<Record>,
    ) -> Result<DecodedBlock, block::BlockError> {
        let header = sized.decode_into(&mut records)?;
        let mut hashes = Vec::with_capacity(records.len());
        record_hashes_into(header.first_seq, &records, &mut hashes);
        Ok(DecodedBlock {
            header,
            block,
            records,
            hashes,
        })
    }
}

/// The code a block that fails to decode is refused with: [`ErrorCode::DecodedTooLarge`] when
/// its records would exceed the decoded-size limit, else [`ErrorCode::BadBlock`].
pub fn block_error_code(e: &block::BlockError) -> ErrorCode {
    match e {
        block::BlockError::DecodedTooLarge { .. } => ErrorCode::DecodedTooLarge,
        _ => ErrorCode::BadBlock,
    }
}

/// Records and hashes decoded ahead of time (see [`DecodedBlock`]).
#[derive(Debug)]
struct PreDecoded {
    records: Vec<Record>,
    hashes: Vec<u64>,
}

/// A received Block or Gap, before it is committed.
#[derive(Debug)]
enum Item {
    Block {
        header: BlockHeader,
        block: Vec<u8>,
        /// Present when the driver decoded the block; dropped while the item waits in the
        /// reorder buffer, which is bounded by encoded bytes (it is decoded again then).
        pre: Option<Box<PreDecoded>>,
    },
    Gap(GapMarker),
}

impl Item {
    fn range(&self) -> (u64, u64) {
        match self {
            Item::Block { header, .. } => (header.first_seq, header.last_seq()),
            Item::Gap(g) => (g.first_seq, g.last_seq),
        }
    }

    fn bytes(&self) -> u64 {
        match self {
            Item::Block { block, .. } => block.len() as u64,
            Item::Gap(_) => 0,
        }
    }
}

/// A partly summed stored range, carried across consecutive blocks with other boundaries.
#[derive(Debug, Clone, Copy)]
struct Carry {
    range_first: u64,
    next: u64,
    sum: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verify {
    Ok,
    Fenced,
    /// Stored checksums must be fetched from this seq on before going further.
    Refill(u64),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Check {
    Pending,
    Matched(Stored),
    Mismatch(Stored),
    /// The hub holds these seqs as a gap.
    Lost(Stored),
    Unknown,
}

/// A committed range as the receiver remembers it: records with their checksum, or a gap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stored {
    first_seq: u64,
    last_seq: u64,
    checksum: Option<u64>,
}

/// A lane the hub is ahead of: the edge's copy was restored or cloned. Its blocks are only
/// compared, never committed, and the hub answers with how far they match (Verdict).
#[derive(Debug, Clone, Copy)]
struct Behind {
    held_last: u64,
    /// The last seq the edge holds as data (`held_last` minus trailing gap markers): once an
    /// item reaching it is compared, the Verdict is final.
    data_last: u64,
    matched_through: u64,
    /// The seq after the last block compared in order; a block starting later is a late
    /// duplicate, not part of the comparison.
    next: u64,
    done: bool,
    verdict_sent: bool,
}

#[derive(Debug)]
struct Lane {
    stream: String,
    epoch: u64,
    loaded: bool,
    announced: Option<LaneAnnounce>,
    mark: u64,
    tiered: u64,
    /// Highest seq handed to the driver (committed or pending).
    frontier: u64,
    ring: VecDeque<Stored>,
    carry: Option<Carry>,
    /// Items waiting, by first seq, and whether each is parked (see [`Receiver::park`]).
    /// Keyed by (first seq, arrival number): parked duplicates may share a first seq.
    reorder: BTreeMap<(u64, u64), (Item, bool)>,
    /// Commits handed out and not yet outcome-known: (last_seq, bytes, still counted as
    /// held). A refusal stops counting them at once (see [`Receiver::refuse_stream`]).
    pending: VecDeque<(u64, u64, bool)>,
    /// The stream is refused: nothing of this lane is committed until the refusal lapses.
    refused: bool,
    ack_dirty: bool,
    behind: Option<Behind>,
    /// `checksums_from` of the last lookup: a refill must ask for later ones.
    fetched_from: u64,
    /// Waiting for more stored checksums; marks and frontier are already known.
    refilling: bool,
    /// The block ending at the mark is still to be compared: blocks past the mark wait, so
    /// that a diverged history is fenced before any of it is committed.
    junction: bool,
}

impl Lane {
    fn new(stream: String, epoch: u64, announced: Option<LaneAnnounce>) -> Self {
        Lane {
            stream,
            epoch,
            loaded: false,
            announced,
            mark: 0,
            tiered: 0,
            frontier: 0,
            ring: VecDeque::new(),
            carry: None,
            reorder: BTreeMap::new(),
            pending: VecDeque::new(),
            refused: false,
            ack_dirty: false,
            behind: None,
            fetched_from: 0,
            refilling: false,
            junction: false,
        }
    }

    /// Where verification starts for this lane: the first seq the edge may not share with us.
    fn verify_from(&self) -> u64 {
        match &self.announced {
            Some(a) => a
                .acked_seq
                .max(a.first_seq.saturating_sub(1))
                .saturating_add(1),
            None => 1,
        }
    }

    fn remember(&mut self, stored: Stored, cap: usize) {
        self.ring.push_back(stored);
        if self.ring.len() > cap.max(1) {
            self.ring.pop_front();
        }
    }

    /// In a lane the hub is ahead of, seqs the edge itself recorded as lost need no
    /// comparison: the match extends over them.
    fn skip_own_gaps(&mut self) {
        let (Some(b), Some(a)) = (self.behind.as_mut(), self.announced.as_ref()) else {
            return;
        };
        while let Some(g) = a
            .gaps
            .iter()
            .find(|g| g.first_seq <= b.matched_through + 1 && b.matched_through < g.last_seq)
        {
            b.matched_through = g.last_seq.min(b.held_last);
            if b.matched_through == b.held_last {
                return;
            }
        }
    }

    /// Feeds one overlapping record into the stored-range comparison.
    fn check_record(&mut self, seq: u64, hash: u64) -> Check {
        let idx = self.ring.partition_point(|r| r.last_seq < seq);
        let Some(&r) = self.ring.get(idx).filter(|r| r.first_seq <= seq) else {
            self.carry = None;
            return Check::Unknown;
        };
        let Some(checksum) = r.checksum else {
            self.carry = None;
            return Check::Lost(r);
        };
        let carry = match self.carry {
            Some(c) if c.range_first == r.first_seq && c.next == seq => Carry {
                next: seq + 1,
                sum: c.sum.wrapping_add(hash),
                ..c
            },
            _ if seq == r.first_seq => Carry {
                range_first: seq,
                next: seq + 1,
                sum: hash,
            },
            _ => {
                self.carry = None;
                return Check::Unknown;
            }
        };
        if carry.next <= r.last_seq {
            self.carry = Some(carry);
            return Check::Pending;
        }
        self.carry = None;
        if carry.sum == checksum {
            Check::Matched(r)
        } else {
            Check::Mismatch(r)
        }
    }
}

/// The hub side of one connection.
#[derive(Debug)]
pub struct Receiver {
    device: String,
    config: ReceiverConfig,
    phase: Phase,
    version: u16,
    current_epoch: u64,
    epoch_max: u64,
    now: Instant,
    live: Liveness,
    lanes: Vec<Lane>,
    index: HashMap<(String, u64), usize>,
    /// Outstanding NeedMarks queries, oldest first: the lanes each covers.
    queries: VecDeque<Vec<usize>>,
    held_bytes: u64,
    held_items: u64,
    parked_bytes: u64,
    parked_items: u64,
    /// Numbers held items in arrival order.
    arrivals: u64,
    transmits: VecDeque<Transmit>,
    events: VecDeque<ReceiverEvent>,
    stats: ReceiverStats,
    /// The edge's Hello capability bits.
    capabilities: u64,
    /// Refused streams, until when.
    refused: HashMap<String, Instant>,
}

impl Receiver {
    /// A receiver for a connection from `device`, the subject CN of its client certificate.
    pub fn new(device: String, config: ReceiverConfig, now: Instant) -> Self {
        let live = Liveness::new(config.timeouts, now);
        Receiver {
            device,
            config,
            phase: Phase::AwaitHello,
            version: 0,
            current_epoch: 0,
            epoch_max: 0,
            now,
            live,
            lanes: Vec::new(),
            index: HashMap::new(),
            queries: VecDeque::new(),
            held_bytes: 0,
            held_items: 0,
            parked_bytes: 0,
            parked_items: 0,
            arrivals: 0,
            transmits: VecDeque::new(),
            events: VecDeque::new(),
            stats: ReceiverStats::default(),
            capabilities: 0,
            refused: HashMap::new(),
        }
    }

    /// The device this connection belongs to.
    pub fn device(&self) -> &str {
        &self.device
    }

    /// The agreed version, once established.
    pub fn version(&self) -> Option<u16> {
        (self.version != 0).then_some(self.version)
    }

    pub fn is_established(&self) -> bool {
        self.phase == Phase::Established
    }

    pub fn is_closed(&self) -> bool {
        self.phase == Phase::Closed
    }

    pub fn stats(&self) -> ReceiverStats {
        self.stats
    }

    /// Block bytes held by this connection (reorder buffer plus uncommitted).
    pub fn held_bytes(&self) -> u64 {
        self.held_bytes
    }

    /// Feeds one complete frame (length prefix included).
    pub fn handle_frame(&mut self, now: Instant, bytes: &[u8]) {
        if self.phase == Phase::Closed {
            return;
        }
        self.now = now;
        self.live.last_rx = now;
        match Frame::decode(bytes, self.config.frame_bytes_max) {
            Ok(frame) => self.on_frame(frame),
            Err(e) => self.on_decode_error(bytes, e),
        }
        self.flush_acks();
    }

    /// Feeds a Block frame whose block the driver already verified and decoded with
    /// [`DecodedBlock::decode`] (for `stream`, as the frame named it). Equivalent to
    /// [`Receiver::handle_frame`] with that frame, without decoding here.
    pub fn handle_decoded_block(&mut self, now: Instant, stream: String, d: DecodedBlock) {
        if self.phase == Phase::Closed {
            return;
        }
        self.now = now;
        self.live.last_rx = now;
        if self.phase != Phase::Established {
            let msg = format!("unexpected Block frame in state {:?}", self.phase);
            return self.close(self.now, ErrorCode::ProtocolViolation, &msg);
        }
        let ok = d.hashes.len() == d.records.len()
            && d.records.len() as u64 == u64::from(d.header.count);
        let pre = ok.then(|| {
            Box::new(PreDecoded {
                records: d.records,
                hashes: d.hashes,
            })
        });
        let item = Item::Block {
            header: d.header,
            block: d.block,
            pre,
        };
        self.on_item(stream, d.header.epoch, item);
        self.flush_acks();
    }

    fn on_decode_error(&mut self, bytes: &[u8], e: FrameError) {
        // A Hello from a newer version may not decode here, but its version range does.
        let versions = (self.phase == Phase::AwaitHello)
            .then(|| hello_versions(bytes))
            .flatten();
        if let Some((min, max)) = versions
            && !self.negotiate(min, max)
        {
            return;
        }
        let code = match e {
            FrameError::TooLarge { .. } => ErrorCode::FrameTooLarge,
            _ => ErrorCode::ProtocolViolation,
        };
        self.close(self.now, code, &e.to_string());
    }

    fn on_frame(&mut self, frame: Frame) {
        match (self.phase, frame) {
            (_, Frame::Error(e)) => self.closed_by_peer(e),
            (_, Frame::Ping) => {}
            (Phase::AwaitHello, Frame::Hello(h)) => self.on_hello(h),
            (Phase::Established, Frame::Block { stream, block }) => self.on_block(stream, block),
            (Phase::Established, Frame::Gap { stream, epoch, gap }) => {
                self.on_item(stream, epoch, Item::Gap(gap))
            }
            (Phase::Established, Frame::Backlog(entries)) => {
                self.events.push_back(ReceiverEvent::Backlog {
                    entries,
                    received_at: self.now,
                })
            }
            (phase, f) => {
                let msg = format!("unexpected {} frame in state {phase:?}", f.name());
                self.close(self.now, ErrorCode::ProtocolViolation, &msg);
            }
        }
    }

    /// Picks the highest common version, or refuses. Returns whether one was agreed.
    fn negotiate(&mut self, min: u16, max: u16) -> bool {
        let v = max.min(self.config.version_max);
        if v < min.max(self.config.version_min) || min > max {
            let msg = format!(
                "edge speaks versions {min}..={max}, hub speaks {}..={}",
                self.config.version_min, self.config.version_max
            );
            self.close(self.now, ErrorCode::UnsupportedVersion, &msg);
            return false;
        }
        self.version = v;
        true
    }

    fn on_hello(&mut self, h: Hello) {
        if !self.negotiate(h.version_min, h.version_max) {
            return;
        }
        if h.lanes.len() > self.config.lanes_max {
            let msg = format!("{} lanes, limit {}", h.lanes.len(), self.config.lanes_max);
            return self.close(self.now, ErrorCode::LimitExceeded, &msg);
        }
        self.current_epoch = h.current_epoch;
        self.capabilities = h.capabilities;
        let mut query = Vec::with_capacity(h.lanes.len());
        for a in h.lanes {
            if a.last_seq > SEQ_MAX || a.acked_seq > SEQ_MAX {
                let msg = format!(
                    "lane {}/{} announces seqs past {SEQ_MAX}",
                    a.stream, a.epoch
                );
                return self.close(self.now, ErrorCode::ProtocolViolation, &msg);
            }
            let key = (a.stream.clone(), a.epoch);
            if self.index.contains_key(&key) {
                let msg = format!("lane {}/{} announced twice", a.stream, a.epoch);
                return self.close(self.now, ErrorCode::ProtocolViolation, &msg);
            }
            query.push(self.add_lane(a.stream.clone(), a.epoch, Some(a)));
        }
        self.phase = Phase::AwaitMarks;
        self.ask_marks(query);
    }

    fn add_lane(&mut self, stream: String, epoch: u64, announced: Option<LaneAnnounce>) -> usize {
        let i = self.lanes.len();
        self.index.insert((stream.clone(), epoch), i);
        self.lanes.push(Lane::new(stream, epoch, announced));
        i
    }

    fn ask_marks(&mut self, lanes: Vec<usize>) {
        let queries = lanes
            .iter()
            .map(|&i| {
                let l = &self.lanes[i];
                MarksQuery {
                    stream: l.stream.clone(),
                    epoch: l.epoch,
                    checksums_from: l.verify_from(),
                }
            })
            .collect();
        self.queries.push_back(lanes);
        let ev = ReceiverEvent::NeedMarks {
            current_epoch: self.current_epoch,
            lanes: queries,
        };
        self.events.push_back(ev);
    }

    /// The driver's answer to the oldest unanswered [`ReceiverEvent::NeedMarks`].
    pub fn marks_loaded(&mut self, now: Instant, marks: Marks) {
        if self.phase == Phase::Closed {
            return;
        }
        self.now = now;
        let Some(asked) = self.queries.pop_front() else {
            return self.close(now, ErrorCode::Internal, "marks loaded without a query");
        };
        self.epoch_max = self.epoch_max.max(marks.epoch_max);
        let hello_answer = self.phase == Phase::AwaitMarks;
        for m in marks.lanes {
            let i = match self.index.get(&(m.stream.clone(), m.epoch)) {
                Some(&i) if asked.contains(&i) => i,
                // The hub knows a lane of the current epoch the edge did not announce.
                None if hello_answer && m.epoch == self.current_epoch && m.durable_seq > 0 => {
                    self.add_lane(m.stream.clone(), m.epoch, None)
                }
                _ => continue,
            };
            self.load_lane(i, m);
        }
        for &i in &asked {
            self.lanes[i].loaded = true;
            self.lanes[i].refilling = false;
        }
        if hello_answer {
            self.welcome();
        } else {
            for i in asked {
                self.drain_lane(i);
            }
        }
        self.flush_acks();
    }

    fn load_lane(&mut self, i: usize, m: LaneMarks) {
        let cap = self.config.checksum_ranges_max.max(1);
        let lane = &mut self.lanes[i];
        if lane.refilling {
            // Only the checksums are new; marks and the frontier are this session's own.
            lane.ring = capped_ranges(m.ranges, m.gaps, lane.mark, cap).into();
            return;
        }
        lane.fetched_from = lane.verify_from();
        lane.mark = m.durable_seq;
        lane.frontier = m.durable_seq;
        lane.tiered = m.tiered_seq;
        lane.ring = capped_ranges(m.ranges, m.gaps, m.durable_seq, cap).into();
        lane.loaded = true;
        let held_last = lane.announced.as_ref().map_or(0, |a| a.last_seq);
        if lane.mark > held_last && (lane.announced.is_some() || lane.epoch == self.current_epoch) {
            let start = lane.verify_from() - 1;
            let mut data_last = held_last;
            let gaps = lane.announced.as_ref().map_or(&[][..], |a| &a.gaps[..]);
            while let Some(g) = gaps
                .iter()
                .find(|g| g.first_seq <= data_last && data_last <= g.last_seq)
            {
                data_last = g.first_seq - 1;
            }
            lane.behind = Some(Behind {
                held_last,
                data_last,
                matched_through: start.min(held_last),
                next: start.min(held_last) + 1,
                done: false,
                verdict_sent: false,
            });
        }
    }

    fn welcome(&mut self) {
        let lanes = self
            .lanes
            .iter_mut()
            .map(|l| {
                let resume_from = match (&l.behind, l.ring.back()) {
                    (Some(b), _) => b.matched_through + 1,
                    (None, Some(r)) if r.last_seq == l.mark && r.checksum.is_some() => r.first_seq,
                    _ => l.mark + 1,
                };
                l.junction = l.behind.is_none() && resume_from <= l.mark;
                let w = LaneWelcome {
                    durable_seq: l.mark,
                    tiered_seq: l.tiered,
                    resume_from,
                };
                (l.stream.clone(), l.epoch, w)
            })
            .collect();
        let welcome = Welcome {
            version: self.version,
            window_bytes: self.config.window_bytes,
            window_items: self.config.window_items,
            epoch_max: self.epoch_max,
            lanes,
        };
        self.push(Frame::Welcome(welcome), TransmitKind::Control);
        self.phase = Phase::Established;
        self.events.push_back(ReceiverEvent::Established {
            version: self.version,
            current_epoch: self.current_epoch,
        });
        for i in 0..self.lanes.len() {
            self.maybe_verdict(i);
        }
    }

    fn on_block(&mut self, stream: String, block: Vec<u8>) {
        match block::verify_block(&block, &self.config.decode_limits) {
            Ok(header) => {
                let item = Item::Block {
                    header,
                    block,
                    pre: None,
                };
                self.on_item(stream, header.epoch, item)
            }
            Err(e) => self.close(
                self.now,
                ErrorCode::BadBlock,
                &format!("stream {stream}: {e}"),
            ),
        }
    }

    fn on_item(&mut self, stream: String, epoch: u64, item: Item) {
        let (first, last) = item.range();
        if last > SEQ_MAX {
            let msg = format!("{stream}/{epoch}: seqs {first}..={last} reach past {SEQ_MAX}");
            return self.close(self.now, ErrorCode::ProtocolViolation, &msg);
        }
        if self.drops_refused(&stream, epoch) {
            self.stats.refused_items_dropped += 1;
            return;
        }
        let i = match self.index.get(&(stream.clone(), epoch)) {
            Some(&i) => i,
            None => {
                if self.lanes.len() >= self.config.lanes_max {
                    let msg = format!("more than {} lanes", self.config.lanes_max);
                    return self.close(self.now, ErrorCode::LimitExceeded, &msg);
                }
                let i = self.add_lane(stream, epoch, None);
                self.ask_marks(vec![i]);
                i
            }
        };
        let lane = &self.lanes[i];
        let (loaded, frontier) = (lane.loaded, lane.frontier);
        let wait = !loaded || first > frontier + 1 || (lane.junction && first > lane.mark);
        // Blocks the hub already holds that arrive while more checksums are being fetched.
        let parked = lane.refilling && last <= lane.mark;
        if parked {
            if self.park_allows(item.bytes()) {
                self.hold(i, item, true);
            }
            return;
        }
        if (wait || last > frontier) && !self.admit(item.bytes()) {
            return;
        }
        if wait {
            return self.hold(i, item, false);
        }
        self.process(i, item);
        self.drain_lane(i);
    }

    /// The flow-control check: what this connection holds must stay within the window it
    /// advertised, except that a single item is always admitted (a block larger than the
    /// window can still make progress).
    fn admit(&mut self, bytes: u64) -> bool {
        let over = self.held_bytes + bytes > self.config.window_bytes
            || self.held_items + 1 > self.config.window_items;
        if over && self.held_items > 0 {
            let msg = format!(
                "window exceeded: {} bytes in {} items held, {} more, window {} bytes / {} items",
                self.held_bytes,
                self.held_items,
                bytes,
                self.config.window_bytes,
                self.config.window_items
            );
            self.close(self.now, ErrorCode::FlowControl, &msg);
            return false;
        }
        true
    }

    fn hold(&mut self, i: usize, mut item: Item, parked: bool) {
        if let Item::Block { pre, .. } = &mut item {
            *pre = None;
        }
        let (first, _) = item.range();
        let bytes = item.bytes();
        self.arrivals += 1;
        let lane = &mut self.lanes[i];
        let mut same_start = lane
            .reorder
            .range((first, 0)..=(first, u64::MAX))
            .map(|(_, v)| v);
        if let Some((prev, _)) = same_start.find(|(_, p)| !p && !parked) {
            if same_item(prev, &item) {
                return;
            }
            let msg = format!(
                "two different items start at seq {first} of {}/{}",
                lane.stream, lane.epoch
            );
            return self.close(self.now, ErrorCode::ProtocolViolation, &msg);
        }
        lane.reorder.insert((first, self.arrivals), (item, parked));
        if parked {
            self.parked_bytes += bytes;
            self.parked_items += 1;
        } else {
            self.add_held(bytes);
        }
    }

    /// Parked blocks are ones the hub already holds, waiting while a lane fetches more stored
    /// checksums. The edge may count them as acknowledged already (an Ack covers everything up
    /// to the mark), so they sit outside the window, under their own bound: acks for the lane
    /// stop while it waits, so at most two windows' worth can be in flight.
    fn park_allows(&mut self, bytes: u64) -> bool {
        let over = self.parked_bytes + bytes > 2 * self.config.window_bytes
            || self.parked_items + 1 > 2 * self.config.window_items + 1;
        if over {
            let msg = format!(
                "{} blocks parked during a checksum lookup",
                self.parked_items + 1
            );
            self.close(self.now, ErrorCode::FlowControl, &msg);
        }
        !over
    }

    fn add_held(&mut self, bytes: u64) {
        self.held_bytes += bytes;
        self.held_items += 1;
        self.stats.held_bytes_peak = self.stats.held_bytes_peak.max(self.held_bytes);
    }

    fn drain_lane(&mut self, i: usize) {
        while self.phase == Phase::Established {
            let lane = &mut self.lanes[i];
            if !lane.loaded {
                return;
            }
            let (frontier, mark, junction) = (lane.frontier, lane.mark, lane.junction);
            let Some(entry) = lane.reorder.first_entry() else {
                return;
            };
            let first = entry.key().0;
            if first > frontier + 1 || (junction && first > mark) {
                return;
            }
            let (item, parked) = entry.remove();
            if parked {
                self.parked_bytes -= item.bytes();
                self.parked_items -= 1;
            } else {
                self.held_bytes -= item.bytes();
                self.held_items -= 1;
            }
            self.process(i, item);
        }
    }

    /// Handles an item that starts at or below the frontier + 1: verify the part the hub
    /// already holds, then commit the rest.
    fn process(&mut self, i: usize, item: Item) {
        let (_, last) = item.range();
        let reaches_mark = last >= self.lanes[i].mark;
        match item {
            Item::Block { header, block, pre } => self.process_block(i, header, block, pre),
            Item::Gap(g) => self.process_gap(i, g),
        }
        if reaches_mark && self.lanes[i].junction && self.phase == Phase::Established {
            self.lanes[i].junction = false;
            self.lanes[i].ack_dirty = true;
            self.drain_lane(i);
        }
    }

    fn process_gap(&mut self, i: usize, g: GapMarker) {
        let lane = &mut self.lanes[i];
        if let Some(b) = lane.behind.as_mut() {
            // The edge holds nothing there, so nothing there needs comparing.
            if !b.done && g.first_seq <= b.matched_through + 1 {
                b.matched_through = b.matched_through.max(g.last_seq.min(b.held_last));
            }
            if g.first_seq <= b.next {
                b.next = b.next.max(g.last_seq + 1);
            }
            b.done |= g.last_seq >= b.data_last;
            lane.ack_dirty = true;
            return self.maybe_verdict(i);
        }
        let Some(clipped) = g.clip_from(lane.frontier + 1) else {
            lane.ack_dirty |= g.last_seq <= lane.mark;
            return;
        };
        lane.frontier = clipped.last_seq;
        let stored = Stored {
            first_seq: clipped.first_seq,
            last_seq: clipped.last_seq,
            checksum: None,
        };
        lane.remember(stored, self.config.checksum_ranges_max);
        lane.pending.push_back((clipped.last_seq, 0, true));
        let (stream, epoch) = (lane.stream.clone(), lane.epoch);
        self.add_held(0);
        self.stats.gaps_committed += 1;
        self.events.push_back(ReceiverEvent::Commit {
            stream,
            epoch,
            item: CommitItem::Gap(clipped),
        });
    }

    fn process_block(
        &mut self,
        i: usize,
        header: BlockHeader,
        block: Vec<u8>,
        pre: Option<Box<PreDecoded>>,
    ) {
        let (records, hashes) = match pre {
            Some(p) => (p.records, p.hashes),
            None => match block::decode_block(&block, &self.config.decode_limits) {
                Ok(b) => {
                    let hashes = b
                        .records
                        .iter()
                        .enumerate()
                        .map(|(k, r)| record_hash(header.first_seq + k as u64, r))
                        .collect();
                    (b.records, hashes)
                }
                Err(e) => {
                    let msg = format!("stream {}: {e}", self.lanes[i].stream);
                    return self.close(self.now, block_error_code(&e), &msg);
                }
            },
        };
        let first = header.first_seq;
        if self.lanes[i].behind.is_some_and(|b| first > b.next) {
            // Not the next block of the comparison (a late duplicate): it proves nothing.
            let lane = &mut self.lanes[i];
            if header.last_seq() > lane.frontier {
                let msg = format!(
                    "block past the mark of {}/{}, whose history the hub is ahead of",
                    lane.stream, lane.epoch
                );
                return self.close(self.now, ErrorCode::ProtocolViolation, &msg);
            }
            lane.ack_dirty = true;
            self.stats.replays += 1;
            return;
        }
        match self.verify_overlap(i, first, &hashes) {
            Verify::Ok => {}
            Verify::Fenced => return,
            Verify::Refill(from) => {
                let item = Item::Block {
                    header,
                    block,
                    pre: None,
                };
                return self.refill(i, from, item);
            }
        }
        let lane = &mut self.lanes[i];
        if header.last_seq() <= lane.frontier {
            lane.ack_dirty |= header.last_seq() <= lane.mark;
            self.stats.replays += 1;
            if let Some(b) = lane.behind.as_mut() {
                b.next = b.next.max(header.last_seq() + 1);
                // Everything the edge holds has been compared.
                b.done |= header.last_seq() >= b.data_last;
            }
            return self.maybe_verdict(i);
        }
        if lane.behind.is_some() {
            let msg = format!(
                "block past the mark of {}/{}, whose history the hub is ahead of",
                lane.stream, lane.epoch
            );
            return self.close(self.now, ErrorCode::ProtocolViolation, &msg);
        }
        let skip_through = lane.frontier;
        let skip = (skip_through + 1 - first) as usize;
        let sum = hashes[skip..].iter().fold(0u64, |a, h| a.wrapping_add(*h));
        let checksum = RangeChecksum {
            first_seq: skip_through + 1,
            last_seq: header.last_seq(),
            checksum: sum,
        };
        let mut records = records;
        records.drain(..skip);
        lane.frontier = header.last_seq();
        lane.remember(
            Stored {
                first_seq: checksum.first_seq,
                last_seq: checksum.last_seq,
                checksum: Some(sum),
            },
            self.config.checksum_ranges_max,
        );
        lane.pending
            .push_back((header.last_seq(), block.len() as u64, true));
        let (stream, epoch) = (lane.stream.clone(), lane.epoch);
        self.add_held(block.len() as u64);
        self.stats.blocks_committed += 1;
        let item = CommitItem::Block {
            header,
            block,
            skip_through,
            records,
            checksum,
        };
        self.events.push_back(ReceiverEvent::Commit {
            stream,
            epoch,
            item,
        });
    }

    /// Compares the records at or below the frontier with the stored ranges. Returns false
    /// (and fences) on a conflict.
    fn verify_overlap(&mut self, i: usize, first: u64, hashes: &[u64]) -> Verify {
        let lane = &mut self.lanes[i];
        // A block that does not continue a partly compared range (a late duplicate) is
        // compared on its own, so it cannot break the comparison in progress.
        let saved = match lane.carry {
            Some(c) if c.next != first => lane.carry.take(),
            _ => None,
        };
        let verdict = self.verify_records(i, first, hashes);
        if saved.is_some() {
            self.lanes[i].carry = saved;
        }
        verdict
    }

    fn verify_records(&mut self, i: usize, first: u64, hashes: &[u64]) -> Verify {
        let lane = &mut self.lanes[i];
        for (k, &h) in hashes.iter().enumerate() {
            let seq = first + k as u64;
            if seq > lane.frontier {
                break;
            }
            lane.skip_own_gaps();
            let check = lane.check_record(seq, h);
            match (check, lane.behind.as_mut()) {
                (Check::Pending, _) => {}
                (Check::Matched(r), Some(b)) if !b.done && r.first_seq == b.matched_through + 1 => {
                    b.matched_through = r.last_seq;
                    self.stats.ranges_verified += 1;
                }
                (Check::Matched(_), None) => self.stats.ranges_verified += 1,
                (Check::Mismatch(r), None) => {
                    let (stream, epoch) = (lane.stream.clone(), lane.epoch);
                    self.fence(stream, epoch, r);
                    return Verify::Fenced;
                }
                (Check::Unknown | Check::Lost(_), None) => self.stats.records_unverified += 1,
                // Seqs the hub holds as lost neither confirm nor contradict the edge's copy.
                (Check::Lost(r), Some(b)) if !b.done && seq == b.matched_through + 1 => {
                    b.matched_through = r.last_seq;
                }
                // The loaded checksums ran out: fetch the next ones rather than give up.
                (Check::Unknown, Some(b))
                    if !b.done && seq == b.matched_through + 1 && seq > lane.fetched_from =>
                {
                    return Verify::Refill(seq);
                }
                // In a lane the hub is ahead of, the first record not confirmed ends the match.
                (_, Some(b)) => {
                    if seq > b.matched_through {
                        b.done = true;
                    }
                }
            }
        }
        Verify::Ok
    }

    /// Holds `item` and asks the driver for the stored checksums from `from` on; the lane
    /// resumes when [`Receiver::marks_loaded`] answers.
    fn refill(&mut self, i: usize, from: u64, item: Item) {
        self.arrivals += 1;
        let bytes = item.bytes();
        let lane = &mut self.lanes[i];
        lane.fetched_from = from;
        lane.loaded = false;
        lane.refilling = true;
        lane.reorder
            .insert((item.range().0, self.arrivals), (item, true));
        let query = MarksQuery {
            stream: lane.stream.clone(),
            epoch: lane.epoch,
            checksums_from: from,
        };
        self.parked_bytes += bytes;
        self.parked_items += 1;
        self.queries.push_back(vec![i]);
        let ev = ReceiverEvent::NeedMarks {
            current_epoch: self.current_epoch,
            lanes: vec![query],
        };
        self.events.push_back(ev);
    }

    fn maybe_verdict(&mut self, i: usize) {
        let lane = &mut self.lanes[i];
        lane.skip_own_gaps();
        let Some(b) = lane.behind.as_mut() else {
            return;
        };
        if b.matched_through >= b.held_last {
            b.done = true;
        }
        if !b.done || b.verdict_sent {
            return;
        }
        b.verdict_sent = true;
        let matched_through = b.matched_through;
        let frame = Frame::Verdict {
            stream: lane.stream.clone(),
            epoch: lane.epoch,
            matched_through,
        };
        self.push(frame, TransmitKind::Control);
    }

    fn fence(&mut self, stream: String, epoch: u64, r: Stored) {
        let msg = format!(
            "device {} sent seqs {}..={} of {stream}/{epoch} with content different from what the hub committed",
            self.device, r.first_seq, r.last_seq
        );
        self.events.push_back(ReceiverEvent::Fenced {
            stream,
            epoch,
            first_seq: r.first_seq,
            last_seq: r.last_seq,
        });
        self.close(self.now, ErrorCode::ConflictFenced, &msg);
    }

    /// The driver made everything up to `durable_seq` of the lane durable (log fsync and
    /// catalog commit both done). `tiered_seq` is the lane's tier-2 mark (0 until tiering).
    ///
    /// `durable_seq` is the lane's mark in the hub, so it can exceed what this session handed
    /// out: another session of the same device identity (a clone, or the previous connection
    /// whose commits were still landing when this one loaded its marks) committed past this
    /// session's frontier. A peer can cause that, so it is no assertion: this session's view of
    /// the lane is stale (what lies past its frontier would go unverified), and it is closed
    /// with `PROTOCOL_VIOLATION`; the device reconnects and resumes from the new mark.
    pub fn committed(
        &mut self,
        now: Instant,
        stream: &str,
        epoch: u64,
        durable_seq: u64,
        tiered_seq: u64,
    ) {
        if self.phase == Phase::Closed {
            return;
        }
        self.now = now;
        let Some(&i) = self.index.get(&(stream.to_owned(), epoch)) else {
            return;
        };
        let lane = &mut self.lanes[i];
        if durable_seq > lane.frontier {
            let msg = format!(
                "{stream}/{epoch} became durable through {durable_seq}, past this session's {}: \
                 another session of device {} committed it; reconnect",
                lane.frontier, self.device
            );
            return self.close(now, ErrorCode::ProtocolViolation, &msg);
        }
        if durable_seq > lane.mark {
            lane.mark = durable_seq;
            lane.ack_dirty = true;
        }
        while let Some(&(last, bytes, counted)) = lane.pending.front() {
            if last > durable_seq {
                break;
            }
            lane.pending.pop_front();
            if !counted {
                continue;
            }
            // Only this machine's own bookkeeping can break this.
            assert!(
                self.held_items > 0 && self.held_bytes >= bytes,
                "held accounting: {} items, {} bytes, releasing {bytes}",
                self.held_items,
                self.held_bytes
            );
            self.held_bytes -= bytes;
            self.held_items -= 1;
        }
        self.set_tiered(i, tiered_seq);
        self.rewind_if_settled(i);
        self.flush_acks();
    }

    /// A later tier-2 update for a lane of this connection; sends an Ack carrying it.
    pub fn update_tiered(&mut self, now: Instant, stream: &str, epoch: u64, tiered_seq: u64) {
        if self.phase != Phase::Established {
            return;
        }
        self.now = now;
        if let Some(&i) = self.index.get(&(stream.to_owned(), epoch)) {
            self.set_tiered(i, tiered_seq);
            self.flush_acks();
        }
    }

    fn set_tiered(&mut self, i: usize, tiered_seq: u64) {
        let lane = &mut self.lanes[i];
        if tiered_seq > lane.tiered {
            lane.tiered = tiered_seq;
            lane.ack_dirty = true;
        }
    }

    fn flush_acks(&mut self) {
        if self.phase != Phase::Established {
            return;
        }
        for i in 0..self.lanes.len() {
            let lane = &mut self.lanes[i];
            // An Ack vouches for the edge's copy up to the mark, which the junction check has
            // not confirmed yet.
            if !lane.ack_dirty || lane.junction || !lane.loaded {
                continue;
            }
            lane.ack_dirty = false;
            let frame = Frame::Ack {
                stream: lane.stream.clone(),
                epoch: lane.epoch,
                durable_seq: lane.mark,
                tiered_seq: lane.tiered,
            };
            self.push(frame, TransmitKind::Control);
        }
    }

    /// Fires the idle timeout and keepalive.
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.phase == Phase::Closed {
            return;
        }
        self.now = now;
        if now >= self.live.idle_deadline() {
            let msg = format!("nothing received for {:?}", self.config.timeouts.idle);
            return self.close(now, ErrorCode::IdleTimeout, &msg);
        }
        if now >= self.live.keepalive_deadline() {
            self.push(Frame::Ping, TransmitKind::Control);
        }
    }

    /// When to call [`Receiver::handle_timeout`] next.
    pub fn poll_timeout(&self) -> Option<Instant> {
        (self.phase != Phase::Closed).then(|| {
            self.live
                .idle_deadline()
                .min(self.live.keepalive_deadline())
        })
    }

    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        self.transmits.pop_front()
    }

    pub fn poll_event(&mut self) -> Option<ReceiverEvent> {
        self.events.pop_front()
    }

    /// Ends the session from the hub's side (shutdown, revocation, refused stream, store
    /// failure): queues an Error frame and a [`ReceiverEvent::Closed`].
    pub fn close(&mut self, now: Instant, code: ErrorCode, message: &str) {
        if self.phase == Phase::Closed {
            return;
        }
        self.now = now;
        self.push(
            Frame::Error(ErrorFrame {
                code,
                message: message.to_owned(),
            }),
            TransmitKind::Control,
        );
        self.phase = Phase::Closed;
        let reason = CloseReason {
            code,
            message: message.to_owned(),
            by_peer: false,
        };
        self.events.push_back(ReceiverEvent::Closed(reason));
    }

    fn closed_by_peer(&mut self, e: ErrorFrame) {
        self.phase = Phase::Closed;
        let reason = CloseReason {
            code: e.code,
            message: e.message,
            by_peer: true,
        };
        self.events.push_back(ReceiverEvent::Closed(reason));
    }

    fn push(&mut self, frame: Frame, kind: TransmitKind) {
        self.live.last_tx = self.now;
        self.transmits.push_back(Transmit {
            frame: frame.encode(),
            kind,
        });
    }
}

/// Stored ranges at or below the mark, ascending, at most `cap`: the earliest ones (for
/// comparing a restored history) and always the one ending at the mark (the junction).
fn capped_ranges(
    ranges: Vec<RangeChecksum>,
    gaps: Vec<(u64, u64)>,
    mark: u64,
    cap: usize,
) -> Vec<Stored> {
    let sums = ranges.into_iter().map(|r| Stored {
        first_seq: r.first_seq,
        last_seq: r.last_seq,
        checksum: Some(r.checksum),
    });
    let lost = gaps.into_iter().map(|(first_seq, last_seq)| Stored {
        first_seq,
        last_seq,
        checksum: None,
    });
    let mut ranges: Vec<Stored> = sums
        .chain(lost)
        .filter(|r| r.first_seq <= r.last_seq && r.last_seq <= mark)
        .collect();
    ranges.sort_by_key(|r| r.first_seq);
    ranges.dedup_by_key(|r| r.first_seq);
    if ranges.len() > cap {
        let last = ranges[ranges.len() - 1];
        ranges.truncate(cap - 1);
        ranges.push(last);
    }
    ranges
}

fn same_item(a: &Item, b: &Item) -> bool {
    match (a, b) {
        (Item::Block { block: x, .. }, Item::Block { block: y, .. }) => x == y,
        (Item::Gap(x), Item::Gap(y)) => x == y,
        _ => false,
    }
}
