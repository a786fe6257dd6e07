//! Durability of a local tier 2: every put (chunk, manifest, raw object) syncs its file before
//! the rename and its directory after it, and every directory on the way up to the root; every
//! delete syncs its directory; the root itself is created durably. The syncs are observed
//! through `Tier2::sync_probe` (feature `fault-injection`), and the mutation switches prove
//! the checks fail when either kind of sync is missing: removing a sync call from
//! `tier::durable` fails this suite.

mod common;

use std::path::{Path, PathBuf};

use anyhow::Result;
use bytes::Bytes;
use tier::durable::{SyncEvent, SyncProbe};
use tier::{
    EncodeOptions, Manifest, Tier2, TierConfig, Verified, chunk_path, encode_chunk, ingest_date,
    layout::MANIFEST_VERSION,
};

const DAY: i64 = 1_767_225_600_000_000_000; // 2026-01-01T00:00:00Z

fn open(root: &Path) -> Tier2 {
    Tier2::open(&TierConfig::Local {
        root: root.to_path_buf(),
    })
    .expect("open a local tier 2")
}

fn probe(t: &Tier2) -> &SyncProbe {
    t.sync_probe().expect("a local tier 2 has a sync probe")
}

/// What the test wrote, as files under the root (for the probe's checks).
struct Written {
    puts: Vec<PathBuf>,
    deletes: Vec<PathBuf>,
}

/// A chunk (verified upload), its manifest, a raw object in a fresh deep directory, a second
/// chunk into the now-known directory, and a delete: every kind of tier-2 write.
async fn write_everything(t: &Tier2) -> Result<Written> {
    let root = t.local_root().expect("local").to_path_buf();
    let records = common::telemetry(4, 50, 1000, DAY + 1);
    let registry = common::registry_for(&records);
    let (bytes, summary) = encode_chunk(&records, &registry, &EncodeOptions::default())?;
    let path = chunk_path("telemetry", 3, 1000, ingest_date(records[0].ingest_ts_ns));
    assert_eq!(
        t.upload_chunk(&path, bytes.clone(), &summary).await?,
        Verified::Footer,
        "a local store verifies by reading the (synced) footer back"
    );
    let manifest = Manifest {
        version: MANIFEST_VERSION,
        stream: "telemetry".into(),
        segment: 3,
        first_offset: 1000,
        end_offset: 1200,
        path: path.clone(),
        summary: summary.clone(),
        columns: registry.columns().to_vec(),
        hash_lo: 0,
        hash_hi: 1 << 32,
        segment_start: 0,
        preds: vec![],
        committed_ns: DAY,
        extra: serde_json::Value::Null,
    };
    let mpath = t.put_manifest(&manifest).await?;
    let aside = "_tributary/quarantine/streams/telemetry/a/b/c.parquet";
    t.raw_put(aside, Bytes::from_static(b"damaged bytes"))
        .await?;
    let second = chunk_path("telemetry", 4, 1000, ingest_date(records[0].ingest_ts_ns));
    t.put_chunk(&second, bytes).await?;
    t.delete(aside).await?;
    Ok(Written {
        puts: [&path, &mpath, aside, &second]
            .iter()
            .map(|p| root.join(p))
            .collect(),
        deletes: vec![root.join(aside)],
    })
}

/// The first failing check of the probe over `w`, or `Ok`.
fn check_all(t: &Tier2, w: &Written) -> Result<(), String> {
    let root = t.local_root().expect("local");
    for p in &w.puts {
        probe(t).check_put(root, p)?;
    }
    for p in &w.deletes {
        probe(t).check_delete(p)?;
    }
    Ok(())
}

