//! The segment graph of a stream: segments, their predecessor/successor links, and the
//! catalog tables that keep them.
//!
//! A segment is an index over the tier-1 WAL, not a copy: `(id, [lo, hi) of hash points,
//! [start, end) of stream offsets)`. A record with offset `o` and hash point `p` belongs to the
//! one segment with `start <= o < end` and `lo <= p < hi`. Scaling at offset `X` seals some
//! open segments (`end = X`) and creates their replacements (`start = X`), so the open segments
//! always partition the hash space. A [`Graph`] is an immutable snapshot; the stream manager
//! replaces it on every scale event.

use crate::catalog::{Catalog, CatalogError, StreamId};
use rusqlite::{Connection, params};
use serde::Serialize;
use std::collections::HashMap;

/// A segment id, per stream, increasing from 0.
pub type SegmentId = u32;

/// The catalog tables of the graph. `hi` may be 2^32; offsets are stored bit-cast to i64
/// like every u64 in the catalog.
const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS segments (
    stream INTEGER NOT NULL,
    id INTEGER NOT NULL,
    lo INTEGER NOT NULL,
    hi INTEGER NOT NULL,
    start_offset INTEGER NOT NULL,
    end_offset INTEGER,
    created_ns INTEGER NOT NULL,
    sealed_ns INTEGER,
    PRIMARY KEY (stream, id)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS segment_links (
    stream INTEGER NOT NULL,
    pred INTEGER NOT NULL,
    succ INTEGER NOT NULL,
    PRIMARY KEY (stream, pred, succ)
) WITHOUT ROWID;
";

/// One segment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Segment {
    pub id: SegmentId,
    /// Hash range `[lo, hi)`.
    pub lo: u64,
    pub hi: u64,
    /// Stream offsets `[start, end)`; `end` is `None` while the segment is open.
    pub start: u64,
    pub end: Option<u64>,
    pub preds: Vec<SegmentId>,
    pub succs: Vec<SegmentId>,
    /// Wall clock (ns) of creation and sealing.
    pub created_ns: i64,
    pub sealed_ns: Option<i64>,
}

impl Segment {
    /// Whether hash point `p` falls in the segment's range.
    #[inline]
    pub fn covers(&self, p: u32) -> bool {
        let p = u64::from(p);
        self.lo <= p && p < self.hi
    }

    /// Whether offset `o` lies in the segment's offset range.
    #[inline]
    pub fn spans(&self, o: u64) -> bool {
        self.start <= o && self.end.is_none_or(|e| o < e)
    }
}

/// The open set between two scale events: segments sorted by `lo`.
#[derive(Debug, Clone)]
struct Epoch {
    start: u64,
    open: Vec<SegmentId>,
}

/// An immutable snapshot of one stream's segment graph.
#[derive(Debug, Clone)]
pub struct Graph {
    segments: Vec<Segment>,
    epochs: Vec<Epoch>,
}

/// A scale event: seal `sealed` at offset `at` and create `created` (ranges with their
/// predecessors) starting there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScaleEvent {
    pub at: u64,
    pub sealed: Vec<SegmentId>,
    pub created: Vec<NewSegment>,
}

/// A segment a scale event creates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewSegment {
    pub lo: u64,
    pub hi: u64,
    pub preds: Vec<SegmentId>,
}

impl Graph {
    /// The graph of a new stream: segment 0 over the whole hash space from offset 0.
    pub fn initial(now_ns: i64) -> Graph {
        Graph::from_segments(vec![Segment {
            id: 0,
            lo: 0,
            hi: super::hash::HASH_SPACE,
            start: 0,
            end: None,
            preds: vec![],
            succs: vec![],
            created_ns: now_ns,
            sealed_ns: None,
        }])
    }

    /// Builds the graph (and its epochs) from segments sorted by id.
    pub fn from_segments(segments: Vec<Segment>) -> Graph {
        let mut starts: Vec<u64> = segments.iter().map(|s| s.start).collect();
        starts.sort_unstable();
        starts.dedup();
        let epochs = starts
            .into_iter()
            .map(|x| {
                let mut open: Vec<&Segment> = segments.iter().filter(|s| s.spans(x)).collect();
                open.sort_by_key(|s| s.lo);
                Epoch {
                    start: x,
                    open: open.iter().map(|s| s.id).collect(),
                }
            })
            .collect();
        Graph { segments, epochs }
    }

    /// Every segment, by id.
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// One segment.
    pub fn segment(&self, id: SegmentId) -> Option<&Segment> {
        self.segments.get(id as usize)
    }

