//! Mutation check of the page byte bound: with it switched off (`read::mutation`, feature
//! `fault-injection`), the check `read_bounds.rs` makes on every page (its records' decoded
//! size within `read.page_bytes_max`, or a single record) fails, so those tests would catch a
//! reader that pages by record count alone. One test in its own binary, because the switch is
//! process-wide.

mod common;

use core_hub::read::{mutation, read_records};
use sync::block::{VERSION_ROWS, encode_block};
use sync::record::{Record, Value};

const PAGE: u64 = 64 << 10;

/// Whether every page of the stream is within `PAGE` bytes or a single record.
fn every_page_within_the_bound(hub: &core_hub::Hub) -> bool {
    let mut from = 0;
    loop {
        let page = read_records(hub, "telemetry", from, 10_000).unwrap();
        if page.records.is_empty() {
            return true;
        }
        let bytes: u64 = page.records.iter().map(|r| r.decoded_bytes()).sum();
        if bytes > PAGE && page.records.len() > 1 {
            return false;
        }
        from = page.next;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_check_fails_with_the_bound_switched_off() {
    let dir = tempfile::tempdir().unwrap();
    let hub = core_hub::Hub::open(&common::config(dir.path(), |c| {
        c.read.page_bytes_max = PAGE
    }))
    .unwrap();
    let recs: Vec<Record> = (1..=100u64)
        .map(|s| Record {
            tags: Vec::new(),
            key: format!("dev1/k{}", s % 3),
            ts: s as i64,
            fields: vec![("blob".into(), Value::Str("x".repeat(4096)))],
        })
        .collect();
    let block = encode_block(VERSION_ROWS, 1, 1, &recs).unwrap();
    hub.commit_block("dev1", "telemetry", &block).await.unwrap();
    assert!(every_page_within_the_bound(&hub), "with the bound on");
    mutation::set_page_bound_off(true);
    let unbounded = every_page_within_the_bound(&hub);
    mutation::set_page_bound_off(false);
    assert!(
        !unbounded,
        "the page check passed with the bound switched off"
    );
}
