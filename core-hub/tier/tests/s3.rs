//! Tier 2 against a real S3 server (s3s-fs on loopback, see `tier::testing`): put, verify,
//! manifests, listing, read-back, delete, and an outage (server stopped, then restarted).
//! The same operations also run on the local-directory store.

mod common;

use std::time::{Duration, Instant};

use anyhow::Result;
use bytes::Bytes;
use tier::testing::S3sFs;
use tier::{
    EncodeOptions, GetError, Manifest, Tier2, TierConfig, Verified, VerifyError, chunk_path,
    encode_chunk, ingest_date, layout::MANIFEST_VERSION,
};

const DAY: i64 = 1_767_225_600_000_000_000; // 2026-01-01T00:00:00Z

/// Put/verify/manifest/list/read/delete on any store. `digest`: whether the store's ETags are
/// content MD5s, so that [`Tier2::upload_chunk`] verifies without reading back.
async fn exercise(tier: &Tier2, digest: bool) -> Result<()> {
    let records = common::telemetry(20, 50, 1000, DAY + 1);
    let registry = common::registry_for(&records);
    let (bytes, summary) = encode_chunk(&records, &registry, &EncodeOptions::default())?;
    let path = chunk_path("telemetry", 3, 1000, ingest_date(records[0].ingest_ts_ns));
    assert_eq!(
        path,
        "streams/telemetry/ingest_date=2026-01-01/seg-00000003-00000000000000001000.parquet"
    );

    // Verifying before the upload fails (nothing there), then succeeds after it.
    assert!(matches!(
        tier.verify_chunk(&path, &summary).await,
        Err(VerifyError::Store { .. })
    ));
    tier.put_chunk(&path, bytes.clone()).await?;
    tier.verify_chunk(&path, &summary).await?;
    // A re-upload overwrites the same object.
    tier.put_chunk(&path, bytes.clone()).await?;
    assert_eq!(tier.list("streams/telemetry/").await?.len(), 1);

    // Upload and verify in one: by digest where the store gives MD5 ETags, else by footer.
    let how = tier.upload_chunk(&path, bytes.clone(), &summary).await?;
    let expected = if digest {
        Verified::Digest
    } else {
        Verified::Footer
    };
    assert_eq!(how, expected);
    assert_eq!(tier.list("streams/telemetry/").await?.len(), 1);
    // Either way a summary that does not describe the bytes is caught: the wrong size by the
    // HEAD (digest path) or the footer check, the wrong rows by the footer check.
    let mut wrong = summary.clone();
    wrong.bytes += 1;
    assert!(matches!(
        tier.upload_chunk(&path, bytes.clone(), &wrong).await,
        Err(tier::TierError::Verify(VerifyError::Size { .. }))
    ));
    if !digest {
        let mut wrong = summary.clone();
        wrong.rows -= 1;
        assert!(matches!(
            tier.upload_chunk(&path, bytes.clone(), &wrong).await,
            Err(tier::TierError::Verify(VerifyError::Mismatch { .. }))
        ));
    }

    // Verification catches a wrong size, row count or offset range.
    let mut wrong = summary.clone();
    wrong.bytes += 1;
    assert!(matches!(
        tier.verify_chunk(&path, &wrong).await,
        Err(VerifyError::Size { .. })
    ));
    let mut wrong = summary.clone();
    wrong.rows -= 1;
    assert!(matches!(
        tier.verify_chunk(&path, &wrong).await,
        Err(VerifyError::Mismatch { .. })
    ));
    let mut wrong = summary.clone();
    wrong.max_offset += 1;
    assert!(matches!(
        tier.verify_chunk(&path, &wrong).await,
        Err(VerifyError::Mismatch { .. })
    ));
    // A truncated object of the right claimed size is caught by the footer check.
    let torn = "streams/telemetry/ingest_date=2026-01-01/torn.parquet";
    tier.raw_put(torn, bytes.slice(..bytes.len() - 100)).await?;
    let mut claimed = summary.clone();
    claimed.bytes = bytes.len() as u64 - 100;
    assert!(tier.verify_chunk(torn, &claimed).await.is_err());
    tier.delete(torn).await?;

    let manifest = Manifest {
        version: MANIFEST_VERSION,
        stream: "telemetry".into(),
        segment: 3,
        first_offset: 1000,
        end_offset: 2000,
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
    let mpath = tier.put_manifest(&manifest).await?;
    assert_eq!(
        mpath,
        "_tributary/manifests/telemetry/00000000000000001000-seg-00000003.json"
    );
    let mut second = manifest.clone();
    second.first_offset = 10;
    second.segment = 1;
    tier.put_manifest(&second).await?;
    let listed = tier.list_manifests("telemetry").await?;
    assert_eq!(listed, vec![second.clone(), manifest.clone()]);
    assert_eq!(tier.list_streams().await?, vec!["telemetry".to_owned()]);
    assert!(tier.list_manifests("other").await?.is_empty());

    let back = tier.read_chunk(&path).await?;
    assert_eq!(common::normalized(&back), common::normalized(&records));

    tier.delete(&path).await?;
    tier.delete(&path).await?;
    assert!(matches!(
        tier.read_chunk(&path).await,
        Err(GetError::NotFound { .. })
    ));
    assert!(tier.list("streams/").await?.is_empty());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3s_fs_round_trip() -> Result<()> {
    let server = S3sFs::start()?;
    let tier = Tier2::open(&server.config())?;
    exercise(&tier, true).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_round_trip() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let tier = Tier2::open(&TierConfig::Local {
        root: dir.path().join("t2"),
    })?;
    exercise(&tier, false).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outage_fails_fast_and_recovers() -> Result<()> {
    let mut server = S3sFs::start()?;
    let tier = Tier2::open(&server.config())?;
    tier.raw_put("a/1", Bytes::from_static(b"one")).await?;
    server.stop();
    let started = Instant::now();
    assert!(
        tier.raw_put("a/2", Bytes::from_static(b"two"))
            .await
            .is_err()
    );
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
    server.restart()?;
    tier.raw_put("a/2", Bytes::from_static(b"two")).await?;
    let listed: Vec<String> = tier.list("a/").await?.into_iter().map(|o| o.path).collect();
    assert_eq!(listed, ["a/1", "a/2"]);
    assert_eq!(&tier.get("a/1").await?[..], b"one");
    Ok(())
}

#[test]
fn s3_credentials_come_from_config_or_env() {
    let cfg = TierConfig::S3 {
        endpoint: "http://127.0.0.1:1".into(),
        region: "us-east-1".into(),
        bucket: "b".into(),
        access_key_id: Some("k".into()),
        secret_access_key: Some("s".into()),
        allow_http: true,
    };
    assert!(Tier2::open(&cfg).is_ok());
    let parsed: TierConfig = serde_json::from_value(serde_json::json!({
        "kind": "s3", "endpoint": "http://x:9000", "bucket": "b",
        "access_key_id": "k", "secret_access_key": "s"
    }))
    .unwrap();
    assert!(
        matches!(parsed, TierConfig::S3 { ref region, allow_http: false, .. } if region == "us-east-1")
    );
    let local: TierConfig =
        serde_json::from_value(serde_json::json!({"kind": "local", "root": "/x"})).unwrap();
    assert_eq!(local, TierConfig::Local { root: "/x".into() });
}
