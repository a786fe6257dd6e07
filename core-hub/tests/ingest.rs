//! Hub ingest rules: trimming, duplicates, conflicts, limits, names, allow-lists, gaps and
//! pipelining, through `Hub::commit_block` and the reader.

mod common;

use common::{block, config, open, read_all, record, records};
use core_hub::ingest::{BacklogReport, VerifiedBlock};
use core_hub::{CommitOutcome, Hub, IngestError};
use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use sync::block::{BlockHeader, HEADER_LEN, VERSION_COLUMNAR, encode_block, write_header};
use sync::record::{Record, Value};

#[tokio::test]
async fn straddling_block_is_trimmed_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let hub = open(dir.path());
    let out = hub
        .commit_block("d1", "telemetry", &block("d1", 1, 1, 10))
        .await
        .unwrap();
    assert_eq!(
        out,
        CommitOutcome::Committed {
            durable_seq: 10,
            hub_offset_base: 0,
            trimmed: 0
        }
    );
    let out = hub
        .commit_block("d1", "telemetry", &block("d1", 1, 6, 15))
        .await
        .unwrap();
    assert_eq!(
        out,
        CommitOutcome::Committed {
            durable_seq: 15,
            hub_offset_base: 10,
            trimmed: 5
        }
    );
    let got = read_all(&hub, "telemetry");
    assert_eq!(got.len(), 15);
    for (i, r) in got.iter().enumerate() {
        let seq = i as u64 + 1;
        assert_eq!(
            (r.device.as_str(), r.epoch, r.seq, r.offset),
            ("d1", 1, seq, i as u64)
        );
        let want = record("d1", seq);
        assert_eq!(
            (&r.key, r.ts, &r.fields),
            (&want.key, want.ts, &want.fields)
        );
    }
    assert_eq!(hub.marks("d1")[0].durable_seq, 15);
}

#[tokio::test]
async fn replayed_block_is_an_idempotent_duplicate() {
    let dir = tempfile::tempdir().unwrap();
    let hub = open(dir.path());
    hub.commit_block("d1", "telemetry", &block("d1", 1, 1, 10))
        .await
        .unwrap();
    hub.commit_block("d1", "telemetry", &block("d1", 1, 11, 20))
        .await
        .unwrap();
    for _ in 0..3 {
        let out = hub
            .commit_block("d1", "telemetry", &block("d1", 1, 1, 10))
            .await
            .unwrap();
        assert_eq!(out, CommitOutcome::Duplicate { durable_seq: 20 });
    }
    // The same records sealed with other boundaries and another body version are duplicates too.
    let v2 = encode_block(VERSION_COLUMNAR, 1, 11, &records("d1", 11, 20)).unwrap();
    assert_eq!(
        hub.commit_block("d1", "telemetry", &v2).await.unwrap(),
        CommitOutcome::Duplicate { durable_seq: 20 }
    );
    assert_eq!(read_all(&hub, "telemetry").len(), 20);
    assert_eq!(
        hub.stats()
            .duplicates
            .load(std::sync::atomic::Ordering::Relaxed),
        4
    );
}

