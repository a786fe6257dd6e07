//! `core-hub export`: a window much larger than the export's memory bound is streamed into
//! one Parquet file plan range by plan range (row groups, not one in-memory batch): every
//! record of the window exactly once, in offset order, with its content; the most records
//! held at once stays within one plan range; progress is reported per chunk; a damaged chunk
//! object fails the export by name instead of silently leaving rows out (or, when asked, is
//! left out and counted).

mod tier_support;

use core_hub::HubConfig;
use core_hub::tiering::export::{ExportError, ExportOptions, ExportProgress, export_with};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Duration;
use tier_support::*;

/// Event time of `seq` in `common::record`.
const BASE_TS: i64 = 1_764_374_400_000_000_000;
const MS: i64 = 1_000_000;

fn file_config(dir: &Path) -> HubConfig {
    common::config(&dir.join("hub"), |c| {
        c.wal.segment_bytes_max = 256 << 10;
        let t = &mut c.tier2;
        t.url = format!("file://{}", dir.join("tier2").display());
        t.chunk_records_max = 1_000;
        t.chunk_age_max = Duration::from_secs(3600);
    })
}

#[derive(Debug, Default)]
struct Counting {
    total: u64,
    calls: u64,
    last: u64,
}

impl ExportProgress for Counting {
    fn start(&mut self, total: u64) {
        self.total = total;
    }
    fn chunk(&mut self, records: u64) {
        assert!(records >= self.last, "progress never goes back");
        self.calls += 1;
        self.last = records;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_window_is_streamed_with_bounded_memory() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = file_config(dir.path());
    let (hub, t) = open(&cfg).await;
    for d in 0..2 {
        ingest(&hub, &format!("truck-{d}"), 1, 5_000, 100).await;
    }
    flush(&t).await;
    let chunks = t.store().list("streams/telemetry/").await.unwrap().len() as u64;
    assert!(chunks >= 10, "{chunks} chunks");

    // Seqs 1001..=4000 of each device: 6000 records, six times the bound below.
    let (from, to) = (BASE_TS + 1_001 * MS, BASE_TS + 4_001 * MS);
    let out = dir.path().join("window.parquet");
    let opts = ExportOptions {
        batch_records: 256,
        row_group_records: 1_000,
        skip_damaged: false,
    };
    let mut progress = Counting::default();
    let report = export_with(&cfg, "telemetry", from, to, &out, &mut progress, &opts)
        .await
        .unwrap();
    assert_eq!(report.records, 6_000, "{report:?}");
    assert!(
        report.max_buffered_records <= cfg.tier2.chunk_records_max,
        "held {} records at once, more than one plan range",
        report.max_buffered_records
    );
    assert!(
        report.records > 4 * report.max_buffered_records,
        "{report:?}"
    );
    assert_eq!(progress.calls, report.chunks_read);
    assert_eq!(progress.total, report.chunks_read);
    assert_eq!(progress.last, report.records);
    assert!(
        report.chunks_read < chunks,
        "chunks outside the window are skipped"
    );

    let bytes = std::fs::read(&out).unwrap();
    assert_eq!(bytes.len() as u64, report.bytes);
    assert!(!out.with_extension("parquet.tmp").exists());
    // Several row groups (streamed), the chunk files' columns and metadata.
    let meta = parquet::file::metadata::ParquetMetaDataReader::new()
        .parse_and_finish(&std::fs::File::open(&out).unwrap())
        .unwrap();
    assert_eq!(meta.num_row_groups(), 6);
    let records = tier::decode_chunk(bytes.into()).unwrap();
    assert_eq!(records.len(), 6_000);
    let mut seen = std::collections::BTreeSet::new();
    for w in records.windows(2) {
        assert!(w[0].offset < w[1].offset, "offset order, no duplicates");
    }
    for r in &records {
        assert!((from..to).contains(&r.ts_ns));
        assert!((1_001..=4_000).contains(&r.seq));
        let want = common::record(&r.device, r.seq);
        assert_eq!(r.ts_ns, want.ts);
        let mut got = r.fields.clone();
        got.sort_by(|a, b| a.0.cmp(&b.0));
        let mut w = want.fields.clone();
        w.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(got, w);
        assert!(seen.insert((r.device.clone(), r.seq)));
    }

    // A damaged chunk object in the window: the export fails and names it, leaving no file.
    let victim = t
        .store()
        .list("streams/telemetry/")
        .await
        .unwrap()
        .into_iter()
        .nth(3)
        .unwrap();
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(dir.path().join("tier2").join(&victim.path))
        .unwrap();
    let mut b = [0u8];
    f.read_exact_at(&mut b, victim.size / 2).unwrap();
    f.write_all_at(&[b[0] ^ 0x01], victim.size / 2).unwrap();
    let out2 = dir.path().join("damaged.parquet");
    let err = export_with(
        &cfg,
        "telemetry",
        from,
        to,
        &out2,
        &mut Counting::default(),
        &opts,
    )
    .await
    .unwrap_err();
    assert!(
        matches!(&err, ExportError::Damaged { path, .. } if *path == victim.path),
        "{err}"
    );
    assert!(!out2.exists() && !out2.with_extension("parquet.tmp").exists());
    // Asked to, it leaves the damaged chunk out and says so.
    let skipping = ExportOptions {
        skip_damaged: true,
        ..opts
    };
    let partial = export_with(
        &cfg,
        "telemetry",
        from,
        to,
        &out2,
        &mut Counting::default(),
        &skipping,
    )
    .await
    .unwrap();
    assert_eq!(partial.skipped_chunks, 1, "{partial:?}");
    assert_eq!(partial.skipped_records, 1_000);
    assert_eq!(partial.records, 5_000);
    let kept = tier::decode_chunk(std::fs::read(&out2).unwrap().into()).unwrap();
    assert_eq!(kept.len(), 5_000);
    hub.shutdown();
}
