//! Merged streams over both tiers: once tiering moved a scaled stream to tier 2 and evicted
//! its WAL files, every reader (the HTTP records API from the start, a reader group, a cut
//! taken before tiering) still yields exactly every record once, in per-key order, with
//! offsets contiguous across the tier-2/tier-1 boundary (read-through, `crate::read::scan_in`).

mod common;

use core_hub::api;
use core_hub::api::NEXT_OFFSET_HEADER;
use core_hub::client::{self, ApiTarget};
use core_hub::config::ScalePolicy;
use core_hub::read::ReadRecord;
use core_hub::streams::reader::{Start, StreamReader};
use core_hub::tiering::Tiering;
use core_hub::{Hub, HubConfig};
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use sync::block::{VERSION_ROWS, encode_block};
use sync::record::{Record, Value};

const STREAM: &str = "telemetry";
const DEVICES: u64 = 2;

/// Records `first..first+n` of device `d`: 64 keys per device, the seq as field `v`.
fn block_of(d: u64, first: u64, n: u64) -> Vec<u8> {
    let records: Vec<Record> = (first..first + n)
        .map(|s| Record {
            tags: Vec::new(),
            key: format!("d{d}/k{}", s % 64),
            ts: s as i64,
            fields: vec![("v".into(), Value::I64(s as i64))],
        })
        .collect();
    encode_block(VERSION_ROWS, 1, first, &records).unwrap()
}

fn config(dir: &std::path::Path) -> HubConfig {
    common::config(dir, |c| {
        c.wal.segment_bytes_max = 64 << 10;
        c.streams.scale.insert(
            STREAM.into(),
            ScalePolicy {
                target_records_per_s: Some(20_000),
                target_bytes_per_s: None,
                window: Duration::from_millis(100),
                min_segments: 1,
                max_segments: 4,
            },
        );
        let t = &mut c.tier2;
        t.chunk_records_max = 3_000;
        t.chunk_bytes_max = 64 << 20;
        t.chunk_age_max = Duration::from_secs(3600);
        t.tier1_retention_time = Duration::ZERO;
        t.tier1_retention_bytes = 0;
        t.tier1_budget_bytes = 1 << 40;
    })
}

/// Runs tiering rounds (sealing everything) until one does nothing.
async fn flush(t: &Tiering) {
    for _ in 0..1000 {
        let r = t.run_once(true).await.unwrap();
        if r.ranges_planned == 0 && r.chunks_committed == 0 && r.wal_files_evicted == 0 {
            return;
        }
    }
    panic!("tiering did not settle");
}

/// Exactly the offsets `from..end`, once each, and every key's seqs increasing.
fn check(what: &str, got: &[(u64, String, String, u64)], from: u64, end: u64) {
    let offsets: BTreeSet<u64> = got.iter().map(|r| r.0).collect();
    assert_eq!(offsets.len(), got.len(), "{what}: an offset twice");
    assert_eq!(
        offsets,
        (from..end).collect::<BTreeSet<u64>>(),
        "{what}: not exactly {from}..{end}"
    );
    let mut last: HashMap<(&str, &str), u64> = HashMap::new();
    for (o, device, key, seq) in got {
        if let Some(prev) = last.insert((device, key), *seq) {
            assert!(
                prev < *seq,
                "{what}: key {key} of {device} out of order at {o}"
            );
        }
    }
}

fn tuple(r: &ReadRecord) -> (u64, String, String, u64) {
    (r.offset, r.device.clone(), r.key.clone(), r.seq)
}