#[tokio::test]
async fn conflicting_content_fences_the_device_and_raises_the_alarm() {
    let dir = tempfile::tempdir().unwrap();
    let hub = open(dir.path());
    hub.commit_block("d1", "telemetry", &block("d1", 1, 1, 10))
        .await
        .unwrap();
    hub.commit_block("d2", "telemetry", &block("d2", 1, 1, 10))
        .await
        .unwrap();
    // A clone of d1 sends the same seqs with other content.
    let clone = encode_block(sync::block::VERSION_ROWS, 1, 1, &records("clone", 1, 10)).unwrap();
    let err = hub
        .commit_block("d1", "telemetry", &clone)
        .await
        .unwrap_err();
    assert_eq!(
        err,
        IngestError::Conflict {
            first_seq: 1,
            last_seq: 10
        }
    );
    assert!(
        hub.is_fenced("d1")
            .is_some_and(|r| r.contains("seqs 1..=10"))
    );
    // Fenced: even valid new data is refused; other devices carry on.
    let err = hub
        .commit_block("d1", "telemetry", &block("d1", 1, 11, 20))
        .await
        .unwrap_err();
    assert!(matches!(err, IngestError::Fenced(_)));
    hub.commit_block("d2", "telemetry", &block("d2", 1, 11, 20))
        .await
        .unwrap();
    let metrics = core_hub::metrics::render(&hub);
    assert!(
        metrics.contains("\ntributary_hub_conflicts_total 1\n"),
        "{metrics}"
    );
    assert!(
        metrics.contains("\ntributary_hub_fenced_devices 1\n"),
        "{metrics}"
    );
    // Nothing of the conflicting block reached the log, and the fence survives a restart.
    assert_eq!(read_all(&hub, "telemetry").len(), 30);
    drop(hub);
    let hub = open(dir.path());
    assert!(hub.is_fenced("d1").is_some());
    hub.unfence("d1").unwrap();
    hub.commit_block("d1", "telemetry", &block("d1", 1, 11, 20))
        .await
        .unwrap();
}

#[tokio::test]
async fn conflict_with_a_pending_block_is_caught() {
    let dir = tempfile::tempdir().unwrap();
    let hub = open(dir.path());
    let pending = hub
        .submit_block("d1", "telemetry", &block("d1", 1, 1, 10))
        .await
        .unwrap();
    let clone = encode_block(sync::block::VERSION_ROWS, 1, 1, &records("clone", 1, 10)).unwrap();
    let err = hub
        .commit_block("d1", "telemetry", &clone)
        .await
        .unwrap_err();
    assert!(matches!(err, IngestError::Conflict { .. }));
    assert!(matches!(
        pending.wait().await.unwrap(),
        CommitOutcome::Committed {
            durable_seq: 10,
            ..
        }
    ));
}

#[tokio::test]
async fn gaps_out_of_order_and_reserved_seqs() {
    let dir = tempfile::tempdir().unwrap();
    let hub = open(dir.path());
    let err = hub
        .commit_block("d1", "telemetry", &block("d1", 1, 5, 10))
        .await
        .unwrap_err();
    assert_eq!(err, IngestError::OutOfOrder { expected: 1 });
    let err = hub
        .commit_block("d1", "telemetry", &block("d1", 1, 0, 3))
        .await
        .unwrap_err();
    assert_eq!(err, IngestError::ReservedSeq);
    hub.commit_block("d1", "telemetry", &block("d1", 1, 1, 10))
        .await
        .unwrap();
    // A gap moves the mark over seqs that will never come.
    assert_eq!(
        hub.record_gap("d1", "telemetry", 1, 11, 20, "drop-oldest")
            .await
            .unwrap(),
        20
    );
    assert_eq!(
        hub.record_gap("d1", "telemetry", 1, 5, 8, "late")
            .await
            .unwrap(),
        20
    );
    let err = hub
        .record_gap("d1", "telemetry", 1, 30, 40, "ahead")
        .await
        .unwrap_err();
    assert_eq!(err, IngestError::OutOfOrder { expected: 21 });
    hub.commit_block("d1", "telemetry", &block("d1", 1, 21, 30))
        .await
        .unwrap();
    assert_eq!(hub.marks("d1")[0].durable_seq, 30);
    let gaps = hub.catalog().gaps_of(hub.device_id("d1").unwrap()).unwrap();
    assert_eq!(gaps.len(), 1);
    assert_eq!(
        (gaps[0].first_seq, gaps[0].last_seq, gaps[0].reason.as_str()),
        (11, 20, "drop-oldest")
    );
    let seqs: Vec<u64> = read_all(&hub, "telemetry").iter().map(|r| r.seq).collect();
    assert_eq!(seqs, (1..=10).chain(21..=30).collect::<Vec<_>>());
    // Epochs have their own marks.
    hub.commit_block("d1", "telemetry", &block("d1", 2, 1, 5))
        .await
        .unwrap();
    let marks = hub.marks("d1");
    assert_eq!(
        marks
            .iter()
            .map(|m| (m.epoch, m.durable_seq))
            .collect::<Vec<_>>(),
        vec![(1, 30), (2, 5)]
    );
    assert_eq!(hub.epoch_max("d1"), 2);
}