    /// The open segments, by `lo`.
    pub fn open(&self) -> impl Iterator<Item = &Segment> {
        let last = self.epochs.last().expect("a graph has at least one epoch");
        last.open.iter().map(|&id| &self.segments[id as usize])
    }

    /// The offset the current open set started at (the last scale event).
    pub fn current_epoch_start(&self) -> u64 {
        self.epochs.last().map_or(0, |e| e.start)
    }

    /// The segments that span offset `o`, by `lo` (they partition the hash space).
    pub fn open_at(&self, o: u64) -> impl Iterator<Item = &Segment> {
        let i = self
            .epochs
            .partition_point(|e| e.start <= o)
            .saturating_sub(1);
        self.epochs[i]
            .open
            .iter()
            .map(|&id| &self.segments[id as usize])
    }

    /// The segment holding the record at offset `o` with hash point `p`.
    #[inline]
    pub fn locate(&self, o: u64, p: u32) -> SegmentId {
        let i = self
            .epochs
            .partition_point(|e| e.start <= o)
            .saturating_sub(1);
        let open = &self.epochs[i].open;
        let j = open
            .partition_point(|&id| self.segments[id as usize].lo <= u64::from(p))
            .saturating_sub(1);
        open[j]
    }

    /// The next id a scale event assigns.
    pub fn next_id(&self) -> SegmentId {
        self.segments.len() as SegmentId
    }

    /// The graph after `ev`, and the ids of the created segments.
    pub fn apply(&self, ev: &ScaleEvent, now_ns: i64) -> (Graph, Vec<SegmentId>) {
        let mut segments = self.segments.clone();
        for &id in &ev.sealed {
            let s = &mut segments[id as usize];
            s.end = Some(ev.at);
            s.sealed_ns = Some(now_ns);
        }
        let mut ids = Vec::new();
        for n in &ev.created {
            let id = segments.len() as SegmentId;
            for &p in &n.preds {
                segments[p as usize].succs.push(id);
            }
            segments.push(Segment {
                id,
                lo: n.lo,
                hi: n.hi,
                start: ev.at,
                end: None,
                preds: n.preds.clone(),
                succs: vec![],
                created_ns: now_ns,
                sealed_ns: None,
            });
            ids.push(id);
        }
        let mut epochs = self.epochs.clone();
        let mut open: Vec<&Segment> = segments.iter().filter(|s| s.spans(ev.at)).collect();
        open.sort_by_key(|s| s.lo);
        let open = open.iter().map(|s| s.id).collect();
        match epochs.last_mut() {
            Some(last) if last.start == ev.at => last.open = open,
            _ => epochs.push(Epoch { start: ev.at, open }),
        }
        (Graph { segments, epochs }, ids)
    }

    /// Whether `seg` is `anc` or descends from it through successor links.
    pub fn descends_from(&self, seg: SegmentId, anc: SegmentId) -> bool {
        if seg == anc {
            return true;
        }
        let mut stack = vec![seg];
        let mut seen = std::collections::HashSet::new();
        while let Some(s) = stack.pop() {
            for &p in &self.segments[s as usize].preds {
                if p == anc {
                    return true;
                }
                // Ids only grow along links, so nothing below `anc` can lead back to it.
                if p > anc && seen.insert(p) {
                    stack.push(p);
                }
            }
        }
        false
    }
}

/// Creates the graph tables if needed.
pub fn init_schema(catalog: &Catalog) -> Result<(), CatalogError> {
    catalog.with_write_conn(|c| c.execute_batch(SCHEMA))?;
    Ok(())
}

/// Every stored segment, by stream, sorted by id.
pub fn load_all(catalog: &Catalog) -> Result<HashMap<StreamId, Vec<Segment>>, CatalogError> {
    let rows = catalog.with_read_conn(|c: &mut Connection| -> rusqlite::Result<_> {
        let mut out: HashMap<StreamId, Vec<Segment>> = HashMap::new();
        let mut st = c.prepare(
            "SELECT stream, id, lo, hi, start_offset, end_offset, created_ns, sealed_ns
             FROM segments ORDER BY stream, id",
        )?;
        let rows = st.query_map([], |r| {
            Ok((
                r.get::<_, i64>(0)? as StreamId,
                Segment {
                    id: r.get::<_, i64>(1)? as SegmentId,
                    lo: r.get::<_, i64>(2)? as u64,
                    hi: r.get::<_, i64>(3)? as u64,
                    start: r.get::<_, i64>(4)? as u64,
                    end: r.get::<_, Option<i64>>(5)?.map(|v| v as u64),
                    preds: vec![],
                    succs: vec![],
                    created_ns: r.get(6)?,
                    sealed_ns: r.get(7)?,
                },
            ))
        })?;
        for row in rows {
            let (stream, seg) = row?;
            out.entry(stream).or_default().push(seg);
        }
        let mut st =
            c.prepare("SELECT stream, pred, succ FROM segment_links ORDER BY stream, succ, pred")?;
        let links = st.query_map([], |r| {
            Ok((
                r.get::<_, i64>(0)? as StreamId,
                r.get::<_, i64>(1)? as SegmentId,
                r.get::<_, i64>(2)? as SegmentId,
            ))
        })?;
        for link in links {
            let (stream, pred, succ) = link?;
            if let Some(segs) = out.get_mut(&stream)
                && (pred as usize) < segs.len()
                && (succ as usize) < segs.len()
            {
                segs[pred as usize].succs.push(succ);
                segs[succ as usize].preds.push(pred);
            }
        }
        Ok(out)
    })?;
    Ok(rows)
}

