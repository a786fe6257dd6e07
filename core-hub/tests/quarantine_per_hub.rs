//! The tier-1 quarantine belongs to one hub: two hubs in one process (as tests and tools run
//! them) each consult only their own list. A block quarantined in one hub is skipped there and
//! still served by the other, whose block sits at the same WAL position, and a hub opened
//! later on the first one's directory loads that hub's list.

mod common;

use common::{block, open, read_all};
use core_hub::Hub;
use core_hub::catalog::BlockRow;
use core_hub::scrub::{Damaged, is_quarantined, quarantine_block};

fn first_row(hub: &Hub) -> BlockRow {
    let sid = hub.stream_id("telemetry").unwrap();
    hub.catalog().blocks_from(sid, 0, 10).unwrap().remove(0)
}

fn damaged(row: &BlockRow) -> Damaged {
    Damaged {
        wal_file: row.wal_file,
        wal_pos: row.wal_pos,
        device: "d1".into(),
        stream: "telemetry".into(),
        epoch: row.epoch,
        first_seq: row.first_seq,
        last_seq: row.last_seq,
        what: "quarantined by the test".into(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hubs_in_one_process_keep_their_own_quarantine() {
    let (dir_a, dir_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (a, b) = (open(dir_a.path()), open(dir_b.path()));
    for hub in [&a, &b] {
        hub.commit_block("d1", "telemetry", &block("d1", 1, 1, 10))
            .await
            .unwrap();
    }
    let (row_a, row_b) = (first_row(&a), first_row(&b));
    assert_eq!(
        (row_a.wal_file, row_a.wal_pos),
        (row_b.wal_file, row_b.wal_pos),
        "both blocks sit at the same WAL position, so a shared set would hit both"
    );

    assert!(quarantine_block(&a, damaged(&row_a)).unwrap(), "new in a");
    assert!(is_quarantined(&a, &row_a));
    assert!(!is_quarantined(&b, &row_b), "b must not see a's quarantine");
    assert!(read_all(&a, "telemetry").is_empty(), "a skips its block");
    assert_eq!(read_all(&b, "telemetry").len(), 10, "b serves its block");
    let gauge = |hub: &Hub| {
        core_hub::metrics::render(hub)
            .lines()
            .find_map(|l| l.strip_prefix("tributary_hub_quarantined_blocks "))
            .map(str::to_owned)
    };
    assert_eq!(gauge(&a).as_deref(), Some("1"));
    assert_eq!(gauge(&b).as_deref(), Some("0"));
    let health = core_hub::scrub::health_detail(&b).join("\n");
    assert!(!health.contains("tier 1"), "{health}");

    // Reopened, a loads its own list from its directory; b still has none.
    a.shutdown();
    drop(a);
    let a = open(dir_a.path());
    assert!(is_quarantined(&a, &first_row(&a)));
    assert!(!is_quarantined(&b, &row_b));
    assert!(
        core_hub::scrub::health_detail(&a)
            .join("\n")
            .contains("tier 1: 1 WAL block")
    );
    a.shutdown();
    b.shutdown();
}
