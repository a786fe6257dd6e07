//! Reading committed records from the WAL through the block index, and the NDJSON format.
//!
//! A stream's records are found through the catalog's block index (stream, hub offset) and
//! read from the WAL frame each row points at, so reading never scans the log. Every frame is
//! checked against its index row after reading (checksum, device, epoch, seqs, offsets): the
//! pair of the checks the writer made before writing. Readers only read below the stream's
//! readable end, which the stream manager publishes once a commit is routed into segments
//! (see [`crate::streams`]).
//!
//! [`read_records`] is the paging reader behind `from=<hub offset>`; [`scan`] is the loop
//! every reader shares; the NDJSON line format ([`write_ndjson_line`]) is the stable surface.

use crate::catalog::BlockRow;
use crate::ingest::Hub;
use crate::streams::reader::DecodedBlock;
use crate::streams::{Graph, SegmentId, StreamSnapshot, key_point};
use crate::wal::{KIND_BLOCK, WalReadError};
use serde::Serialize;
use serde::ser::SerializeMap;
use std::sync::Arc;
use sync::record::{Record, Value};
use thiserror::Error;

/// Decode limits for blocks already committed (and checksummed twice since).
const READ_LIMITS: sync::block::DecodeLimits = sync::block::DecodeLimits {
    raw_bytes_max: 1 << 30,
    records_max: u32::MAX,
    body_bytes_max: 1 << 30,
};

/// Most blocks fetched from the index per query.
const INDEX_PAGE_BLOCKS: usize = 256;

/// Why a read failed.
#[derive(Debug, Error)]
pub enum ReadError {
    #[error("unknown stream `{0}`")]
    UnknownStream(String),
    #[error("catalog: {0}")]
    Catalog(#[from] crate::catalog::CatalogError),
    #[error(transparent)]
    Wal(#[from] WalReadError),
    #[error("block at hub offset {offset} does not match its index row: {what}")]
    Mismatch { offset: u64, what: String },
    #[error("bad stream cut: {0}")]
    Cut(crate::streams::cut::CutError),
    #[error("{0}")]
    Internal(String),
}

/// One record as readers see it.
#[derive(Debug, Clone, PartialEq)]
pub struct ReadRecord {
    pub device: String,
    pub epoch: u64,
    pub seq: u64,
    pub key: String,
    pub ts: i64,
    pub fields: Vec<(String, Value)>,
    /// The hub offset within the stream.
    pub offset: u64,
    /// Hub ingest time (ns), monotonic across the log.
    pub ingest_ts: i64,
    /// The segment the record belongs to.
    pub segment: SegmentId,
}

/// A page of records and where the next page starts.
#[derive(Debug, Clone, PartialEq)]
pub struct ReadPage {
    pub records: Vec<ReadRecord>,
    /// The hub offset to pass as `from` for the next page.
    pub next: u64,
}

/// Reads up to `limit` records of `stream` with hub offset >= `from`, below its readable end.
pub fn read_records(
    hub: &Hub,
    stream: &str,
    from: u64,
    limit: usize,
) -> Result<ReadPage, ReadError> {
    let sid = hub
        .lookup_stream(stream)
        .ok_or_else(|| ReadError::UnknownStream(stream.to_string()))?;
    let snap = hub
        .streams()
        .snapshot(sid)
        .map_err(|e| ReadError::Internal(e.to_string()))?;
    let mut records = Vec::new();
    let next = scan(
        hub,
        &snap,
        from,
        snap.end,
        limit,
        |_, _, _, _, _| true,
        &mut records,
    )?;
    Ok(ReadPage { records, next })
}

/// Visits the records of `snap`'s stream with offsets in `[from, to)` (clamped to the
/// readable end) in offset order, pushing those `accept(graph, segment, offset, point,
/// record)` keeps, until `limit` are kept. Returns the offset after the last one examined.
pub fn scan(
    hub: &Hub,
    snap: &StreamSnapshot,
    from: u64,
    to: u64,
    limit: usize,
    mut accept: impl FnMut(&Graph, SegmentId, u64, u32, &Record) -> bool,
    out: &mut Vec<ReadRecord>,
) -> Result<u64, ReadError> {
    let to = to.min(snap.end);
    let graph = &snap.graph;
    let start_len = out.len();
    let mut next = from;
    while next < to && out.len() - start_len < limit {
        let rows = hub
            .catalog()
            .blocks_from(snap.stream, next, INDEX_PAGE_BLOCKS)?;
        if rows.is_empty() {
            break;
        }
        for row in &rows {
            if row.hub_offset_base >= to {
                return Ok(to);
            }
            let b = load_block(hub, row)?;
            let first = next.saturating_sub(row.hub_offset_base) as usize;
            for i in first..b.records.len() {
                let o = row.hub_offset_base + i as u64;
                if o >= to {
                    return Ok(to);
                }
                next = o + 1;
                let (p, r) = (b.points[i], &b.records[i]);
                let seg = graph.locate(o, p);
                if accept(graph, seg, o, p, r) {
                    out.push(ReadRecord {
                        device: b.device.clone(),
                        epoch: row.epoch,
                        seq: row.first_seq + i as u64,
                        key: r.key.clone(),
                        ts: r.ts,
                        fields: r.fields.clone(),
                        offset: o,
                        ingest_ts: b.ingest_ts,
                        segment: seg,
                    });
                    if out.len() - start_len >= limit {
                        return Ok(next);
                    }
                }
            }
        }
    }
    Ok(next)
}

/// The decoded, verified block of `row`, through the stream manager's cache.
pub fn load_block(hub: &Hub, row: &BlockRow) -> Result<Arc<DecodedBlock>, ReadError> {
    let cache = hub.streams().cache();
    let key = (row.wal_file, row.wal_pos);
    if let Some(b) = cache.get(key) {
        return Ok(b);
    }
    let (entry, block) = hub.wal_reader().read(row)?;
    let mismatch = |what: String| ReadError::Mismatch {
        offset: row.hub_offset_base,
        what,
    };
    let same = entry.kind == KIND_BLOCK
        && entry.device == row.device
        && entry.stream == row.stream
        && entry.epoch == row.epoch
        && entry.first_seq == row.first_seq
        && u64::from(entry.count) == row.count()
        && entry.hub_offset_base == row.hub_offset_base;
    if !same {
        return Err(mismatch(format!("entry header {entry:?}")));
    }
    // Committed blocks passed the ingest limits when they arrived; reading them back must not
    // fail because an operator lowered the limits since, so the reader allows the format's max.
    let decoded =
        sync::block::decode_block(&block, &READ_LIMITS).map_err(|e| mismatch(e.to_string()))?;
    if decoded.header.first_seq != row.first_seq || decoded.records.len() as u64 != row.count() {
        return Err(mismatch("block header differs from the entry".into()));
    }
    let device = hub
        .device_name(row.device)
        .unwrap_or_else(|| format!("#{}", row.device));
    let points = decoded.records.iter().map(|r| key_point(&r.key)).collect();
    let b = Arc::new(DecodedBlock {
        row: row.clone(),
        device,
        ingest_ts: entry.ingest_ts,
        records: decoded.records,
        points,
    });
    cache.put(key, b.clone());
    Ok(b)
}

/// The NDJSON shape of a record.
///
/// `{"device","epoch","seq","key","ts","fields":{name: value},"offset","ingest_ts","segment"}`. Field
/// values: f64 and i64 as JSON numbers (a non-finite f64 as `null`), bool, string, and bytes
/// as an array of numbers 0..=255. Fields keep the producer's order.
#[derive(Serialize)]
struct Line<'a> {
    device: &'a str,
    epoch: u64,
    seq: u64,
    key: &'a str,
    ts: i64,
    fields: Fields<'a>,
    offset: u64,
    ingest_ts: i64,
    segment: SegmentId,
}

struct Fields<'a>(&'a [(String, Value)]);

