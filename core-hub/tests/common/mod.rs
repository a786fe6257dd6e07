//! Shared helpers for the hub's integration tests: records, blocks and a hub in a temp dir.
#![allow(dead_code)]

use core_hub::{Hub, HubConfig};
use std::sync::Arc;
use sync::block::{VERSION_ROWS, encode_block};
use sync::record::{Record, Value};

/// A deterministic record for `(device, seq)`, so any corruption or mix-up shows.
pub fn record(device: &str, seq: u64) -> Record {
    Record {
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
