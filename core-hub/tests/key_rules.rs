//! Per-key rules at ingest: the key-hash range stored in the block index (for segment readers
//! to skip blocks), and the per-device key allow-list (`keys_prefixed_by_device`, issue 6 §1).

mod common;

use common::{block, read_all, records};
use core_hub::streams::BlockHashes;
use core_hub::{Hub, IngestError};
use sync::block::{VERSION_COLUMNAR, encode_block};

fn hub_with(dir: &std::path::Path, streams: &str) -> std::sync::Arc<Hub> {
    let toml = format!("data_dir = \"{}\"\n{streams}", dir.display());
    let mut cfg = core_hub::HubConfig::from_toml(&toml).unwrap();
    cfg.wal.group_commit_linger = std::time::Duration::from_micros(500);
    Hub::open(&cfg).unwrap()
}

/// Records `first..=last` of `device` with keys `{prefix}k{n % 5}`.
fn keyed(device: &str, first: u64, last: u64, prefix: &str) -> Vec<sync::record::Record> {
    let mut rs = records(device, first, last);
    for (i, r) in rs.iter_mut().enumerate() {
        r.key = format!("{prefix}k{}", i % 5);
    }
    rs
}

#[tokio::test]
async fn block_index_holds_the_key_hash_range() {
    let dir = tempfile::tempdir().unwrap();
    let hub = hub_with(dir.path(), "");
    let rs = keyed("d1", 1, 40, "d1/");
    let b = encode_block(VERSION_COLUMNAR, 1, 1, &rs).unwrap();
    hub.commit_block("d1", "telemetry", &b).await.unwrap();
    // A trimmed block is re-encoded: its range covers only the records kept.
    let rs2 = keyed("d1", 31, 60, "d1/other-");
    let b2 = encode_block(VERSION_COLUMNAR, 1, 31, &rs2).unwrap();
    hub.commit_block("d1", "telemetry", &b2).await.unwrap();

    let sid = hub.lookup_stream("telemetry").unwrap();
    let rows = hub.catalog().blocks_from(sid, 0, 10).unwrap();
    assert_eq!(rows.len(), 2);
    let want = BlockHashes::of_keys(rs.iter().map(|r| r.key.as_str()));
    assert_eq!(
        (rows[0].key_hash_min, rows[0].key_hash_max),
        (Some(want.min), Some(want.max))
    );
    let kept = &rs2[10..];
    let want = BlockHashes::of_keys(kept.iter().map(|r| r.key.as_str()));
    assert_eq!(
        (rows[1].key_hash_min, rows[1].key_hash_max),
        (Some(want.min), Some(want.max))
    );
    assert!(want.min <= want.max);
}

#[tokio::test]
async fn keys_outside_the_device_prefix_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let hub = hub_with(
        dir.path(),
        "[[streams]]\nname = \"telemetry\"\nkeys_prefixed_by_device = true\n[[streams]]\nname = \"open\"\n",
    );
    // Own keys pass (`common::record` keys are `{device}/engine`).
    hub.commit_block("d1", "telemetry", &block("d1", 1, 1, 5))
        .await
        .unwrap();

    // One foreign key refuses the whole block, naming the stream first and the key.
    let mut rs = records("d1", 6, 10);
    rs[3].key = "d2/engine".into();
    let b = encode_block(VERSION_COLUMNAR, 1, 6, &rs).unwrap();
    let err = hub.commit_block("d1", "telemetry", &b).await.unwrap_err();
    assert_eq!(
        err,
        IngestError::ForbiddenKey {
            stream: "telemetry".into(),
            key: "d2/engine".into(),
            prefix: "d1/".into(),
        }
    );
    let msg = err.to_string();
    assert!(msg.starts_with("stream `telemetry`"), "{msg}");
    assert!(msg.contains("\"d2/engine\""), "{msg}");
    assert_eq!(err.code(), "forbidden_key");
    // A key that only shares the device id as a prefix, without the slash, is foreign too.
    let mut rs = records("d1", 6, 10);
    rs[0].key = "d1x/engine".into();
    let b = encode_block(VERSION_COLUMNAR, 1, 6, &rs).unwrap();
    assert!(matches!(
        hub.commit_block("d1", "telemetry", &b).await.unwrap_err(),
        IngestError::ForbiddenKey { .. }
    ));

    // Nothing of the refused blocks was stored; the next good block continues the lane.
    hub.commit_block("d1", "telemetry", &block("d1", 1, 6, 10))
        .await
        .unwrap();
    assert_eq!(read_all(&hub, "telemetry").len(), 10);
    // Streams without the rule take any key.
    let mut rs = records("d1", 1, 3);
    rs[0].key = "anything".into();
    let b = encode_block(VERSION_COLUMNAR, 1, 1, &rs).unwrap();
    hub.commit_block("d1", "open", &b).await.unwrap();
}
