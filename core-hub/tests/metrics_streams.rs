//! `/metrics` for merged streams (splits, merges, open segments, per-segment rates) and for
//! tiering (exported once tiering registered its counters with `Hub::set_tier_stats`).

mod common;

use common::{block, open};
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// The value of the sample line starting with `prefix` (name and labels).
fn sample(text: &str, prefix: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(prefix)?.trim().parse().ok())
}

#[tokio::test]
async fn stream_and_tier_metrics_are_exported() {
    let dir = tempfile::tempdir().unwrap();
    let hub = open(dir.path());
    hub.commit_block("d1", "telemetry", &block("d1", 1, 1, 50))
        .await
        .unwrap();
    let text = core_hub::metrics::render(&hub);
    assert_eq!(
        sample(&text, "tributary_hub_segment_splits_total "),
        Some(0.0)
    );
    assert_eq!(
        sample(&text, "tributary_hub_segment_merges_total "),
        Some(0.0)
    );
    assert_eq!(
        sample(
            &text,
            "tributary_hub_stream_open_segments{stream=\"telemetry\"} "
        ),
        Some(1.0),
        "{text}"
    );
    // One open segment, so one rate line per family, labelled with its segment id.
    for family in [
        "tributary_hub_segment_records_per_second",
        "tributary_hub_segment_bytes_per_second",
        "tributary_hub_segment_load",
    ] {
        let lines = text
            .lines()
            .filter(|l| l.starts_with(&format!("{family}{{stream=\"telemetry\",segment=")))
            .count();
        assert_eq!(lines, 1, "{family}: {text}");
    }
    // Tiering counters appear only once tiering registered them.
    assert!(!text.contains("tributary_hub_tier_records_tiered_total"));
    let stats = Arc::new(core_hub::tiering::TierStats::default());
    stats.records_tiered.store(42, Ordering::Relaxed);
    stats.tier2_down.store(true, Ordering::Relaxed);
    hub.set_tier_stats(stats);
    let text = core_hub::metrics::render(&hub);
    assert_eq!(
        sample(&text, "tributary_hub_tier_records_tiered_total "),
        Some(42.0)
    );
    assert_eq!(sample(&text, "tributary_hub_tier2_down "), Some(1.0));
    assert_eq!(
        sample(&text, "tributary_hub_tier_pushbacks_total "),
        Some(0.0)
    );
    assert_eq!(
        sample(&text, "tributary_hub_tier_field_kind_changes_total "),
        Some(0.0)
    );
}