#[tokio::test]
async fn corrupt_and_oversized_blocks_are_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), |c| {
        c.ingest.block_bytes_max = 64 << 10;
        c.ingest.block_raw_bytes_max = 1 << 20;
    });
    let hub = Hub::open(&cfg).unwrap();
    let mut bad = block("d1", 1, 1, 10);
    let last = bad.len() - 1;
    bad[last] ^= 0x40;
    assert!(matches!(
        hub.commit_block("d1", "s", &bad).await,
        Err(IngestError::BadBlock(_))
    ));
    assert!(matches!(
        hub.commit_block("d1", "s", &bad[..20]).await,
        Err(IngestError::BadBlock(_))
    ));
    // Incompressible: the encoded block exceeds block_bytes_max.
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let noise: Vec<u8> = (0..200_000)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    let big = Record {
        tags: Vec::new(),
        key: "k".into(),
        ts: 1,
        fields: vec![("b".into(), Value::Bytes(noise))],
    };
    let big = encode_block(sync::block::VERSION_ROWS, 1, 1, &[big]).unwrap();
    assert!(matches!(
        hub.commit_block("d1", "s", &big).await,
        Err(IngestError::TooLarge { .. })
    ));
    // Compressible but with a decompressed size above block_raw_bytes_max.
    let wide = Record {
        tags: Vec::new(),
        key: "k".into(),
        ts: 1,
        fields: vec![("b".into(), Value::Bytes(vec![0; 2 << 20]))],
    };
    let wide = encode_block(sync::block::VERSION_ROWS, 1, 1, &[wide]).unwrap();
    assert!(wide.len() < 64 << 10);
    let err = hub.commit_block("d1", "s", &wide).await.unwrap_err();
    assert!(
        matches!(err, IngestError::BadBlock(ref m) if m.contains("decompressed size")),
        "{err}"
    );
    assert!(hub.lookup_stream("s").is_none());
    assert_eq!(hub.memory_in_use_bytes(), 0);
}

/// RSS of this process in bytes.
fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

#[tokio::test]
async fn zstd_bomb_is_rejected_with_bounded_memory() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let hub = open(dir.path());
    // 1 GiB of zeros compresses to a few tens of KiB; stream it so the test never holds it.
    let mut enc = zstd::stream::write::Encoder::new(Vec::new(), 1).unwrap();
    let zeros = vec![0u8; 1 << 20];
    for _ in 0..1024 {
        enc.write_all(&zeros).unwrap();
    }
    let body = enc.finish().unwrap();
    assert!(body.len() < 1 << 20);
    let header = BlockHeader {
        version: sync::block::VERSION_ROWS,
        flags: 0,
        epoch: 1,
        first_seq: 1,
        count: 1,
        raw_len: 4096, // the lie: within every limit
        min_ts: 0,
        max_ts: 0,
        body_len: body.len() as u32,
        body_crc: crc32c::crc32c(&body),
        raw_crc: 0,
    };
    let mut bomb = Vec::with_capacity(HEADER_LEN + body.len());
    bomb.extend_from_slice(&write_header(&header));
    bomb.extend_from_slice(&body);
    let before = rss_bytes();
    for _ in 0..4 {
        let err = hub
            .commit_block("d1", "telemetry", &bomb)
            .await
            .unwrap_err();
        assert!(matches!(err, IngestError::BadBlock(_)), "{err}");
    }
    let grown = rss_bytes().saturating_sub(before);
    assert!(grown < 64 << 20, "RSS grew by {grown} bytes");
    assert_eq!(hub.memory_in_use_bytes(), 0);
    // The device was not fenced: a bad block is not a conflict.
    assert!(hub.is_fenced("d1").is_none());
}