impl Serialize for Fields<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (name, value) in self.0 {
            map.serialize_entry(name, value)?;
        }
        map.end()
    }
}

/// Appends `r` as one NDJSON line (with its newline) to `out`.
pub fn write_ndjson_line(r: &ReadRecord, out: &mut Vec<u8>) {
    let line = Line {
        device: &r.device,
        epoch: r.epoch,
        seq: r.seq,
        key: &r.key,
        ts: r.ts,
        fields: Fields(&r.fields),
        offset: r.offset,
        ingest_ts: r.ingest_ts,
        segment: r.segment,
    };
    serde_json::to_writer(&mut *out, &line).expect("serialising to a Vec cannot fail");
    out.push(b'\n');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ndjson_line_shape() {
        let r = ReadRecord {
            device: "d1".into(),
            epoch: 2,
            seq: 3,
            key: "k/1".into(),
            ts: -4,
            fields: vec![
                ("z".into(), Value::F64(1.5)),
                ("a".into(), Value::I64(-7)),
                ("b".into(), Value::Bool(true)),
                ("s".into(), Value::Str("x\"y".into())),
                ("raw".into(), Value::Bytes(vec![0, 255])),
                ("nan".into(), Value::F64(f64::NAN)),
            ],
            offset: 9,
            ingest_ts: 10,
            segment: 4,
        };
        let mut out = Vec::new();
        write_ndjson_line(&r, &mut out);
        let text = String::from_utf8(out).unwrap();
        assert_eq!(
            text,
            concat!(
                r#"{"device":"d1","epoch":2,"seq":3,"key":"k/1","ts":-4,"#,
                r#""fields":{"z":1.5,"a":-7,"b":true,"s":"x\"y","raw":[0,255],"nan":null},"offset":9,"ingest_ts":10,"segment":4}"#,
                "\n"
            )
        );
    }
}
