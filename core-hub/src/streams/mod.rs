//! Merged streams: the records of all devices for a stream, routed by key hash into
//! auto-scaling segments that index the tier-1 WAL (Pravega's stream model at the hub).
//!
//! - [`hash`]: the routing key hash and the per-block histogram ingest computes.
//! - [`graph`]: segments and their links, kept in the catalog.
//! - [`scaler`]: per-segment rates and split/merge decisions per the stream's policy.
//! - [`cut`]: stream cuts, printable positions in every segment.
//! - [`reader`]: reading a stream (or one segment) from a position, once or following.
//! - [`group`]: reader groups with checkpoints stored in the hub.
//! - [`api`]: the HTTP routes for all of the above.
//!
//! # How commits reach readers
//!
//! The WAL writer commits a group (fsync + catalog transaction), then hands the
//! [`StreamManager`] a [`CommittedGroup`] before completing the producers. The manager
//! attributes the blocks to segments, advances each stream's *readable end* and publishes a
//! new [`StreamSnapshot`] (graph + readable end) on a `watch` channel, which wakes following
//! readers at once. Readers never read past the readable end, so a scale event, decided at the
//! readable end `X` and stored in the catalog before the next snapshot is published, is in
//! place before any reader sees a record at or after `X`. A crash between a group commit and
//! a scale event loses nothing: no reader has seen past `X`, and the graph in the catalog
//! still covers every offset.

pub mod api;
pub mod cut;
pub mod graph;
pub mod group;
pub mod hash;
pub mod reader;
pub mod scaler;

pub use cut::Cut;
pub use graph::{Graph, Segment, SegmentId};
pub use hash::{BlockHashes, key_point};

use crate::catalog::{Catalog, CatalogError, StreamId};
use crate::config::{ScalePolicy, StreamPolicy};
use scaler::{Scaler, SegmentRate};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant, SystemTime};
use thiserror::Error;
use tokio::sync::watch;

/// Why a stream operation failed.
#[derive(Debug, Error)]
pub enum StreamsError {
    #[error(transparent)]
    Catalog(#[from] CatalogError),
    #[error("unknown stream id {0}")]
    UnknownStream(StreamId),
    #[error("cannot start the scaling thread: {0}")]
    Thread(std::io::Error),
}

/// One committed block as the stream manager sees it.
#[derive(Debug, Clone)]
pub struct CommittedBlock {
    pub stream: StreamId,
    pub hub_offset_base: u64,
    pub count: u32,
    /// Encoded block bytes.
    pub bytes: u64,
    pub ingest_ts: i64,
    pub min_ts: i64,
    pub max_ts: i64,
    pub hashes: BlockHashes,
}

/// The blocks of one group commit, in commit order.
#[derive(Debug, Clone, Default)]
pub struct CommittedGroup {
    pub blocks: Vec<CommittedBlock>,
}

/// What readers of one stream may see: the graph and the readable end, published together.
#[derive(Debug, Clone)]
pub struct StreamSnapshot {
    pub stream: StreamId,
    /// Records with offsets below this are committed and routed.
    pub end: u64,
    /// Hub ingest time (ns) of the newest readable record, 0 before the first.
    pub end_ingest_ts: i64,
    pub graph: Arc<Graph>,
}

struct StreamEntry {
    name: String,
    graph: Arc<Graph>,
    end: u64,
    end_ingest_ts: i64,
    scaler: Scaler,
    tx: watch::Sender<Arc<StreamSnapshot>>,
}

impl StreamEntry {
    fn publish(&self, stream: StreamId) {
        let snap = Arc::new(StreamSnapshot {
            stream,
            end: self.end,
            end_ingest_ts: self.end_ingest_ts,
            graph: self.graph.clone(),
        });
        self.tx.send_replace(snap);
    }
}

/// Counters for `/metrics` and the tests.
#[derive(Debug, Default)]
pub struct StreamStats {
    pub splits: std::sync::atomic::AtomicU64,
    pub merges: std::sync::atomic::AtomicU64,
    pub scale_errors: std::sync::atomic::AtomicU64,
}

/// Owns the segment graphs, the scalers and the readable ends of every stream.
pub struct StreamManager {
    catalog: Arc<Catalog>,
    policies: BTreeMap<String, ScalePolicy>,
    streams: Mutex<HashMap<StreamId, StreamEntry>>,
    groups: group::Groups,
    cache: reader::BlockCache,
    read: crate::read::ReadState,
    stats: StreamStats,
    stop: AtomicBool,
    /// Tier 2, once tiering is open: readers go there below a stream's tier-1 start. Weak,
    /// since tiering holds the hub that holds this manager.
    tiering: Mutex<std::sync::Weak<crate::tiering::Tiering>>,
}

impl std::fmt::Debug for StreamManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamManager").finish_non_exhaustive()
    }
}

