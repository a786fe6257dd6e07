//! Per-key rules at ingest: the key-hash range stored in the block index (for segment readers
//! to skip blocks), the per-device key allow-list (`keys_prefixed_by_device`), the key
//! segment rules on every stream (no empty, `.` or `..` segment, no control character), and
//! a record's identity as `(device, key)`.

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

#[tokio::test]
async fn dot_segments_cannot_pass_the_device_prefix() {
    let dir = tempfile::tempdir().unwrap();
    let hub = hub_with(
        dir.path(),
        "[[streams]]\nname = \"telemetry\"\nkeys_prefixed_by_device = true\n",
    );
    // Textually these start with `d1/`; by segment they are not d1's keys.
    for key in ["d1/../d2/x", "d1/./../d2", "d1//d2/x", "d1/"] {
        let mut rs = records("d1", 1, 3);
        rs[1].key = key.into();
        let b = encode_block(VERSION_COLUMNAR, 1, 1, &rs).unwrap();
        let err = hub.commit_block("d1", "telemetry", &b).await.unwrap_err();
        assert!(
            matches!(
                err,
                IngestError::BadKey { .. } | IngestError::ForbiddenKey { .. }
            ),
            "{key}: {err}"
        );
        assert!(err.to_string().starts_with("stream `telemetry`"), "{err}");
    }
    // A bare device id is not under the device's prefix either.
    let mut rs = records("d1", 1, 3);
    rs[0].key = "d1".into();
    let b = encode_block(VERSION_COLUMNAR, 1, 1, &rs).unwrap();
    let err = hub.commit_block("d1", "telemetry", &b).await.unwrap_err();
    assert_eq!(err.code(), "forbidden_key");
    // Nothing of the refused blocks was created, not even the stream.
    assert!(hub.lookup_stream("telemetry").is_none());
    // The device's own keys still pass.
    hub.commit_block("d1", "telemetry", &block("d1", 1, 1, 3))
        .await
        .unwrap();
    assert_eq!(read_all(&hub, "telemetry").len(), 3);
}

#[tokio::test]
async fn ambiguous_keys_are_refused_on_every_stream() {
    let dir = tempfile::tempdir().unwrap();
    let hub = hub_with(dir.path(), "");
    for key in [
        "",
        "/a",
        "a/",
        "a//b",
        ".",
        "x/./y",
        "x/../y",
        "a\0b",
        "a\nb",
        "a\u{1b}[31m",
    ] {
        let mut rs = records("d1", 1, 4);
        rs[2].key = key.into();
        let b = encode_block(VERSION_COLUMNAR, 1, 1, &rs).unwrap();
        let err = hub.commit_block("d1", "open", &b).await.unwrap_err();
        assert_eq!(err.code(), "bad_key", "{key:?}: {err}");
        let msg = err.to_string();
        assert!(msg.starts_with("stream `open` refuses key"), "{msg}");
    }
    // Nothing of the refused blocks is stored; the lane continues from seq 1.
    assert_eq!(hub.marks("d1").iter().map(|m| m.durable_seq).max(), None);
    hub.commit_block("d1", "open", &block("d1", 1, 1, 4))
        .await
        .unwrap();
    assert_eq!(read_all(&hub, "open").len(), 4);
}

#[tokio::test]
async fn a_foreign_looking_key_is_the_writers_own() {
    let dir = tempfile::tempdir().unwrap();
    let hub = hub_with(dir.path(), "");
    // d1 writes the key `d9/engine` (no prefix rule on this stream), d9 writes its own.
    let mut rs = records("d1", 1, 2);
    for r in &mut rs {
        r.key = "d9/engine".into();
    }
    let b = encode_block(VERSION_COLUMNAR, 1, 1, &rs).unwrap();
    hub.commit_block("d1", "open", &b).await.unwrap();
    hub.commit_block("d9", "open", &block("d9", 1, 1, 2))
        .await
        .unwrap();
    let got = read_all(&hub, "open");
    assert_eq!(got.len(), 4);
    // Same key, two identities: every record names the device that shipped it.
    let of = |device: &str| {
        got.iter()
            .filter(|r| r.key == "d9/engine" && r.device == device)
            .count()
    };
    assert_eq!((of("d1"), of("d9")), (2, 2));
}
