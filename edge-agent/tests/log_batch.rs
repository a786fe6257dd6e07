//! Seq assignment and batch atomicity: seqs per `(epoch, stream)` start at 1 and have no gaps
//! or overlaps under concurrent producers; a batch larger than a block is split with
//! `FLAG_BATCH_CONTINUES` and is all or nothing after a crash; the async API, durable watch,
//! status and input validation behave as documented.

mod log_util;

use edge_agent::catalog::CatalogLocation;
use edge_agent::log::{AppendError, FsyncPolicy, Log, LogConfig, OpenError};
use edge_agent::storage::{MemStorage, Storage};
use log_util::{read_all, rec};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use sync::block::FLAG_BATCH_CONTINUES;

fn mem_cfg(streams: &[&str]) -> LogConfig {
    LogConfig {
        data_dir: PathBuf::from("/data"),
        streams: streams.iter().map(|s| s.to_string()).collect(),
        fsync: FsyncPolicy::Interval(Duration::from_millis(1)),
        segment_bytes_max: 8192,
        block_records_max: 10,
        catalog: CatalogLocation::Memory,
        ..LogConfig::default()
    }
}

#[test]
fn concurrent_producers_get_contiguous_seqs_per_stream() {
    let mem = MemStorage::with_seed(1);
    let (h, _) = Log::open(mem_cfg(&["a", "b"]), Arc::new(mem)).unwrap();
    let acks = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for t in 0..8u64 {
            let h = h.clone();
            let acks = &acks;
            s.spawn(move || {
                for i in 0..40u64 {
                    let stream = if (t + i) % 3 == 0 { "b" } else { "a" };
                    let n = 1 + (t * 7 + i) % 13;
                    let ack = h
                        .append_blocking(
                            stream,
                            (0..n).map(|k| rec(t * 10_000 + i * 100 + k, 8)).collect(),
                        )
                        .unwrap();
                    assert_eq!(ack.last_seq - ack.first_seq + 1, n);
                    acks.lock().unwrap().push(ack);
                }
            });
        }
    });
    for stream in ["a", "b"] {
        let mut ranges: Vec<(u64, u64)> = acks
            .lock()
            .unwrap()
            .iter()
            .filter(|a| a.stream == stream)
            .map(|a| (a.first_seq, a.last_seq))
            .collect();
        ranges.sort();
        assert_eq!(ranges[0].0, 1, "seqs start at 1");
        for w in ranges.windows(2) {
            assert_eq!(w[0].1 + 1, w[1].0, "no gap and no overlap between batches");
        }
        let top = ranges.last().unwrap().1;
        assert_eq!(read_all(&h, stream, h.epoch()).len() as u64, top);
        let st = h
            .status()
            .streams
            .into_iter()
            .find(|s| s.stream == stream)
            .unwrap();
        assert_eq!((st.next_seq, st.durable_seq), (top + 1, top));
    }
}

#[test]
fn oversized_batch_is_split_with_continuation_flags() {
    let mem = MemStorage::with_seed(2);
    let (h, _) = Log::open(mem_cfg(&["s"]), Arc::new(mem)).unwrap();
    let epoch = h.epoch();
    h.append_blocking("s", vec![rec(0, 5)]).unwrap();
    let ack = h
        .append_blocking("s", (1..36).map(|i| rec(i, 5)).collect())
        .unwrap();
    assert_eq!((ack.first_seq, ack.last_seq), (2, 36));
    let blocks = h.read_blocks("s", epoch, 1, usize::MAX).unwrap();
    let shape: Vec<(u64, u32, bool)> = blocks
        .iter()
        .map(|b| {
            (
                b.header.first_seq,
                b.header.count,
                b.header.flags & FLAG_BATCH_CONTINUES != 0,
            )
        })
        .collect();
    assert_eq!(
        shape,
        vec![
            (2, 10, true),
            (12, 10, true),
            (22, 10, true),
            (32, 5, false)
        ]
    );
    // A batch that fits the block limits is never split.
    h.append_blocking("s", (0..10).map(|i| rec(100 + i, 5)).collect())
        .unwrap();
    let more = h.read_blocks("s", epoch, 36, usize::MAX).unwrap();
    assert_eq!((more.len(), more[0].header.count), (1, 10));
}

