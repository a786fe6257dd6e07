//! Reader groups: N readers share a stream's segments, with checkpoints stored in the hub.
//!
//! A group keeps one checkpoint (next offset) per segment in the catalog. A segment is
//! *finished* once its checkpoint reaches its end offset, and *available* once it is not
//! finished and all its predecessors are. Only available segments are assigned, so a
//! successor is read only after the group checkpointed every record of its predecessors:
//! per-key order holds across splits, merges and readers.
//!
//! Readers are sessions kept in memory: each poll is a heartbeat, and a reader silent for the
//! group's session timeout is dropped, its segments going back to the pool at their
//! checkpoints. Delivery is therefore at least once: what a reader returned but did not
//! checkpoint before it died is read again by its successor, with the same segment and offset
//! on every record so downstream can deduplicate. Available segments go to the live reader
//! holding the fewest; a reader above its fair share hands back a segment only when it holds
//! nothing uncheckpointed in it, so rebalancing never redelivers.

use super::cut::Cut;
use super::graph::{Graph, SegmentId};
use super::reader::{Start, offset_at_time};
use crate::catalog::{Catalog, CatalogError, StreamId};
use crate::ingest::Hub;
use crate::read::{ReadError, ReadRecord, scan_in};
use rusqlite::params;
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use thiserror::Error;
use tokio::sync::Notify;