/// Stores segment 0 of a new stream.
pub fn store_initial(catalog: &Catalog, stream: StreamId, g: &Graph) -> Result<(), CatalogError> {
    let s = &g.segments()[0];
    catalog.with_write_conn(|c| {
        c.execute(
            "INSERT OR IGNORE INTO segments (stream, id, lo, hi, start_offset, end_offset, created_ns)
             VALUES (?1, 0, ?2, ?3, ?4, NULL, ?5)",
            params![i64::from(stream), s.lo as i64, s.hi as i64, s.start as i64, s.created_ns],
        )
    })?;
    Ok(())
}

/// Persists a scale event in one transaction: seals, new segments, links.
pub fn store_event(
    catalog: &Catalog,
    stream: StreamId,
    after: &Graph,
    ev: &ScaleEvent,
    created: &[SegmentId],
) -> Result<(), CatalogError> {
    catalog.with_write_conn(|c| -> rusqlite::Result<()> {
        let tx = c.transaction()?;
        for &id in &ev.sealed {
            let s = &after.segments()[id as usize];
            tx.execute(
                "UPDATE segments SET end_offset = ?3, sealed_ns = ?4 WHERE stream = ?1 AND id = ?2",
                params![i64::from(stream), i64::from(id), ev.at as i64, s.sealed_ns],
            )?;
        }
        for &id in created {
            let s = &after.segments()[id as usize];
            tx.execute(
                "INSERT INTO segments (stream, id, lo, hi, start_offset, end_offset, created_ns)
                 VALUES (?1, ?2, ?3, ?4, ?5, NULL, ?6)",
                params![
                    i64::from(stream),
                    i64::from(id),
                    s.lo as i64,
                    s.hi as i64,
                    s.start as i64,
                    s.created_ns
                ],
            )?;
            for &p in &s.preds {
                tx.execute(
                    "INSERT INTO segment_links (stream, pred, succ) VALUES (?1, ?2, ?3)",
                    params![i64::from(stream), i64::from(p), i64::from(id)],
                )?;
            }
        }
        tx.commit()
    })?;
    Ok(())
}

/// The segments as compact JSON for tier-2 manifests: one array per segment,
/// `[id, lo, hi, start, end|null, created_ns, sealed_ns|null, [preds]]`.
pub fn to_json(segments: &[Segment]) -> serde_json::Value {
    serde_json::Value::Array(
        segments
            .iter()
            .map(|s| {
                serde_json::json!([
                    s.id,
                    s.lo,
                    s.hi,
                    s.start,
                    s.end,
                    s.created_ns,
                    s.sealed_ns,
                    s.preds
                ])
            })
            .collect(),
    )
}

/// Parses [`to_json`] output back (successor links derived from the predecessors). `None`
/// when it is not a well-formed graph: ids dense from 0, predecessors earlier than their
/// successors.
pub fn from_json(v: &serde_json::Value) -> Option<Vec<Segment>> {
    let mut out: Vec<Segment> = Vec::new();
    for (i, item) in v.as_array()?.iter().enumerate() {
        let a = item.as_array()?;
        let u = |k: usize| a.get(k).and_then(serde_json::Value::as_u64);
        let id = SegmentId::try_from(u(0)?).ok()?;
        if id as usize != i {
            return None;
        }
        let preds: Vec<SegmentId> = a
            .get(7)?
            .as_array()?
            .iter()
            .map(|p| p.as_u64().and_then(|p| SegmentId::try_from(p).ok()))
            .collect::<Option<_>>()?;
        if preds.iter().any(|&p| p >= id) {
            return None;
        }
        out.push(Segment {
            id,
            lo: u(1)?,
            hi: u(2)?,
            start: u(3)?,
            end: a.get(4).and_then(serde_json::Value::as_u64),
            preds,
            succs: Vec::new(),
            created_ns: a.get(5).and_then(serde_json::Value::as_i64).unwrap_or(0),
            sealed_ns: a.get(6).and_then(serde_json::Value::as_i64),
        });
    }
    if out.is_empty() {
        return None;
    }
    for i in 0..out.len() {
        for p in out[i].preds.clone() {
            let id = out[i].id;
            out[p as usize].succs.push(id);
        }
    }
    Some(out)
}

