//! Crash recovery of the tier-1 WAL against the catalog.
//!
//! A crash between the WAL fsync and the catalog commit leaves frames after the committed end
//! offset; a crash mid-write leaves a torn frame; a crash mid-roll leaves an extra file. In
//! every case reopening drops exactly the unacknowledged tail, the marks stay consistent, and
//! the agent's resend is accepted exactly once.

mod common;

use common::{block, config, open, read_all, record};
use core_hub::wal::{
    ENTRY_HEADER_LEN, EntryHeader, KIND_BLOCK, WalOpenError, list_wal_files, wal_file_path,
};
use core_hub::{CommitOutcome, Hub, ingest::OpenError};
use std::io::Write;
use sync::record::{Record, Value};

/// Appends a valid frame for `block` to the WAL file at `path`, as the writer would have
/// before crashing ahead of its catalog commit.
fn append_uncommitted_frame(
    path: &std::path::Path,
    device: u32,
    stream: u32,
    first: u64,
    count: u32,
    block: &[u8],
) {
    let header = EntryHeader {
        kind: KIND_BLOCK,
        device,
        stream,
        count,
        epoch: 1,
        first_seq: first,
        hub_offset_base: 10,
        ingest_ts: 1,
        checksum: 0,
    };
    let mut payload = Vec::with_capacity(ENTRY_HEADER_LEN + block.len());
    payload.extend_from_slice(&header.encode());
    payload.extend_from_slice(block);
    let mut f = std::fs::OpenOptions::new().append(true).open(path).unwrap();
    f.write_all(&sync::segment::frame_header(&payload)).unwrap();
    f.write_all(&payload).unwrap();
    // And a torn frame after it.
    f.write_all(&[0xAB; 7]).unwrap();
    f.sync_all().unwrap();
}

#[tokio::test]
async fn uncommitted_tail_is_dropped_and_resend_is_accepted_once() {
    let dir = tempfile::tempdir().unwrap();
    let hub = open(dir.path());
    hub.commit_block("d1", "telemetry", &block("d1", 1, 1, 10))
        .await
        .unwrap();
    let (d, s) = (
        hub.device_id("d1").unwrap(),
        hub.stream_id("telemetry").unwrap(),
    );
    drop(hub);

    let wal = dir.path().join("wal");
    let path = wal_file_path(&wal, list_wal_files(&wal).unwrap()[0]);
    let committed_len = std::fs::metadata(&path).unwrap().len();
    append_uncommitted_frame(&path, d, s, 11, 10, &block("d1", 1, 11, 20));
    assert!(std::fs::metadata(&path).unwrap().len() > committed_len);

    let hub = open(dir.path());
    assert_eq!(std::fs::metadata(&path).unwrap().len(), committed_len);
    assert_eq!(hub.marks("d1")[0].durable_seq, 10);
    assert_eq!(read_all(&hub, "telemetry").len(), 10);
    // The agent resends from the mark: accepted exactly once.
    let out = hub
        .commit_block("d1", "telemetry", &block("d1", 1, 11, 20))
        .await
        .unwrap();
    assert_eq!(
        out,
        CommitOutcome::Committed {
            durable_seq: 20,
            hub_offset_base: 10,
            trimmed: 0
        }
    );
    let out = hub
        .commit_block("d1", "telemetry", &block("d1", 1, 1, 20))
        .await
        .unwrap();
    assert_eq!(out, CommitOutcome::Duplicate { durable_seq: 20 });
    let got = read_all(&hub, "telemetry");
    assert_eq!(
        got.iter().map(|r| (r.seq, r.offset)).collect::<Vec<_>>(),
        (1..=20).map(|s| (s, s - 1)).collect::<Vec<_>>()
    );
    assert_eq!(got[15].fields, record("d1", 16).fields);
}