/// Default time after which a silent reader is dropped.
pub const DEFAULT_SESSION_TIMEOUT: Duration = Duration::from_secs(30);
/// How often a waiting poll re-checks assignments (another reader may have died).
const REASSIGN_POLL: Duration = Duration::from_millis(50);

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS reader_groups (
    stream INTEGER NOT NULL,
    name TEXT NOT NULL,
    session_timeout_ms INTEGER NOT NULL,
    created_ns INTEGER NOT NULL,
    PRIMARY KEY (stream, name)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS reader_group_positions (
    stream INTEGER NOT NULL,
    grp TEXT NOT NULL,
    segment INTEGER NOT NULL,
    position INTEGER NOT NULL,
    PRIMARY KEY (stream, grp, segment)
) WITHOUT ROWID;
";

/// Why a group operation failed.
#[derive(Debug, Error)]
pub enum GroupError {
    #[error("unknown reader group `{0}`")]
    UnknownGroup(String),
    #[error("reader `{0}` is no longer in the group (timed out or replaced); join again")]
    ReaderGone(String),
    #[error("`{0}` is not a valid group or reader name ([A-Za-z0-9_.-]{{1,64}})")]
    BadName(String),
    #[error(transparent)]
    Catalog(#[from] CatalogError),
    #[error(transparent)]
    Read(#[from] ReadError),
}

struct Session {
    generation: u64,
    last_seen: Instant,
    /// Owned segments and the next offset this reader will read in each.
    cursors: BTreeMap<SegmentId, u64>,
}

struct GroupState {
    session_timeout: Duration,
    checkpoints: BTreeMap<SegmentId, u64>,
    readers: BTreeMap<String, Session>,
    owner: HashMap<SegmentId, String>,
    next_generation: u64,
}

impl GroupState {
    fn pos(&self, g: &Graph, s: SegmentId) -> u64 {
        let start = g.segment(s).map_or(0, |x| x.start);
        self.checkpoints
            .get(&s)
            .copied()
            .unwrap_or(start)
            .max(start)
    }

    fn finished(&self, g: &Graph, s: SegmentId) -> bool {
        g.segment(s)
            .and_then(|x| x.end)
            .is_some_and(|e| self.pos(g, s) >= e)
    }

    fn available(&self, g: &Graph) -> Vec<SegmentId> {
        g.segments()
            .iter()
            .filter(|s| !self.finished(g, s.id) && s.preds.iter().all(|&p| self.finished(g, p)))
            .map(|s| s.id)
            .collect()
    }

    /// Drops silent readers, forgets finished segments, assigns free available segments.
    fn refresh(&mut self, g: &Graph, now: Instant) {
        let timeout = self.session_timeout;
        self.readers
            .retain(|_, s| now.duration_since(s.last_seen) <= timeout);
        let avail = self.available(g);
        let readers = &self.readers;
        self.owner
            .retain(|s, r| avail.contains(s) && readers.contains_key(r));
        for sess in self.readers.values_mut() {
            sess.cursors.retain(|s, _| avail.contains(s));
        }
        for s in avail {
            if self.owner.contains_key(&s) {
                continue;
            }
            let Some(name) = self
                .readers
                .iter()
                .min_by_key(|(n, r)| (r.cursors.len(), (*n).clone()))
                .map(|(n, _)| n.clone())
            else {
                return;
            };
            let p = self.pos(g, s);
            self.readers
                .get_mut(&name)
                .expect("picked from readers")
                .cursors
                .insert(s, p);
            self.owner.insert(s, name);
        }
    }

    /// Hands back segments above `reader`'s fair share that it holds nothing uncheckpointed in.
    fn rebalance(&mut self, g: &Graph, reader: &str) {
        let live = self.readers.len().max(1);
        let total = self.owner.len();
        let quota = total.div_ceil(live);
        let Some(sess) = self.readers.get(reader) else {
            return;
        };
        let excess = sess.cursors.len().saturating_sub(quota);
        if excess == 0 {
            return;
        }
        let clean: Vec<SegmentId> = sess
            .cursors
            .iter()
            .filter(|&(&s, &c)| c == self.pos(g, s))
            .map(|(&s, _)| s)
            .take(excess)
            .collect();
        for s in clean {
            // Give it to the least loaded other reader, if one holds less than the quota.
            let target = self
                .readers
                .iter()
                .filter(|(n, _)| n.as_str() != reader)
                .min_by_key(|(n, r)| (r.cursors.len(), (*n).clone()))
                .filter(|(_, r)| r.cursors.len() < quota)
                .map(|(n, _)| n.clone());
            let Some(target) = target else { break };
            let p = self.pos(g, s);
            self.readers
                .get_mut(reader)
                .expect("checked above")
                .cursors
                .remove(&s);
            self.readers
                .get_mut(&target)
                .expect("picked from readers")
                .cursors
                .insert(s, p);
            self.owner.insert(s, target);
        }
    }

    fn session(&mut self, reader: &str, generation: u64) -> Result<&mut Session, GroupError> {
        match self.readers.get_mut(reader) {
            Some(s) if s.generation == generation => Ok(s),
            _ => Err(GroupError::ReaderGone(reader.to_string())),
        }
    }
}

/// Every reader group of the hub.
pub struct Groups {
    catalog: Arc<Catalog>,
    groups: Mutex<HashMap<(StreamId, String), GroupState>>,
    changed: Notify,
}

impl std::fmt::Debug for Groups {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Groups").finish_non_exhaustive()
    }
}

/// Creates the group tables if needed.
pub fn init_schema(catalog: &Catalog) -> Result<(), CatalogError> {
    catalog.with_write_conn(|c| c.execute_batch(SCHEMA))?;
    Ok(())
}

/// A batch a reader polled.
#[derive(Debug, Clone, Default)]
pub struct Batch {
    pub records: Vec<ReadRecord>,
    /// The reader's position in every segment it holds, after this batch. Checkpointing
    /// these acknowledges the batch (and finishes segments read to their end).
    pub positions: BTreeMap<SegmentId, u64>,
}

/// A reader group as the API shows it.
#[derive(Debug, Clone, Serialize)]
pub struct GroupStatus {
    pub name: String,
    pub session_timeout_ms: u64,
    pub readers: Vec<ReaderStatus>,
    /// Checkpoints of the unfinished segments whose predecessors are finished.
    pub frontier: BTreeMap<SegmentId, u64>,
    /// The frontier as a cut token: reading from it yields what the group has not checkpointed.
    pub cut: String,
    /// Available segments no reader holds.
    pub unassigned: Vec<SegmentId>,
}

/// One reader in [`GroupStatus`].
#[derive(Debug, Clone, Serialize)]
pub struct ReaderStatus {
    pub name: String,
    pub segments: Vec<SegmentId>,
    pub idle_ms: u64,
}

fn valid_name(s: &str) -> bool {
    crate::config::valid_stream_name(s)
}

impl Groups {
    /// Loads the stored groups (with no readers: sessions do not survive a restart).
    pub fn load(catalog: &Arc<Catalog>) -> Result<Groups, CatalogError> {
        let mut groups = HashMap::new();
        catalog.with_read_conn(|c| -> rusqlite::Result<()> {
            let mut st = c.prepare("SELECT stream, name, session_timeout_ms FROM reader_groups")?;
            let rows = st.query_map([], |r| {
                Ok((
                    r.get::<_, i64>(0)? as StreamId,
                    r.get::<_, String>(1)?,
                    r.get::<_, i64>(2)?,
                ))
            })?;
            for row in rows {
                let (s, name, ms) = row?;
                groups.insert(
                    (s, name),
                    GroupState {
                        session_timeout: Duration::from_millis(ms as u64),
                        checkpoints: BTreeMap::new(),
                        readers: BTreeMap::new(),
                        owner: HashMap::new(),
                        next_generation: 1,
                    },
                );
            }
            let mut st =
                c.prepare("SELECT stream, grp, segment, position FROM reader_group_positions")?;
            let rows = st.query_map([], |r| {
                Ok((
                    r.get::<_, i64>(0)? as StreamId,
                    r.get::<_, String>(1)?,
                    r.get::<_, i64>(2)? as SegmentId,
                    r.get::<_, i64>(3)? as u64,
                ))
            })?;
            for row in rows {
                let (s, name, seg, pos) = row?;
                if let Some(g) = groups.get_mut(&(s, name)) {
                    g.checkpoints.insert(seg, pos);
                }
            }
            Ok(())
        })?;
        Ok(Groups {
            catalog: catalog.clone(),
            groups: Mutex::new(groups),
            changed: Notify::new(),
        })
    }

    /// Creates group `name` on `sid` reading from `start`, unless it exists (then it is left as
    /// it is). Returns whether it was created.
    pub fn create(
        &self,
        hub: &Hub,
        sid: StreamId,
        name: &str,
        start: &Start,
        session_timeout: Duration,
    ) -> Result<bool, GroupError> {
        if !valid_name(name) {
            return Err(GroupError::BadName(name.to_string()));
        }
        let mut groups = self.groups.lock().expect("groups lock");
        if groups.contains_key(&(sid, name.to_string())) {
            return Ok(false);
        }
        let snap = hub
            .streams()
            .snapshot(sid)
            .map_err(|e| ReadError::Internal(e.to_string()))?;
        let g = &snap.graph;
        let mut checkpoints = BTreeMap::new();
        match start {
            Start::Beginning => {}
            Start::Offset(_) | Start::Time(_) => {
                let o = match *start {
                    Start::Offset(o) => o.min(snap.end),
                    Start::Time(ts) => offset_at_time(hub, sid, ts, snap.end)?,
                    _ => unreachable!("matched above"),
                };
                for s in g.segments() {
                    let p = o.max(s.start).min(s.end.unwrap_or(u64::MAX));
                    checkpoints.insert(s.id, p);
                }
            }
            Start::Cut(cut) => {
                cut.check(sid, g).map_err(ReadError::Cut)?;
                let mut f = super::cut::CutFilter::new(cut.clone());
                for s in g.segments() {
                    let p = match cut.positions.get(&s.id) {
                        Some(&p) => p,
                        None if f.after(g, s.id, s.start) => s.start,
                        None => s.end.unwrap_or(s.start),
                    };
                    checkpoints.insert(s.id, p);
                }
            }
        }
        let timeout_ms = session_timeout.as_millis().min(i64::MAX as u128) as i64;
        self.catalog.with_write_conn(|c| -> rusqlite::Result<()> {
            let tx = c.transaction()?;
            tx.execute(
                "INSERT INTO reader_groups (stream, name, session_timeout_ms, created_ns) VALUES (?1, ?2, ?3, ?4)",
                params![i64::from(sid), name, timeout_ms, super::now_ns()],
            )?;
            for (&s, &p) in &checkpoints {
                tx.execute(
                    "INSERT OR REPLACE INTO reader_group_positions (stream, grp, segment, position) VALUES (?1, ?2, ?3, ?4)",
                    params![i64::from(sid), name, i64::from(s), p as i64],
                )?;
            }
            tx.commit()
        })
        .map_err(CatalogError::from)?;
        groups.insert(
            (sid, name.to_string()),
            GroupState {
                session_timeout,
                checkpoints,
                readers: BTreeMap::new(),
                owner: HashMap::new(),
                next_generation: 1,
            },
        );
        Ok(true)
    }

    /// Joins `reader` to the group (replacing a session of the same name: the previous
    /// handle gets [`GroupError::ReaderGone`], and the segments restart at their checkpoints).
    pub fn join(
        &self,
        hub: &Arc<Hub>,
        sid: StreamId,
        group: &str,
        reader: &str,
    ) -> Result<GroupReader, GroupError> {
        if !valid_name(reader) {
            return Err(GroupError::BadName(reader.to_string()));
        }
        let mut groups = self.groups.lock().expect("groups lock");
        let st = groups
            .get_mut(&(sid, group.to_string()))
            .ok_or_else(|| GroupError::UnknownGroup(group.to_string()))?;
        let generation = st.next_generation;
        st.next_generation += 1;
        st.owner.retain(|_, r| r != reader);
        st.readers.insert(
            reader.to_string(),
            Session {
                generation,
                last_seen: Instant::now(),
                cursors: BTreeMap::new(),
            },
        );
        Ok(GroupReader {
            hub: hub.clone(),
            sid,
            group: group.to_string(),
            reader: reader.to_string(),
            generation,
        })
    }

    /// The handle of an existing session of `reader`, or a new session (the HTTP API, where a
    /// reader is known by name only).
    pub fn session_or_join(
        &self,
        hub: &Arc<Hub>,
        sid: StreamId,
        group: &str,
        reader: &str,
    ) -> Result<GroupReader, GroupError> {
        {
            let groups = self.groups.lock().expect("groups lock");
            let st = groups
                .get(&(sid, group.to_string()))
                .ok_or_else(|| GroupError::UnknownGroup(group.to_string()))?;
            if let Some(s) = st.readers.get(reader)
                && s.last_seen.elapsed() <= st.session_timeout
            {
                return Ok(GroupReader {
                    hub: hub.clone(),
                    sid,
                    group: group.to_string(),
                    reader: reader.to_string(),
                    generation: s.generation,
                });
            }
        }
        self.join(hub, sid, group, reader)
    }

    /// The group's status against `graph`.
    pub fn status(
        &self,
        sid: StreamId,
        group: &str,
        graph: &Graph,
    ) -> Result<GroupStatus, GroupError> {
        let mut groups = self.groups.lock().expect("groups lock");
        let st = groups
            .get_mut(&(sid, group.to_string()))
            .ok_or_else(|| GroupError::UnknownGroup(group.to_string()))?;
        let now = Instant::now();
        st.refresh(graph, now);
        let frontier: BTreeMap<SegmentId, u64> = st
            .available(graph)
            .into_iter()
            .map(|s| (s, st.pos(graph, s)))
            .collect();
        let cut = Cut {
            stream: sid,
            positions: frontier.clone(),
        };
        Ok(GroupStatus {
            name: group.to_string(),
            session_timeout_ms: st.session_timeout.as_millis() as u64,
            readers: st
                .readers
                .iter()
                .map(|(n, s)| ReaderStatus {
                    name: n.clone(),
                    segments: s.cursors.keys().copied().collect(),
                    idle_ms: now.duration_since(s.last_seen).as_millis() as u64,
                })
                .collect(),
            unassigned: frontier
                .keys()
                .filter(|s| !st.owner.contains_key(s))
                .copied()
                .collect(),
            cut: cut.token(),
            frontier,
        })
    }

    /// The group's frontier as a cut.
    pub fn cut(&self, sid: StreamId, group: &str, graph: &Graph) -> Result<Cut, GroupError> {
        let status = self.status(sid, group, graph)?;
        Ok(Cut {
            stream: sid,
            positions: status.frontier,
        })
    }

    /// Names of the groups of `sid`.
    pub fn list(&self, sid: StreamId) -> Vec<String> {
        let groups = self.groups.lock().expect("groups lock");
        let mut v: Vec<String> = groups
            .keys()
            .filter(|(s, _)| *s == sid)
            .map(|(_, n)| n.clone())
            .collect();
        v.sort();
        v
    }
}

/// One reader's handle in a group. Dropping it without [`GroupReader::leave`] is a crash as
/// far as the group knows: its segments move on after the session timeout.
#[derive(Debug, Clone)]
pub struct GroupReader {
    hub: Arc<Hub>,
    sid: StreamId,
    group: String,
    reader: String,
    generation: u64,
}

impl GroupReader {
    /// The reader's name.
    pub fn name(&self) -> &str {
        &self.reader
    }

    fn groups(&self) -> &Groups {
        self.hub.streams().groups()
    }

    fn with_state<R>(
        &self,
        f: impl FnOnce(&mut GroupState) -> Result<R, GroupError>,
    ) -> Result<R, GroupError> {
        let mut groups = self.groups().groups.lock().expect("groups lock");
        let st = groups
            .get_mut(&(self.sid, self.group.clone()))
            .ok_or_else(|| GroupError::UnknownGroup(self.group.clone()))?;
        f(st)
    }

    /// Heartbeats, takes its share of the available segments, and returns up to `max`
    /// records from them (blocking I/O). Returns an empty batch when caught up.
    pub fn poll_now(&self, max: usize) -> Result<Batch, GroupError> {
        let snap = self
            .hub
            .streams()
            .snapshot(self.sid)
            .map_err(|e| ReadError::Internal(e.to_string()))?;
        let g = &snap.graph;
        let owned = self.with_state(|st| {
            let now = Instant::now();
            st.session(&self.reader, self.generation)?.last_seen = now;
            st.refresh(g, now);
            st.rebalance(g, &self.reader);
            Ok(st.session(&self.reader, self.generation)?.cursors.clone())
        })?;
        let mut records = Vec::new();
        let mut cursors = BTreeMap::new();
        // Share the batch between segments so one busy segment does not starve the others.
        let per = max.div_ceil(owned.len().max(1)).max(1);
        for (&s, &c) in &owned {
            let seg = g.segment(s).expect("owned segments exist");
            let to = seg.end.unwrap_or(u64::MAX);
            let room = per.min(max.saturating_sub(records.len()));
            let next = if room == 0 {
                c
            } else {
                scan_in(
                    &self.hub,
                    &snap,
                    Some(s),
                    c,
                    to,
                    room,
                    |_, id, _, _, _| id == s,
                    &mut records,
                )?
            };
            cursors.insert(s, next);
        }
        let positions = self.with_state(|st| {
            let sess = st.session(&self.reader, self.generation)?;
            for (s, c) in &cursors {
                if let Some(cur) = sess.cursors.get_mut(s) {
                    *cur = (*cur).max(*c);
                }
            }
            Ok(sess.cursors.clone())
        })?;
        Ok(Batch { records, positions })
    }

    /// As [`GroupReader::poll_now`], waiting up to `wait` for records (follow mode).
    pub async fn poll(&self, max: usize, wait: Duration) -> Result<Batch, GroupError> {
        let deadline = tokio::time::Instant::now() + wait;
        let mut rx = self
            .hub
            .streams()
            .subscribe(self.sid)
            .map_err(|e| ReadError::Internal(e.to_string()))?;
        loop {
            rx.borrow_and_update();
            let me = self.clone();
            let batch = tokio::task::spawn_blocking(move || me.poll_now(max))
                .await
                .map_err(|e| ReadError::Internal(e.to_string()))??;
            let now = tokio::time::Instant::now();
            if !batch.records.is_empty() || now >= deadline {
                return Ok(batch);
            }
            let slice = (deadline - now).min(REASSIGN_POLL);
            let changed = self.groups().changed.notified();
            tokio::select! {
                _ = rx.changed() => {}
                _ = changed => {}
                _ = tokio::time::sleep(slice) => {}
            }
        }
    }

    /// Stores checkpoints: `positions` (segment -> next offset) of segments this reader holds,
    /// each clamped to what it has read. Records below a checkpoint are never delivered again.
    pub fn checkpoint(&self, positions: &BTreeMap<SegmentId, u64>) -> Result<(), GroupError> {
        let mut finished_any = false;
        let stored = self.with_state(|st| {
            let sess = st.session(&self.reader, self.generation)?;
            let mut ok = Vec::new();
            for (&s, &p) in positions {
                if let Some(&c) = sess.cursors.get(&s) {
                    ok.push((s, p.min(c)));
                }
            }
            let mut stored = Vec::new();
            for (s, p) in ok {
                let cur = st.checkpoints.get(&s).copied().unwrap_or(0);
                if p > cur {
                    st.checkpoints.insert(s, p);
                    stored.push((s, p));
                }
            }
            Ok(stored)
        })?;
        if stored.is_empty() {
            return Ok(());
        }
        self.hub
            .catalog()
            .with_write_conn(|c| -> rusqlite::Result<()> {
                let tx = c.transaction()?;
                for &(s, p) in &stored {
                    tx.execute(
                        "INSERT INTO reader_group_positions (stream, grp, segment, position) VALUES (?1, ?2, ?3, ?4)
                         ON CONFLICT (stream, grp, segment) DO UPDATE SET position = max(position, excluded.position)",
                        params![i64::from(self.sid), self.group, i64::from(s), p as i64],
                    )?;
                }
                tx.commit()
            })
            .map_err(CatalogError::from)?;
        if let Ok(snap) = self.hub.streams().snapshot(self.sid) {
            finished_any = stored.iter().any(|&(s, p)| {
                snap.graph
                    .segment(s)
                    .and_then(|x| x.end)
                    .is_some_and(|e| p >= e)
            });
        }
        if finished_any {
            self.groups().changed.notify_waiters();
        }
        Ok(())
    }

    /// Leaves the group: its segments go to the other readers at their checkpoints now.
    pub fn leave(self) {
        let _ = self.with_state(|st| {
            if st
                .readers
                .get(&self.reader)
                .is_some_and(|s| s.generation == self.generation)
            {
                st.readers.remove(&self.reader);
                st.owner.retain(|_, r| *r != self.reader);
            }
            Ok(())
        });
        self.groups().changed.notify_waiters();
    }
}