/// The graph as it stood for a stream whose records end at `end`: segments created at or
/// after `end` are dropped (always a suffix of the ids) and their predecessors reopened.
pub fn truncate_at(mut segments: Vec<Segment>, end: u64) -> Vec<Segment> {
    // Segment 0 always stays (a stream has at least one segment).
    let keep = segments
        .iter()
        .position(|s| s.id > 0 && s.start >= end)
        .unwrap_or(segments.len());
    segments.truncate(keep);
    for s in &mut segments {
        s.succs.retain(|&x| (x as usize) < keep);
        if s.succs.is_empty() {
            s.end = None;
            s.sealed_ns = None;
        }
    }
    segments
}

/// Stores a whole graph for a stream that has none (catalog rebuild from tier 2), in one
/// transaction.
pub fn store_all(
    catalog: &Catalog,
    stream: StreamId,
    segments: &[Segment],
) -> Result<(), CatalogError> {
    catalog.with_write_conn(|c| -> rusqlite::Result<()> {
        let tx = c.transaction()?;
        for s in segments {
            tx.execute(
                "INSERT OR REPLACE INTO segments
                 (stream, id, lo, hi, start_offset, end_offset, created_ns, sealed_ns)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
                params![
                    i64::from(stream),
                    i64::from(s.id),
                    s.lo as i64,
                    s.hi as i64,
                    s.start as i64,
                    s.end.map(|e| e as i64),
                    s.created_ns,
                    s.sealed_ns
                ],
            )?;
            for &p in &s.preds {
                tx.execute(
                    "INSERT OR IGNORE INTO segment_links (stream, pred, succ) VALUES (?1, ?2, ?3)",
                    params![i64::from(stream), i64::from(p), i64::from(s.id)],
                )?;
            }
        }
        tx.commit()
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::streams::hash::HASH_SPACE;

    #[test]
    fn split_and_merge_locate_records() {
        let g = Graph::initial(0);
        let half = HASH_SPACE / 2;
        let split = ScaleEvent {
            at: 10,
            sealed: vec![0],
            created: vec![
                NewSegment {
                    lo: 0,
                    hi: half,
                    preds: vec![0],
                },
                NewSegment {
                    lo: half,
                    hi: HASH_SPACE,
                    preds: vec![0],
                },
            ],
        };
        let (g, ids) = g.apply(&split, 1);
        assert_eq!(ids, vec![1, 2]);
        assert_eq!(g.locate(9, u32::MAX), 0);
        assert_eq!(g.locate(10, 0), 1);
        assert_eq!(g.locate(10, u32::MAX), 2);
        let merge = ScaleEvent {
            at: 20,
            sealed: vec![1, 2],
            created: vec![NewSegment {
                lo: 0,
                hi: HASH_SPACE,
                preds: vec![1, 2],
            }],
        };
        let (g, _) = g.apply(&merge, 2);
        assert_eq!(g.locate(19, 5), 1);
        assert_eq!(g.locate(25, 5), 3);
        assert_eq!(g.open().map(|s| s.id).collect::<Vec<_>>(), vec![3]);
        assert!(g.descends_from(3, 0));
        assert!(!g.descends_from(1, 2));
        // Rebuilding from the segments gives the same epochs.
        let again = Graph::from_segments(g.segments().to_vec());
        for o in [0, 9, 10, 19, 20, 100] {
            for p in [0, u32::MAX / 2, u32::MAX] {
                assert_eq!(again.locate(o, p), g.locate(o, p));
            }
        }
        // The manifest encoding round-trips; truncating before the merge reopens 1 and 2.
        let back = from_json(&to_json(g.segments())).unwrap();
        assert_eq!(back, g.segments().to_vec());
        let cut = truncate_at(back, 15);
        assert_eq!(cut.len(), 3);
        assert!(cut[1].end.is_none() && cut[2].end.is_none() && cut[1].succs.is_empty());
        assert_eq!(cut[0].end, Some(10));
        assert!(from_json(&serde_json::json!([[1, 0, 1, 0, null, 0, null, []]])).is_none());
    }
}