#[tokio::test]
async fn acknowledged_data_survives_reopen_and_marks_resume() {
    let dir = tempfile::tempdir().unwrap();
    for round in 0..5u64 {
        let hub = open(dir.path());
        let first = round * 10 + 1;
        // A resend of the previous round is a duplicate, the new block is committed.
        if round > 0 {
            let prev = hub
                .commit_block("d1", "telemetry", &block("d1", 1, first - 10, first - 1))
                .await
                .unwrap();
            assert_eq!(
                prev,
                CommitOutcome::Duplicate {
                    durable_seq: first - 1
                }
            );
        }
        let out = hub
            .commit_block("d1", "telemetry", &block("d1", 1, first, first + 9))
            .await
            .unwrap();
        assert_eq!(out.durable_seq(), first + 9);
    }
    let hub = open(dir.path());
    let seqs: Vec<u64> = read_all(&hub, "telemetry").iter().map(|r| r.seq).collect();
    assert_eq!(seqs, (1..=50).collect::<Vec<_>>());
}

fn noisy_block(device: &str, first: u64, last: u64, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let recs: Vec<Record> = (first..=last)
        .map(|seq| {
            let noise: Vec<u8> = (0..20_000)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            Record {
                tags: Vec::new(),
                key: format!("{device}/k"),
                ts: seq as i64,
                fields: vec![("b".into(), Value::Bytes(noise))],
            }
        })
        .collect();
    sync::block::encode_block(sync::block::VERSION_ROWS, 1, first, &recs).unwrap()
}

#[tokio::test]
async fn rolled_files_and_a_half_rolled_file_recover() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), |c| c.wal.segment_bytes_max = 1 << 20);
    let hub = Hub::open(&cfg).unwrap();
    for i in 0..15u64 {
        let b = noisy_block("d1", i * 10 + 1, i * 10 + 10, i + 7);
        hub.commit_block("d1", "telemetry", &b).await.unwrap();
    }
    drop(hub);
    let wal = dir.path().join("wal");
    let files = list_wal_files(&wal).unwrap();
    assert!(files.len() >= 3, "{files:?}");
    // A crash while rolling: the next file exists past the committed end.
    let last = *files.last().unwrap();
    let stray = wal_file_path(&wal, last + (1 << 30));
    std::fs::write(&stray, core_hub::wal::wal_file_header()).unwrap();

    let hub = Hub::open(&cfg).unwrap();
    assert!(!stray.exists());
    assert_eq!(list_wal_files(&wal).unwrap(), files);
    let got = read_all(&hub, "telemetry");
    assert_eq!(
        got.iter().map(|r| r.seq).collect::<Vec<_>>(),
        (1..=150).collect::<Vec<_>>()
    );
    // Appends continue in the last file.
    hub.commit_block("d1", "telemetry", &noisy_block("d1", 151, 160, 99))
        .await
        .unwrap();
    assert_eq!(read_all(&hub, "telemetry").len(), 160);
}

#[tokio::test]
async fn a_second_hub_on_the_same_directory_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let hub = open(dir.path());
    let err = Hub::open(&config(dir.path(), |_| {})).unwrap_err();
    assert!(matches!(err, OpenError::Locked(_)), "{err}");
    drop(hub);
    open(dir.path());
}

#[tokio::test]
async fn damaged_committed_data_fails_loudly() {
    let dir = tempfile::tempdir().unwrap();
    let hub = open(dir.path());
    hub.commit_block("d1", "telemetry", &block("d1", 1, 1, 100))
        .await
        .unwrap();
    drop(hub);
    let wal = dir.path().join("wal");
    let path = wal_file_path(&wal, 0);
    let mut bytes = std::fs::read(&path).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xFF;
    std::fs::write(&path, &bytes).unwrap();
    let err = Hub::open(&config(dir.path(), |_| {})).unwrap_err();
    assert!(
        matches!(err, OpenError::Wal(WalOpenError::Corrupt { .. })),
        "{err}"
    );
    // Committed bytes missing altogether is refused too.
    std::fs::write(&path, &bytes[..mid]).unwrap();
    let err = Hub::open(&config(dir.path(), |_| {})).unwrap_err();
    assert!(
        matches!(err, OpenError::Wal(WalOpenError::Missing { .. })),
        "{err}"
    );
}