#[tokio::test]
async fn every_put_and_delete_is_synced_before_it_returns() -> Result<()> {
    let dir = tempfile::tempdir()?;
    // The root does not exist yet: opening creates it and syncs the directories it made.
    let root = dir.path().join("data/tier2");
    let t = open(&root);
    let canon_parent = std::fs::canonicalize(dir.path())?;
    let opened = probe(&t).events();
    for d in [canon_parent.clone(), canon_parent.join("data")] {
        assert!(
            opened
                .iter()
                .any(|e| matches!(e, SyncEvent::Dir(p) if std::fs::canonicalize(p).ok() == Some(d.clone()))),
            "opening did not sync {} (a new directory's parent): {opened:?}",
            d.display()
        );
    }

    let w = write_everything(&t).await?;
    check_all(&t, &w).map_err(anyhow::Error::msg)?;
    let (files, dirs) = probe(&t).counts();
    assert_eq!(files, w.puts.len() as u64, "one file sync per put");
    assert!(
        dirs >= (w.puts.len() + w.deletes.len()) as u64,
        "{dirs} directory syncs for {} puts and {} deletes",
        w.puts.len(),
        w.deletes.len()
    );
    // The synced file is the staging file renamed over the object, nothing else.
    let events = probe(&t).events();
    for e in &events {
        if let SyncEvent::File(f) = e {
            assert!(
                events
                    .iter()
                    .any(|r| matches!(r, SyncEvent::Rename { from, .. } if from == f)),
                "synced {} but never renamed it into place",
                f.display()
            );
        }
    }
    // The objects hold what was written, and no staging file is listed.
    let listed = t.list("").await?;
    assert_eq!(listed.len(), 3, "{listed:?}");
    assert!(listed.iter().all(|o| !o.path.contains('#')), "{listed:?}");
    Ok(())
}

#[tokio::test]
async fn without_file_syncs_the_check_fails() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let t = open(&dir.path().join("tier2"));
    probe(&t).skip_file_syncs(true);
    let w = write_everything(&t).await?;
    let (files, dirs) = probe(&t).counts();
    assert_eq!(files, 0, "the switch skipped every file sync");
    assert!(dirs > 0, "directory syncs still ran");
    let err = check_all(&t, &w).expect_err("unsynced files must fail the check");
    assert!(err.contains("file sync missing"), "{err}");
    Ok(())
}

#[tokio::test]
async fn without_directory_syncs_the_check_fails() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let t = open(&dir.path().join("tier2"));
    // Opening synced the new root into its parent; the switch applies from here on.
    let (_, opened) = probe(&t).counts();
    probe(&t).skip_dir_syncs(true);
    let w = write_everything(&t).await?;
    let (files, dirs) = probe(&t).counts();
    assert_eq!(dirs, opened, "the switch skipped every directory sync");
    assert_eq!(files, w.puts.len() as u64, "file syncs still ran");
    let err = check_all(&t, &w).expect_err("unsynced directories must fail the check");
    assert!(err.contains("directory sync missing"), "{err}");
    Ok(())
}

#[tokio::test]
async fn a_new_directory_is_synced_into_its_parent_up_to_the_root() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let t = open(&dir.path().join("tier2"));
    let root = t.local_root().expect("local").to_path_buf();
    t.raw_put("x/y/z/obj", Bytes::from_static(b"1")).await?;
    let events = probe(&t).events();
    for d in ["x/y/z", "x/y", "x", ""] {
        let want = SyncEvent::Dir(root.join(d).components().collect());
        assert!(events.contains(&want), "{want:?} missing from {events:?}");
    }
    // A second object in the same directory syncs only its file and that directory.
    let before = events.len();
    t.raw_put("x/y/z/obj2", Bytes::from_static(b"2")).await?;
    let more: Vec<_> = probe(&t).events().split_off(before);
    let dirs: Vec<_> = more
        .iter()
        .filter_map(|e| match e {
            SyncEvent::Dir(d) => Some(d.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(dirs, vec![root.join("x/y/z")], "{more:?}");
    // A directory removed behind the store's back is synced into its parent again when made.
    std::fs::remove_dir_all(root.join("x/y"))?;
    let before = probe(&t).events().len();
    t.raw_put("x/y/z/obj3", Bytes::from_static(b"3")).await?;
    let more: Vec<_> = probe(&t).events().split_off(before);
    assert!(
        more.contains(&SyncEvent::Dir(root.join("x"))),
        "x/y made again but x not synced: {more:?}"
    );
    probe(&t)
        .check_put(&root, &root.join("x/y/z/obj3"))
        .map_err(anyhow::Error::msg)?;
    Ok(())
}
