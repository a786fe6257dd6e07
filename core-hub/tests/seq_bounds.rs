//! Hub ingest at the top of the seq range: a gap or block reaching past `SEQ_MAX` is refused
//! (`BadGap`, `ReservedSeq`) before anything is queued, so `mark + 1` can never wrap and the
//! catalog's signed integers always hold the mark; the lane keeps working afterwards, also
//! across a restart.

mod common;

use common::{block, open};
use core_hub::IngestError;
use sync::protocol::receiver::SEQ_MAX;

#[tokio::test]
async fn a_gap_to_u64_max_is_refused_and_the_lane_carries_on() {
    let dir = tempfile::tempdir().unwrap();
    let hub = open(dir.path());
    hub.commit_block("d1", "telemetry", &block("d1", 1, 1, 10))
        .await
        .unwrap();
    for last in [u64::MAX, SEQ_MAX + 1] {
        let err = hub
            .record_gap("d1", "telemetry", 1, 11, last, "missing")
            .await
            .unwrap_err();
        assert_eq!(err, IngestError::BadGap { first: 11, last });
    }
    // A block ending past the bound is refused the same way, before it is queued.
    let high = sync::block::encode_block(
        sync::block::VERSION_ROWS,
        1,
        u64::MAX - 1,
        &common::records("d1", 1, 2),
    )
    .unwrap();
    let err = hub
        .commit_block("d1", "telemetry", &high)
        .await
        .unwrap_err();
    assert_eq!(err, IngestError::ReservedSeq);
    // Nothing moved: the next seqs still commit where they belong.
    hub.commit_block("d1", "telemetry", &block("d1", 1, 11, 20))
        .await
        .unwrap();
    let mark = |hub: &core_hub::Hub| {
        hub.marks("d1")
            .iter()
            .find(|m| m.stream == "telemetry")
            .map(|m| m.durable_seq)
    };
    assert_eq!(mark(&hub), Some(20));
    // A gap up to the bound itself is fine, and the mark survives a restart intact.
    let last = hub
        .record_gap("d1", "telemetry", 1, 21, SEQ_MAX, "missing")
        .await
        .unwrap();
    assert_eq!(last, SEQ_MAX);
    drop(hub);
    let hub = open(dir.path());
    assert_eq!(mark(&hub), Some(SEQ_MAX));
}
