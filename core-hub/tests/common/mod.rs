//! Shared helpers for the hub's integration tests: records, blocks and a hub in a temp dir.
#![allow(dead_code)]

pub mod quic;

use core_hub::{Hub, HubConfig};
use std::sync::Arc;
use sync::block::{VERSION_ROWS, encode_block};
use sync::record::{Record, Value};

/// A deterministic record for `(device, seq)`, so any corruption or mix-up shows.
pub fn record(device: &str, seq: u64) -> Record {
    Record {
        tags: Vec::new(),
        key: format!("{device}/engine"),
        ts: 1_764_374_400_000_000_000 + seq as i64 * 1_000_000,
        fields: vec![
            ("temp".into(), Value::F64(20.0 + (seq % 100) as f64 / 4.0)),
            ("seq".into(), Value::I64(seq as i64)),
            ("ok".into(), Value::Bool(seq.is_multiple_of(2))),
            ("who".into(), Value::Str(device.into())),
        ],
    }
}

/// Records `first..=last` of `device`.
pub fn records(device: &str, first: u64, last: u64) -> Vec<Record> {
    (first..=last).map(|s| record(device, s)).collect()
}

/// A v1 block of `device`'s records `first..=last` in `epoch`.
pub fn block(device: &str, epoch: u64, first: u64, last: u64) -> Vec<u8> {
    encode_block(VERSION_ROWS, epoch, first, &records(device, first, last)).unwrap()
}

/// A config in `dir` with test-friendly defaults (`edit` may change it).
pub fn config(dir: &std::path::Path, edit: impl FnOnce(&mut HubConfig)) -> HubConfig {
    let mut cfg = HubConfig::with_data_dir(dir);
    cfg.wal.group_commit_linger = std::time::Duration::from_micros(500);
    edit(&mut cfg);
    cfg
}

/// Opens a hub in `dir`.
pub fn open(dir: &std::path::Path) -> Arc<Hub> {
    Hub::open(&config(dir, |_| {})).unwrap()
}

/// Reads every record of `stream` through the reader, as `(device, seq, offset)`.
pub fn read_all(hub: &Hub, stream: &str) -> Vec<core_hub::read::ReadRecord> {
    let mut out = Vec::new();
    let mut from = 0;
    loop {
        let page = core_hub::read::read_records(hub, stream, from, 1000).unwrap();
        if page.records.is_empty() {
            return out;
        }
        from = page.next;
        out.extend(page.records);
    }
}

/// A version 2 block of `n` records (seqs from `first`) whose keys are `key_len` bytes long:
/// small on the wire, `n * (64 + key_len + ...)` bytes once decoded (`sync::decoded`).
pub fn long_key_block(device: &str, epoch: u64, first: u64, n: u64, key_len: usize) -> Vec<u8> {
    let key = format!("{device}/{}", "k".repeat(key_len - device.len() - 1));
    let recs: Vec<Record> = (first..first + n)
        .map(|s| Record {
            key: key.clone(),
            ..record(device, s)
        })
        .collect();
    encode_block(sync::block::VERSION_COLUMNAR, epoch, first, &recs).unwrap()
}

/// The decoded-size bomb: a hand-made version 2 block whose dictionary names one key of
/// `key_len` bytes and whose `n` records all use it (a few hundred bytes sealed for a 16 KiB
/// key and a million records, which decode to 16 GB). Valid checksums, ts 0, seqs from `first`.
pub fn key_bomb(epoch: u64, first: u64, key_len: usize, n: usize) -> Vec<u8> {
    use sync::varint::{put_bytes, put_u64};
    let mut raw = vec![0u8];
    put_u64(&mut raw, 1);
    put_bytes(&mut raw, "k".repeat(key_len).as_bytes());
    put_u64(&mut raw, 0); // no columns
    put_u64(&mut raw, 1); // one shape, with no column
    put_u64(&mut raw, 0);
    for _ in 0..3 {
        // key, shape and ts columns: plain, one zero per record
        raw.push(0);
        put_bytes(&mut raw, &vec![0u8; n]);
    }
    let body = zstd::bulk::compress(&raw, 19).unwrap();
    let header = sync::block::BlockHeader {
        version: sync::block::VERSION_COLUMNAR,
        flags: 0,
        epoch,
        first_seq: first,
        count: n as u32,
        raw_len: raw.len() as u32,
        min_ts: 0,
        max_ts: 0,
        body_len: body.len() as u32,
        body_crc: crc32c::crc32c(&body),
        raw_crc: crc32c::crc32c(&raw),
    };
    let mut out = sync::block::write_header(&header).to_vec();
    out.extend_from_slice(&body);
    out
}

/// `TRIBUTARY_SOAK=1`: the long versions of the crash loops (docs/reliability.md).
pub fn soak() -> bool {
    std::env::var("TRIBUTARY_SOAK").is_ok_and(|v| v == "1")
}

/// `TRIBUTARY_SEED`, or a fresh seed from the clock (printed by the caller for a replay).
pub fn seed() -> u64 {
    match std::env::var("TRIBUTARY_SEED") {
        Ok(s) => s.parse().expect("TRIBUTARY_SEED is a number"),
        Err(_) => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64),
    }
}

/// The two-worker runtime a crash loop's child process runs its hub on.
pub fn child_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime")
}