#[tokio::test]
async fn bad_stream_names_are_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let hub = open(dir.path());
    let b = block("d1", 1, 1, 3);
    let long = "x".repeat(65);
    for name in [
        "",
        ".",
        "..",
        "../etc",
        "a/b",
        "a\\b",
        "tele metry",
        "é",
        "a\0b",
        long.as_str(),
    ] {
        let err = hub.commit_block("d1", name, &b).await.unwrap_err();
        assert!(
            matches!(err, IngestError::BadStreamName(_)),
            "{name:?}: {err}"
        );
    }
    assert!(hub.catalog().streams().unwrap().is_empty());
    let err = hub
        .commit_block("../d1", "telemetry", &b)
        .await
        .unwrap_err();
    assert_eq!(err, IngestError::BadDeviceId);
}

#[tokio::test]
async fn allow_list_is_enforced() {
    let dir = tempfile::tempdir().unwrap();
    let toml = format!(
        "data_dir = \"{}\"\n[[streams]]\nname = \"telemetry\"\n[[streams]]\nname = \"status\"\n[devices.d1]\nstreams = [\"status\"]\n",
        dir.path().display()
    );
    let hub = Hub::open(&core_hub::HubConfig::from_toml(&toml).unwrap()).unwrap();
    let b = block("d1", 1, 1, 3);
    assert_eq!(
        hub.commit_block("d1", "telemetry", &b).await.unwrap_err(),
        IngestError::Unauthorized("telemetry".into())
    );
    hub.commit_block("d1", "status", &b).await.unwrap();
    hub.commit_block("d2", "telemetry", &block("d2", 1, 1, 3))
        .await
        .unwrap();
    let err = hub
        .commit_block("d2", "other", &block("d2", 1, 1, 3))
        .await
        .unwrap_err();
    assert_eq!(err, IngestError::Unauthorized("other".into()));
    let err = hub
        .record_backlog("d1", "telemetry", BacklogReport::default())
        .unwrap_err();
    assert!(matches!(err, IngestError::Unauthorized(_)));
}

#[tokio::test]
async fn pipelined_submits_commit_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let hub = open(dir.path());
    let mut pending = Vec::new();
    for i in 0..50u64 {
        pending.push(
            hub.submit_block("d1", "telemetry", &block("d1", 1, i * 10 + 1, i * 10 + 10))
                .await
                .unwrap(),
        );
    }
    let mut last = 0;
    for p in pending {
        let out = p.wait().await.unwrap();
        assert!(out.durable_seq() > last);
        last = out.durable_seq();
    }
    assert_eq!(last, 500);
    let got = read_all(&hub, "telemetry");
    assert_eq!(
        got.iter().map(|r| r.seq).collect::<Vec<_>>(),
        (1..=500).collect::<Vec<_>>()
    );
    // Fewer group commits than blocks: queued blocks share fsyncs.
    let fsyncs = hub
        .wal_stats()
        .fsyncs
        .load(std::sync::atomic::Ordering::Relaxed);
    assert!(fsyncs < 50, "{fsyncs} fsyncs for 50 pipelined blocks");
}