fn now_ns() -> i64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

impl StreamManager {
    /// Loads the graphs from the catalog (creating segment 0 for streams without one) and
    /// starts the scaling ticker. Call before the WAL writer starts, so the readable ends are
    /// the committed ends.
    pub fn open(
        catalog: Arc<Catalog>,
        policy: &StreamPolicy,
        read: &crate::config::ReadConfig,
    ) -> Result<Arc<StreamManager>, StreamsError> {
        graph::init_schema(&catalog)?;
        group::init_schema(&catalog)?;
        let mut stored = graph::load_all(&catalog)?;
        let now = Instant::now();
        let mut streams = HashMap::new();
        for row in catalog.streams()? {
            let graph = match stored.remove(&row.id) {
                Some(segs) if !segs.is_empty() => Graph::from_segments(segs),
                _ => {
                    let g = Graph::initial(now_ns());
                    graph::store_initial(&catalog, row.id, &g)?;
                    g
                }
            };
            let entry = new_entry(
                row.name,
                Arc::new(graph),
                row.next_offset,
                policy,
                now,
                row.id,
            );
            streams.insert(row.id, entry);
        }
        let mgr = Arc::new(StreamManager {
            catalog: catalog.clone(),
            policies: policy.scale.clone(),
            streams: Mutex::new(streams),
            groups: group::Groups::load(&catalog)?,
            cache: reader::BlockCache::new(read.cache_bytes_max),
            read: crate::read::ReadState::new(*read),
            stats: StreamStats::default(),
            stop: AtomicBool::new(false),
            tiering: Mutex::new(std::sync::Weak::new()),
        });
        let tick = policy
            .scale
            .values()
            .map(|p| scaler::tick_for(Some(p)))
            .min()
            .unwrap_or(Duration::from_secs(1));
        let weak = Arc::downgrade(&mgr);
        std::thread::Builder::new()
            .name("stream-scaler".into())
            .spawn(move || ticker(weak, tick))
            .map_err(StreamsError::Thread)?;
        Ok(mgr)
    }

    /// Registers tier 2 for read-through (called by [`crate::tiering::Tiering::open`]).
    pub fn set_tiering(&self, t: &Arc<crate::tiering::Tiering>) {
        *self.tiering.lock().expect("tiering lock") = Arc::downgrade(t);
    }

    /// Tier 2, if tiering is open.
    pub fn tiering(&self) -> Option<Arc<crate::tiering::Tiering>> {
        self.tiering.lock().expect("tiering lock").upgrade()
    }