async fn serve(hub: Arc<Hub>) -> (ApiTarget, tokio::sync::oneshot::Sender<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(api::serve(listener, api::router(hub, Vec::new()), async {
        let _ = rx.await;
    }));
    (ApiTarget::from_listen(addr, None), tx)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evicted_history_reads_through_tier2_exactly_once() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path());
    let hub = Hub::open(&cfg).unwrap();
    let t = Tiering::open(hub.clone(), &cfg, None).await.unwrap();
    let sid = hub.stream_id(STREAM).unwrap_or(0);

    // Ingest fast until the stream split (a slow machine needs longer), taking a cut early.
    let mut seq = vec![1u64; DEVICES as usize];
    let mut old_cut = None;
    let deadline = Instant::now() + Duration::from_secs(30);
    while seq[0] <= 40_000
        || (hub.streams().stats().splits.load(Ordering::Relaxed) == 0 && Instant::now() < deadline)
    {
        for d in 0..DEVICES {
            let s = &mut seq[d as usize];
            hub.commit_block(&format!("d{d}"), STREAM, &block_of(d, *s, 400))
                .await
                .unwrap();
            *s += 400;
        }
        if old_cut.is_none() && seq[0] > 4_000 {
            let sid = hub.stream_id(STREAM).unwrap();
            old_cut = Some(hub.streams().tail_cut(sid).unwrap());
        }
    }
    let sid = hub.stream_id(STREAM).unwrap_or(sid);
    assert!(
        hub.streams().stats().splits.load(Ordering::Relaxed) >= 1,
        "the stream split"
    );
    let (old_cut, cut_end) = old_cut.unwrap();

    // Tier everything and evict every WAL file but the active one.
    flush(&t).await;
    let st = core_hub::tiering::store::state(hub.catalog(), sid).unwrap();
    let files = core_hub::wal::list_wal_files(&cfg.wal_dir()).unwrap();
    assert!(
        st.evicted_end > 0,
        "tier 1 evicted something: {st:?}, files {files:?}"
    );
    // Then some records only tier 1 holds, so the reads cross the boundary.
    for d in 0..DEVICES {
        let s = &mut seq[d as usize];
        hub.commit_block(&format!("d{d}"), STREAM, &block_of(d, *s, 300))
            .await
            .unwrap();
        *s += 300;
    }
    let total: u64 = seq.iter().map(|s| s - 1).sum();
    let snap = hub.streams().snapshot(sid).unwrap();
    assert_eq!(snap.end, total);
    assert!(st.evicted_end < total);
    assert!(
        snap.graph
            .segments()
            .iter()
            .any(|s| s.start > 0 && s.start < st.evicted_end),
        "a split lies in the evicted range"
    );

    // The HTTP records API from the start, paging by offset.
    let (target, _stop) = serve(hub.clone()).await;
    let mut got = Vec::new();
    let mut from = 0u64;
    loop {
        let resp = client::get(
            &target,
            &format!("/v1/streams/{STREAM}/records?from={from}&limit=7000"),
        )
        .await
        .unwrap();
        assert_eq!(resp.status, 200, "{}", String::from_utf8_lossy(&resp.body));
        let page: Vec<serde_json::Value> = resp
            .body
            .split(|&b| b == b'\n')
            .filter(|l| !l.is_empty())
            .map(|l| serde_json::from_slice(l).unwrap())
            .collect();
        if page.is_empty() {
            break;
        }
        for l in &page {
            let o = l["offset"].as_u64().unwrap();
            let seg = l["segment"].as_u64().unwrap() as u32;
            let point = core_hub::streams::key_point(l["key"].as_str().unwrap());
            assert_eq!(snap.graph.locate(o, point), seg, "segment of offset {o}");
            got.push((
                o,
                l["device"].as_str().unwrap().to_string(),
                l["key"].as_str().unwrap().to_string(),
                l["seq"].as_u64().unwrap(),
            ));
        }
        from = resp.header(NEXT_OFFSET_HEADER).unwrap().parse().unwrap();
    }
    check("records API", &got, 0, total);
    // Contiguous in offset order across the boundary.
    assert!(got.windows(2).all(|w| w[1].0 == w[0].0 + 1));

    // A reader group from the start, segment by segment.
    let groups = hub.streams().groups();
    groups
        .create(&hub, sid, "g", &Start::Beginning, Duration::from_secs(10))
        .unwrap();
    let reader = groups.join(&hub, sid, "g", "r").unwrap();
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while (got.len() as u64) < total {
        assert!(Instant::now() < deadline, "group: {} of {total}", got.len());
        let b = reader.poll(5_000, Duration::from_millis(20)).await.unwrap();
        got.extend(b.records.iter().map(tuple));
        reader.checkpoint(&b.positions).unwrap();
    }
    let b = reader.poll(5_000, Duration::from_millis(20)).await.unwrap();
    assert!(b.records.is_empty(), "nothing after everything");
    check("group", &got, 0, total);

    // A cut taken before tiering: exactly the later records, also from tier 2.
    let h = hub.clone();
    let got = tokio::task::spawn_blocking(move || {
        let mut r = StreamReader::open(h, STREAM, Start::Cut(old_cut), None).unwrap();
        let mut out = Vec::new();
        loop {
            let page = r.read(5_000).unwrap();
            if page.is_empty() {
                return out;
            }
            out.extend(page.iter().map(tuple));
        }
    })
    .await
    .unwrap();
    assert!(cut_end < st.evicted_end, "the cut lies in tier 2");
    check("old cut", &got, cut_end, total);
}
