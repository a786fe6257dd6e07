//! The minimal reader: committed records of one stream, in hub offset order, from the WAL.
//!
//! A stream's records are found through the catalog's block index (stream, hub offset) and
//! read from the WAL frame each row points at, so reading never scans the log. Every frame is
//! checked against its index row after reading (checksum, device, epoch, seqs, offsets): the
//! pair of the checks the writer made before writing.
//!
//! The merged-streams issue replaces this with per-segment readers; the NDJSON line format
//! ([`write_ndjson_line`]) is the stable surface.

use crate::catalog::BlockRow;
use crate::ingest::Hub;
use crate::wal::{KIND_BLOCK, WalReadError};
use serde::Serialize;
use serde::ser::SerializeMap;
use sync::record::Value;
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
}

/// A page of records and where the next page starts.
#[derive(Debug, Clone, PartialEq)]
pub struct ReadPage {
    pub records: Vec<ReadRecord>,
    /// The hub offset to pass as `from` for the next page.
    pub next: u64,
}

/// Reads up to `limit` records of `stream` with hub offset >= `from`.
pub fn read_records(
    hub: &Hub,
    stream: &str,
    from: u64,
    limit: usize,
) -> Result<ReadPage, ReadError> {
    let sid = hub
        .lookup_stream(stream)
        .ok_or_else(|| ReadError::UnknownStream(stream.to_string()))?;
    let mut records = Vec::new();
    let mut next = from;
    while records.len() < limit {
        let rows = hub.catalog().blocks_from(sid, next, INDEX_PAGE_BLOCKS)?;
        if rows.is_empty() {
            break;
        }
        for row in &rows {
            append_block(hub, row, next, limit, &mut records)?;
            next = records.last().map_or(next, |r| r.offset + 1);
            if records.len() >= limit {
                break;
            }
        }
    }
    Ok(ReadPage { records, next })
}

/// Decodes one indexed block and appends its records at or after `from`, up to `limit`.
fn append_block(
    hub: &Hub,
    row: &BlockRow,
    from: u64,
    limit: usize,
    out: &mut Vec<ReadRecord>,
) -> Result<(), ReadError> {
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
    for (i, r) in decoded.records.into_iter().enumerate() {
        let offset = row.hub_offset_base + i as u64;
        if offset < from {
            continue;
        }
        if out.len() >= limit {
            break;
        }
        out.push(ReadRecord {
            device: device.clone(),
            epoch: row.epoch,
            seq: row.first_seq + i as u64,
            key: r.key,
            ts: r.ts,
            fields: r.fields,
            offset,
            ingest_ts: entry.ingest_ts,
        });
    }
    Ok(())
}

/// The NDJSON shape of a record.
///
/// `{"device","epoch","seq","key","ts","fields":{name: value},"offset","ingest_ts"}`. Field
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
        };
        let mut out = Vec::new();
        write_ndjson_line(&r, &mut out);
        let text = String::from_utf8(out).unwrap();
        assert_eq!(
            text,
            concat!(
                r#"{"device":"d1","epoch":2,"seq":3,"key":"k/1","ts":-4,"#,
                r#""fields":{"z":1.5,"a":-7,"b":true,"s":"x\"y","raw":[0,255],"nan":null},"offset":9,"ingest_ts":10}"#,
                "\n"
            )
        );
    }
}