#[tokio::test]
async fn verified_blocks_from_the_protocol_skip_decoding() {
    let dir = tempfile::tempdir().unwrap();
    let hub = open(dir.path());
    hub.commit_block("d1", "telemetry", &block("d1", 1, 1, 10))
        .await
        .unwrap();
    let raw = block("d1", 1, 6, 20);
    let header = sync::block::decode_header(&raw).unwrap();
    let vb = VerifiedBlock {
        header,
        block: raw,
        skip_through: 10,
        records: records("d1", 11, 20),
        checksum: None,
    };
    let out = hub.commit_verified("d1", "telemetry", vb).await.unwrap();
    assert!(matches!(
        out,
        CommitOutcome::Committed {
            durable_seq: 20,
            hub_offset_base: 10,
            ..
        }
    ));
    let raw = block("d1", 1, 21, 25);
    let header = sync::block::decode_header(&raw).unwrap();
    let vb = VerifiedBlock {
        header,
        block: raw,
        skip_through: 0,
        records: records("d1", 21, 25),
        // As the receiver computed it: the same value the hub would.
        checksum: Some(core_hub::content_checksum(21, &records("d1", 21, 25))),
    };
    hub.commit_verified("d1", "telemetry", vb).await.unwrap();
    let got = read_all(&hub, "telemetry");
    let seqs: BTreeSet<u64> = got.iter().map(|r| r.seq).collect();
    assert_eq!((got.len(), seqs.len()), (25, 25));
    assert_eq!(got[24].fields, record("d1", 25).fields);
    // The stored checksums are the ones the protocol receiver verifies against.
    let ranges = hub.range_checksums("d1", "telemetry", 1, 0, 100).unwrap();
    assert_eq!(
        ranges
            .iter()
            .map(|r| (r.first_seq, r.last_seq))
            .collect::<Vec<_>>(),
        vec![(1, 10), (11, 20), (21, 25)]
    );
    let want = sync::protocol::checksum::range_checksum(11, &records("d1", 11, 20));
    assert_eq!(ranges[1].checksum, want);
    let tail = hub.range_checksums("d1", "telemetry", 1, 22, 1).unwrap();
    assert_eq!(
        tail.iter().map(|r| r.first_seq).collect::<Vec<_>>(),
        vec![21]
    );
}