    /// Stops the ticker thread (it also stops once the manager is dropped).
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }

    /// The catalog the graphs live in.
    pub fn catalog(&self) -> &Arc<Catalog> {
        &self.catalog
    }

    /// The reader groups.
    pub fn groups(&self) -> &group::Groups {
        &self.groups
    }

    /// Decoded blocks shared by readers.
    pub fn cache(&self) -> &reader::BlockCache {
        &self.cache
    }

    /// The `[read]` bounds and their counters.
    pub fn read_state(&self) -> &crate::read::ReadState {
        &self.read
    }

    /// Split and merge counters.
    pub fn stats(&self) -> &StreamStats {
        &self.stats
    }

    /// Called by the WAL writer after each group commit, before the producers are completed.
    pub fn on_commit(&self, g: &CommittedGroup) {
        let mut streams = self.streams.lock().expect("streams lock");
        let mut touched = Vec::new();
        for b in &g.blocks {
            let entry = match self.entry(&mut streams, b.stream) {
                Ok(e) => e,
                Err(e) => {
                    tracing::error!(error = %e, stream = b.stream, "stream manager cannot track a stream");
                    continue;
                }
            };
            let graph = entry.graph.clone();
            entry.scaler.on_block(&graph, &b.hashes, b.bytes);
            entry.end = entry.end.max(b.hub_offset_base + u64::from(b.count));
            entry.end_ingest_ts = entry.end_ingest_ts.max(b.ingest_ts);
            touched.push(b.stream);
        }
        touched.sort_unstable();
        touched.dedup();
        for s in touched {
            if let Some(e) = streams.get(&s) {
                e.publish(s);
            }
        }
    }

    /// The entry of `sid`, created (with segment 0 stored) for a stream new since open.
    fn entry<'a>(
        &self,
        streams: &'a mut HashMap<StreamId, StreamEntry>,
        sid: StreamId,
    ) -> Result<&'a mut StreamEntry, StreamsError> {
        if let std::collections::hash_map::Entry::Vacant(slot) = streams.entry(sid) {
            let name = self
                .catalog
                .streams()?
                .into_iter()
                .find(|s| s.id == sid)
                .map(|s| s.name)
                .ok_or(StreamsError::UnknownStream(sid))?;
            let g = Graph::initial(now_ns());
            graph::store_initial(&self.catalog, sid, &g)?;
            let policy = StreamPolicy {
                scale: self.policies.clone(),
                ..StreamPolicy::default()
            };
            // Streams interned after open have had every commit pass through `on_commit`.
            slot.insert(new_entry(
                name,
                Arc::new(g),
                0,
                &policy,
                Instant::now(),
                sid,
            ));
        }
        Ok(streams.get_mut(&sid).expect("inserted above"))
    }

    /// Runs the scalers that are due; applies and stores their scale events.
    pub fn tick(&self) {
        let now = Instant::now();
        let mut streams = self.streams.lock().expect("streams lock");
        for (&sid, entry) in streams.iter_mut() {
            if entry.scaler.policy().is_none() || !entry.scaler.due(now) {
                continue;
            }
            let graph = entry.graph.clone();
            let Some(mut ev) = entry.scaler.tick(&graph, now) else {
                continue;
            };
            // Nothing readable since the last scale event: a new one would make empty segments.
            if entry.end <= graph.current_epoch_start() {
                continue;
            }
            ev.at = entry.end;
            let (next, created) = graph.apply(&ev, now_ns());
            if let Err(e) = graph::store_event(&self.catalog, sid, &next, &ev, &created) {
                self.stats.scale_errors.fetch_add(1, Ordering::Relaxed);
                tracing::error!(error = %e, stream = %entry.name, "could not store a scale event; keeping the segments");
                continue;
            }
            let merges = created
                .iter()
                .filter(|&&id| next.segment(id).is_some_and(|s| s.preds.len() > 1))
                .count();
            let splits = ev.sealed.len() - 2 * merges;
            self.stats
                .splits
                .fetch_add(splits as u64, Ordering::Relaxed);
            self.stats
                .merges
                .fetch_add(merges as u64, Ordering::Relaxed);
            tracing::info!(stream = %entry.name, at = ev.at, sealed = %crate::logging::List(&ev.sealed), created = %crate::logging::List(&created), "scaled");
            entry.scaler.on_created(&created);
            entry.graph = Arc::new(next);
            entry.publish(sid);
        }
    }

    /// The current snapshot of `sid` (a stream with no commits reads as empty).
    pub fn snapshot(&self, sid: StreamId) -> Result<Arc<StreamSnapshot>, StreamsError> {
        let mut streams = self.streams.lock().expect("streams lock");
        let e = self.entry(&mut streams, sid)?;
        Ok(e.tx.borrow().clone())
    }

    /// A receiver that sees every new snapshot of `sid`.
    pub fn subscribe(
        &self,
        sid: StreamId,
    ) -> Result<watch::Receiver<Arc<StreamSnapshot>>, StreamsError> {
        let mut streams = self.streams.lock().expect("streams lock");
        Ok(self.entry(&mut streams, sid)?.tx.subscribe())
    }

    /// The open segments' rates and the policy of `sid`.
    pub fn rates(
        &self,
        sid: StreamId,
    ) -> Result<(Vec<SegmentRate>, Option<ScalePolicy>), StreamsError> {
        let mut streams = self.streams.lock().expect("streams lock");
        let e = self.entry(&mut streams, sid)?;
        Ok((e.scaler.rates(&e.graph), e.scaler.policy().copied()))
    }

    /// A cut at the current readable end: every open segment at that offset.
    pub fn tail_cut(&self, sid: StreamId) -> Result<(Cut, u64), StreamsError> {
        let snap = self.snapshot(sid)?;
        Ok((Cut::at_offset(sid, &snap.graph, snap.end), snap.end))
    }
}

fn new_entry(
    name: String,
    graph: Arc<Graph>,
    end: u64,
    policy: &StreamPolicy,
    now: Instant,
    sid: StreamId,
) -> StreamEntry {
    let p = policy.scale.get(&name).copied();
    let snap = Arc::new(StreamSnapshot {
        stream: sid,
        end,
        end_ingest_ts: 0,
        graph: graph.clone(),
    });
    let (tx, _) = watch::channel(snap);
    StreamEntry {
        scaler: Scaler::new(p, &graph, now),
        name,
        graph,
        end,
        end_ingest_ts: 0,
        tx,
    }
}

fn ticker(mgr: Weak<StreamManager>, tick: Duration) {
    loop {
        std::thread::sleep(tick);
        let Some(m) = mgr.upgrade() else { return };
        if m.stop.load(Ordering::Relaxed) {
            return;
        }
        m.tick();
    }
}