#[test]
fn incomplete_split_batch_is_dropped_whole_at_recovery() {
    let mem = MemStorage::with_seed(3);
    let storage: Arc<dyn Storage> = Arc::new(mem.clone());
    let cfg = mem_cfg(&["s"]);
    let (h, _) = Log::open(cfg.clone(), storage.clone()).unwrap();
    let epoch = h.epoch();
    h.append_blocking("s", (0..5).map(|i| rec(i, 5)).collect())
        .unwrap();
    h.append_blocking("s", (5..40).map(|i| rec(i, 5)).collect())
        .unwrap();
    drop(h);
    // Cut the segment right after the third continuation block, as if the batch's last block
    // had never reached the disk.
    let seg = storage
        .list(Path::new("/data/streams/s"))
        .unwrap()
        .into_iter()
        .find(|n| n.ends_with(".seg"))
        .unwrap();
    let path = Path::new("/data/streams/s").join(seg);
    let bytes = mem.contents(&path).unwrap();
    let frames = log_util::block_frames(&bytes);
    assert_eq!(frames.len(), 5);
    storage.truncate(&path, frames[4].offset).unwrap();

    let (h, report) = Log::open(cfg, storage).unwrap();
    assert_eq!(
        report.truncated_records, 30,
        "the three continuation blocks go"
    );
    let held = read_all(&h, "s", epoch);
    assert_eq!(
        held.keys().copied().collect::<Vec<_>>(),
        (1..=5).collect::<Vec<_>>()
    );
    assert!(h.gaps("s").is_empty(), "never acknowledged, so not a gap");
    assert_eq!(
        h.append_blocking("s", vec![rec(99, 1)]).unwrap().first_seq,
        6
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_append_waits_for_durability() {
    let mem = MemStorage::with_seed(4);
    let (h, _) = Log::open(mem_cfg(&["s"]), Arc::new(mem)).unwrap();
    let mut watch = h.durable_watch();
    let before = *watch.borrow_and_update();
    let mut tasks = Vec::new();
    for i in 0..64u64 {
        let h = h.clone();
        tasks.push(tokio::spawn(async move {
            h.append("s", vec![rec(i, 10)]).await
        }));
    }
    let mut seqs = Vec::new();
    for t in tasks {
        seqs.push(t.await.unwrap().unwrap().first_seq);
    }
    seqs.sort();
    assert_eq!(seqs, (1..=64).collect::<Vec<_>>());
    assert!(*watch.borrow_and_update() > before, "durable watch bumped");
    assert_eq!(h.status().streams[0].durable_seq, 64);
    assert!(matches!(
        h.append("nope", vec![rec(1, 1)]).await,
        Err(AppendError::UnknownStream(_))
    ));
    assert!(matches!(
        h.append("s", vec![]).await,
        Err(AppendError::EmptyBatch)
    ));
    h.shutdown();
    assert!(matches!(
        h.append("s", vec![rec(1, 1)]).await,
        Err(AppendError::Closed)
    ));
}

#[test]
fn status_reports_backlog_and_epochs() {
    let mem = MemStorage::with_seed(5);
    let (h, _) = Log::open(mem_cfg(&["s"]), Arc::new(mem)).unwrap();
    let e1 = h.epoch();
    for b in 0..5u64 {
        h.append_blocking("s", (0..4).map(|i| rec(b * 4 + i, 20)).collect())
            .unwrap();
    }
    let st = &h.status().streams[0];
    assert_eq!(st.backlog_blocks, 5);
    assert!(st.backlog_bytes > 0);
    assert_eq!(st.oldest_unsent_ts, Some(rec(0, 0).ts));
    h.set_acked("s", e1, 8, 0).unwrap();
    h.append_blocking("s", vec![rec(50, 1)]).unwrap();
    let st = &h.status().streams[0];
    assert_eq!((st.acked_durable, st.backlog_blocks), (8, 4));
    assert_eq!(st.oldest_unsent_ts, Some(rec(8, 0).ts));
    let e2 = h.mint_epoch().unwrap();
    h.append_blocking("s", vec![rec(60, 1)]).unwrap();
    assert_eq!(h.epochs_held("s"), vec![(e1, 1, 21), (e2, 1, 1)]);
    assert_eq!(h.status().epoch, e2);
}

#[test]
fn bad_config_is_refused_with_a_clear_error() {
    let mem: Arc<dyn Storage> = Arc::new(MemStorage::default());
    for (cfg, needle) in [
        (mem_cfg(&["bad/name"]), "stream name"),
        (mem_cfg(&["s", "s"]), "twice"),
        (
            LogConfig {
                streams: vec![],
                ..mem_cfg(&[])
            },
            "no streams",
        ),
        (
            LogConfig {
                block_records_max: 0,
                ..mem_cfg(&["s"])
            },
            "block_records_max",
        ),
    ] {
        let err = Log::open(cfg, mem.clone()).unwrap_err();
        assert!(matches!(err, OpenError::Config(_)));
        assert!(err.to_string().contains(needle), "{err}");
    }
}

#[test]
fn rekey_moves_records_into_a_higher_epoch() {
    let mem = MemStorage::with_seed(6);
    let storage: Arc<dyn Storage> = Arc::new(mem);
    let cfg = mem_cfg(&["s", "t"]);
    let (h, _) = Log::open(cfg.clone(), storage.clone()).unwrap();
    let e1 = h.epoch();
    assert!(e1 < 1 << 62);
    for b in 0..4u64 {
        h.append_blocking("s", (0..5).map(|i| rec(b * 5 + i, 20)).collect())
            .unwrap();
    }
    h.append_blocking("t", vec![rec(500, 5)]).unwrap();
    let old = read_all(&h, "s", e1);
    let epoch_min = e1 + 1000;
    let rekey = vec![sync::protocol::Rekey {
        stream: "s".into(),
        epoch: e1,
        from_seq: 15,
    }];
    let e2 = h.mint_epoch_rekey(epoch_min, &rekey).unwrap();
    assert!(e2 >= epoch_min);
    let moved = read_all(&h, "s", e2);
    assert_eq!(
        moved.keys().copied().collect::<Vec<_>>(),
        (1..=6).collect::<Vec<_>>()
    );
    assert_eq!(
        moved.values().collect::<Vec<_>>(),
        old.range(15..).map(|(_, r)| r).collect::<Vec<_>>()
    );
    assert_eq!(
        h.append_blocking("s", vec![rec(99, 1)]).unwrap().first_seq,
        7,
        "new data follows the moved records"
    );
    assert_eq!(
        h.append_blocking("t", vec![rec(98, 1)]).unwrap().first_seq,
        1
    );
    assert_eq!(h.epochs_held("s"), vec![(e1, 1, 14), (e2, 1, 7)]);
    assert!(matches!(
        h.mint_epoch_rekey(
            0,
            &[sync::protocol::Rekey {
                stream: "x".into(),
                epoch: e1,
                from_seq: 1
            }]
        ),
        Err(edge_agent::log::MintError::UnknownStream(_))
    ));
    drop(h);
    // The moved copy and the epoch order survive a reopen.
    let (h, _) = Log::open(cfg, storage).unwrap();
    assert_eq!(h.epoch(), e2);
    assert_eq!(read_all(&h, "s", e2).len(), 7);
    assert_eq!(
        h.epochs_held("s"),
        vec![(e1, 1, 14), (e2, 1, 7)],
        "the move mark is durable"
    );
    assert!(h.gaps("s").is_empty(), "a move is not a gap");
    let e3 = h.mint_epoch().unwrap();
    assert!(e3 > e2, "epochs sort in minting order");
}

#[test]
fn rekey_is_all_or_nothing_across_a_crash_at_every_step() {
    let cfg = LogConfig {
        fsync: FsyncPolicy::Always,
        ..mem_cfg(&["s"])
    };
    let mut completed = 0;
    for k in 1..=40u64 {
        let mem = MemStorage::with_seed(k);
        let storage: Arc<dyn Storage> = Arc::new(mem.clone());
        let (h, _) = Log::open(cfg.clone(), storage.clone()).unwrap();
        let e1 = h.epoch();
        for b in 0..6u64 {
            h.append_blocking("s", (0..5).map(|i| rec(b * 5 + i, 20)).collect())
                .unwrap();
        }
        let old = read_all(&h, "s", e1);
        mem.set_crash_at(mem.ops() + k);
        let rekey = [sync::protocol::Rekey {
            stream: "s".into(),
            epoch: e1,
            from_seq: 5,
        }];
        let res = h.mint_epoch_rekey(0, &rekey);
        drop(h);
        let crashed = mem.crash().is_some();
        let (h, _) = Log::open(cfg.clone(), storage).unwrap();
        assert_eq!(
            read_all(&h, "s", e1),
            old,
            "k={k}: the old epoch keeps its records"
        );
        let held = h.epochs_held("s");
        let e2 = h.epoch();
        let copy = if e2 == e1 {
            Default::default()
        } else {
            read_all(&h, "s", e2)
        };
        let want: Vec<_> = old.range(5..).map(|(_, r)| r.clone()).collect();
        assert!(
            copy.is_empty() || copy.values().cloned().collect::<Vec<_>>() == want,
            "k={k}: partial copy"
        );
        if held.first() == Some(&(e1, 1, 4)) {
            assert!(
                !copy.is_empty(),
                "k={k}: records marked as moved but not copied"
            );
        }
        if res.is_ok() {
            // Acknowledged: the copy and the mark are durable.
            assert_eq!((copy.len(), held[0]), (want.len(), (e1, 1, 4)), "k={k}");
            completed += 1;
        }
        if !crashed {
            break;
        }
    }
    assert!(completed > 0, "the crash points never got past the rekey");
}