#[tokio::test]
async fn contacts_and_backlogs_are_stored() {
    let dir = tempfile::tempdir().unwrap();
    let hub = open(dir.path());
    hub.touch("d1");
    let report = BacklogReport {
        blocks: 3,
        bytes: 3000,
        oldest_unsent_ts: Some(42),
        last_seq: 99,
    };
    hub.record_backlog("d1", "telemetry", report).unwrap();
    // Deferred metadata rides on the next group commit.
    hub.commit_block("d2", "telemetry", &block("d2", 1, 1, 1))
        .await
        .unwrap();
    let id = hub.device_id("d1").unwrap();
    let backlog = hub.catalog().backlog_of(id).unwrap();
    assert_eq!(
        (
            backlog[0].bytes,
            backlog[0].last_seq,
            backlog[0].oldest_unsent_ts
        ),
        (3000, 99, Some(42))
    );
    let devices = hub.catalog().devices().unwrap();
    assert!(
        devices
            .iter()
            .find(|d| d.name == "d1")
            .unwrap()
            .last_contact_ns
            .is_some()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ingest_memory_stays_within_the_budget() {
    let dir = tempfile::tempdir().unwrap();
    let budget = 2u64 << 20;
    let cfg = config(dir.path(), |c| c.ingest.memory_bytes_max = budget);
    let hub = Hub::open(&cfg).unwrap();
    let peak = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut tasks = Vec::new();
    for d in 0..32 {
        let (hub, peak) = (hub.clone(), peak.clone());
        tasks.push(tokio::spawn(async move {
            let dev = format!("d{d}");
            for i in 0..4u64 {
                let b = block(&dev, 1, i * 500 + 1, i * 500 + 500);
                let pending = hub.submit_block(&dev, "telemetry", &b).await.unwrap();
                peak.fetch_max(
                    hub.memory_in_use_bytes(),
                    std::sync::atomic::Ordering::Relaxed,
                );
                pending.wait().await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let peak = peak.load(std::sync::atomic::Ordering::Relaxed);
    assert!(peak > 0 && peak <= budget, "peak {peak} of {budget}");
    assert_eq!(hub.memory_in_use_bytes(), 0);
    assert_eq!(read_all(&hub, "telemetry").len(), 32 * 2000);
}

#[tokio::test]
async fn a_decoded_size_bomb_is_refused_and_honest_devices_are_served() {
    let dir = tempfile::tempdir().unwrap();
    let hub = open(dir.path());
    hub.commit_block("d1", "telemetry", &block("d1", 1, 1, 10))
        .await
        .unwrap();
    // The reported block: a 16 KiB key named once, a million records that each copy it. It
    // passes every wire limit and would decode to 16 GB.
    let bomb = common::key_bomb(1, 1, 16 << 10, 1_000_000);
    assert!(bomb.len() < 512, "{} bytes", bomb.len());
    let limit = hub.decode_limits().decoded_bytes_max;
    assert_eq!(
        limit,
        256 << 20,
        "the default ingest.block_decoded_bytes_max"
    );
    for _ in 0..2 {
        // The agent resends what it holds; each attempt is refused the same way, cheaply.
        let err = hub
            .commit_block("bad", "telemetry", &bomb)
            .await
            .unwrap_err();
        assert_eq!(
            err,
            IngestError::DecodedTooLarge {
                size: 1_000_000 * (sync::decoded::RECORD_OVERHEAD_BYTES + (16 << 10)),
                limit
            }
        );
        assert_eq!(err.code(), "decoded_too_large");
        assert!(err.is_peer_fault());
    }
    let stats = hub.stats();
    assert_eq!(stats.decoded_too_large.load(Ordering::Relaxed), 2);
    assert_eq!(hub.memory_in_use_bytes(), 0, "the budget is given back");
    let metrics = core_hub::metrics::render(&hub);
    assert!(
        metrics.contains("tributary_hub_decoded_too_large_blocks_total 2"),
        "{metrics}"
    );
    // The honest device carries on; nothing of the bomb was stored.
    hub.commit_block("d1", "telemetry", &block("d1", 1, 11, 20))
        .await
        .unwrap();
    let got = read_all(&hub, "telemetry");
    assert_eq!(got.len(), 20);
    assert!(got.iter().all(|r| r.device == "d1"));
    assert!(hub.marks("bad").iter().all(|m| m.durable_seq == 0));
}

#[tokio::test]
async fn the_budget_is_charged_with_the_decoded_size() {
    let dir = tempfile::tempdir().unwrap();
    // A block whose records decode to about 4 MiB but whose body is a few KiB: the budget
    // (2 MiB) cannot cover it, so it must wait for (all of) it rather than slip through on a
    // small estimate; a lower decoded-size limit refuses it outright.
    let heavy = common::long_key_block("d1", 1, 1, 1000, 4000);
    let size = sync::block::size_block(&heavy, &sync::block::DecodeLimits::default())
        .unwrap()
        .decoded_bytes();
    assert!(size > 4_000_000, "{size}");
    let cfg = config(dir.path(), |c| c.ingest.block_decoded_bytes_max = size - 1);
    let hub = Hub::open(&cfg).unwrap();
    let err = hub
        .commit_block("d1", "telemetry", &heavy)
        .await
        .unwrap_err();
    assert_eq!(
        err,
        IngestError::DecodedTooLarge {
            size,
            limit: size - 1
        }
    );
    drop(hub);
    let cfg = config(dir.path(), |c| c.ingest.block_decoded_bytes_max = size);
    let hub = Hub::open(&cfg).unwrap();
    // Hold all but 1 MiB of the budget: the heavy block waits until it is released.
    let budget = hub.memory().available_permits() as u32;
    let held = hub
        .memory()
        .clone()
        .try_acquire_many_owned(budget - 1024)
        .unwrap();
    let submit = {
        let hub = hub.clone();
        let heavy = heavy.clone();
        tokio::spawn(async move { hub.commit_block("d1", "telemetry", &heavy).await })
    };
    // It cannot complete while the budget is held: only sizing fits in what is left.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while hub.memory().available_permits() > 0 && std::time::Instant::now() < deadline {
        tokio::task::yield_now().await;
    }
    assert!(
        !submit.is_finished(),
        "the block committed on an estimate below its size"
    );
    drop(held);
    let out = submit.await.unwrap().unwrap();
    assert!(matches!(
        out,
        CommitOutcome::Committed {
            durable_seq: 1000,
            ..
        }
    ));
    assert_eq!(hub.memory_in_use_bytes(), 0);
}
