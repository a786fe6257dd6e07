//! Reads bounded in bytes (`[read]`): a page stops at `read.page_bytes_max` and the next one
//! starts exactly after it, the block cache stays within `read.cache_bytes_max`, follow
//! responses are capped by `read.follows_max` (503 with a JSON error naming the limit), and a
//! follow client that takes nothing is held to `read.follow_buffer_bytes_max` and cut off after
//! `read.follow_stall_timeout`.

mod common;

use core_hub::client::{self, ApiTarget};
use core_hub::read::{PageLimit, read_records, read_records_with};
use core_hub::{Hub, HubConfig, api};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use sync::block::{VERSION_ROWS, encode_block};
use sync::record::{Record, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn serve(hub: Arc<Hub>) -> (ApiTarget, tokio::sync::oneshot::Sender<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(api::serve(listener, api::router(hub, Vec::new()), async {
        let _ = rx.await;
    }));
    (ApiTarget::from_listen(addr, None), tx)
}

/// Record `seq` of `device` with a string field of `len` bytes.
fn big(device: &str, seq: u64, len: usize) -> Record {
    Record {
        tags: Vec::new(),
        key: format!("{device}/k{}", seq % 3),
        ts: seq as i64,
        fields: vec![
            ("seq".into(), Value::I64(seq as i64)),
            ("blob".into(), Value::Str("x".repeat(len))),
        ],
    }
}

/// `len` bytes that do not compress (xorshift from `seed`).
fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Commits `device`'s records `first..first+sizes.len()` (one string of each size) as blocks
/// of `per_block` records.
async fn commit_sized(hub: &Hub, device: &str, first: u64, sizes: &[usize], per_block: usize) {
    for (k, chunk) in sizes.chunks(per_block).enumerate() {
        let start = first + (k * per_block) as u64;
        let recs: Vec<Record> = chunk
            .iter()
            .enumerate()
            .map(|(i, &len)| big(device, start + i as u64, len))
            .collect();
        let b = encode_block(VERSION_ROWS, 1, start, &recs).unwrap();
        hub.commit_block(device, "telemetry", &b).await.unwrap();
    }
}

fn hub_with(dir: &std::path::Path, edit: impl FnOnce(&mut HubConfig)) -> Arc<Hub> {
    Hub::open(&common::config(dir, edit)).unwrap()
}

async fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

const PAGE: u64 = 64 << 10;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_stop_at_page_bytes_max_and_continue_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let hub = hub_with(dir.path(), |c| c.read.page_bytes_max = PAGE);
    // 300 records of 1..20 KiB, and one of 200 KiB, bigger than a whole page.
    let mut sizes: Vec<usize> = (0..300).map(|i| 1024 + (i * 7919) % (19 << 10)).collect();
    sizes[150] = 200 << 10;
    commit_sized(&hub, "dev1", 1, &sizes, 16).await;

    // The library pages: each within the bound (or a single record), continuing exactly.
    let (mut from, mut seqs, mut pages) = (0u64, Vec::new(), 0);
    loop {
        let page = read_records(&hub, "telemetry", from, 10_000).unwrap();
        if page.records.is_empty() {
            break;
        }
        pages += 1;
        let bytes: u64 = page.records.iter().map(|r| r.decoded_bytes()).sum();
        assert!(
            bytes <= PAGE || page.records.len() == 1,
            "page from {from}: {} records, {bytes} bytes over {PAGE}",
            page.records.len()
        );
        if page.records.iter().any(|r| r.seq == 151) {
            assert_eq!(
                page.records.len(),
                1,
                "the oversized record is a page alone"
            );
        }
        assert_eq!(
            page.records[0].offset, from,
            "the page starts where the last stopped"
        );
        assert_eq!(page.next, page.records.last().unwrap().offset + 1);
        seqs.extend(page.records.iter().map(|r| r.seq));
        from = page.next;
    }
    assert_eq!(
        seqs,
        (1..=300).collect::<Vec<u64>>(),
        "nothing skipped or repeated"
    );
    let total: u64 = sizes.iter().map(|&s| s as u64).sum();
    assert!(
        pages as u64 > total / PAGE,
        "{pages} pages for {total} bytes"
    );
    // The record bound still applies under the byte bound.
    let few = read_records_with(
        &hub,
        "telemetry",
        0,
        PageLimit {
            records: 2,
            bytes: Some(u64::MAX),
        },
    )
    .unwrap();
    assert_eq!(few.records.len(), 2);

    // The HTTP pages are the same pages, and their next offset continues exactly.
    let (target, _stop) = serve(hub.clone()).await;
    let (mut from, mut http_seqs) = (0u64, Vec::new());
    loop {
        let url = format!("/v1/streams/telemetry/records?from={from}&limit=100000");
        let resp = client::get(&target, &url).await.unwrap();
        assert_eq!(resp.status, 200);
        let lines: Vec<serde_json::Value> = resp
            .body
            .split(|&b| b == b'\n')
            .filter(|l| !l.is_empty())
            .map(|l| serde_json::from_slice(l).unwrap())
            .collect();
        if lines.is_empty() {
            break;
        }
        let lib = read_records(&hub, "telemetry", from, 10_000).unwrap();
        assert_eq!(lines.len(), lib.records.len(), "HTTP page from {from}");
        http_seqs.extend(lines.iter().map(|l| l["seq"].as_u64().unwrap()));
        let next: u64 = resp
            .header(api::NEXT_OFFSET_HEADER)
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(next, lib.next);
        from = next;
    }
    assert_eq!(http_seqs, seqs);
    let metrics = client::get(&target, "/metrics").await.unwrap();
    let text = String::from_utf8_lossy(&metrics.body);
    let cut = metric(&text, "tributary_hub_read_pages_cut_by_bytes_total");
    assert!(
        cut >= pages as u64 - 1,
        "{cut} pages counted as cut by bytes"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_block_cache_stays_within_cache_bytes_max() {
    const CACHE: u64 = 256 << 10;
    let dir = tempfile::tempdir().unwrap();
    let hub = hub_with(dir.path(), |c| c.read.cache_bytes_max = CACHE);
    // 40 blocks of 8 records of 4 KiB (about 34 KiB each decoded), then one of 400 KiB.
    commit_sized(&hub, "dev1", 1, &[4 << 10; 320], 8).await;
    commit_sized(&hub, "dev1", 321, &[50 << 10; 8], 8).await;
    let cache = hub.streams().cache();
    assert_eq!(cache.bytes_max(), CACHE);
    let mut from = 0;
    let mut most = 0;
    loop {
        let page = read_records(&hub, "telemetry", from, 7).unwrap();
        if page.records.is_empty() {
            break;
        }
        most = most.max(cache.bytes());
        assert!(cache.bytes() <= CACHE, "{} cached bytes", cache.bytes());
        from = page.next;
    }
    assert_eq!(from, 328, "every record read");
    assert!(
        most > CACHE / 2,
        "the cache was used ({most} bytes at most)"
    );
    assert!(
        cache.len() > 1 && cache.len() < 40,
        "{} blocks cached",
        cache.len()
    );
    let (target, _stop) = serve(hub.clone()).await;
    let text =
        String::from_utf8_lossy(&client::get(&target, "/metrics").await.unwrap().body).into_owned();
    let shown = metric(&text, "tributary_hub_read_cache_bytes");
    assert!(
        shown > 0 && shown <= CACHE,
        "/metrics shows {shown} cached bytes"
    );
    assert_eq!(metric(&text, "tributary_hub_read_cache_bytes_max"), CACHE);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_follow_cap_refuses_with_a_json_error_naming_the_limit() {
    let dir = tempfile::tempdir().unwrap();
    let hub = hub_with(dir.path(), |c| c.read.follows_max = 2);
    commit_sized(&hub, "dev1", 1, &[100; 10], 5).await;
    let (target, _stop) = serve(hub.clone()).await;
    let follows = &hub.streams().read_state().follows_active;
    let mut a = open_follow(&target).await;
    let _b = open_follow(&target).await;
    wait_for("two follows", || follows.load(Ordering::Acquire) == 2).await;
    let resp = client::get(&target, "/v1/streams/telemetry/records?follow=true")
        .await
        .unwrap();
    assert_eq!(resp.status, 503, "{}", String::from_utf8_lossy(&resp.body));
    let err: serde_json::Value = serde_json::from_slice(&resp.body).unwrap();
    assert_eq!(err["limit"], "read.follows_max");
    assert_eq!(err["max"], 2);
    assert!(err["error"].as_str().unwrap().contains("read.follows_max"));
    assert_eq!(
        hub.streams()
            .read_state()
            .follows_refused
            .load(Ordering::Relaxed),
        1
    );
    // A page read is not a follow: still served.
    let page = client::get(&target, "/v1/streams/telemetry/records")
        .await
        .unwrap();
    assert_eq!(page.status, 200);
    // A follow that ends gives its slot back.
    a.shutdown().await.unwrap();
    drop(a);
    wait_for("the slot back", || follows.load(Ordering::Acquire) == 1).await;
    let _c = open_follow(&target).await;
    wait_for("a new follow", || follows.load(Ordering::Acquire) == 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_follow_client_is_bounded_then_cut_off() {
    const BUFFER: u64 = 128 << 10;
    let dir = tempfile::tempdir().unwrap();
    let hub = hub_with(dir.path(), |c| {
        c.read.follow_buffer_bytes_max = BUFFER;
        c.read.follow_stall_timeout = Duration::from_secs(3);
    });
    commit_sized(&hub, "dev1", 1, &[100; 4], 4).await;
    let (target, _stop) = serve(hub.clone()).await;
    let st = hub.streams().read_state();
    // A client that sends its request and then reads nothing at all.
    let stalled = open_follow(&target).await;
    wait_for("the follow", || {
        st.follows_active.load(Ordering::Acquire) == 1
    })
    .await;
    // 48 MB of NDJSON: far more than the socket buffers and the follow buffer hold.
    let mut seq = 5;
    let mut most = 0;
    for _ in 0..48 {
        commit_sized(&hub, "dev1", seq, &[64 << 10; 16], 16).await;
        seq += 16;
        most = most.max(st.follow_buffered_bytes.load(Ordering::Relaxed));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    wait_for("the stalled follow to be cut off", || {
        most = most.max(st.follow_buffered_bytes.load(Ordering::Relaxed));
        st.follows_dropped.load(Ordering::Relaxed) == 1
    })
    .await;
    assert!(most <= BUFFER, "{most} bytes queued for one follow client");
    assert!(most > 0, "the buffer was used");
    wait_for("the slot back", || {
        st.follows_active.load(Ordering::Acquire) == 0
    })
    .await;
    wait_for("the buffer freed", || {
        st.follow_buffered_bytes.load(Ordering::Relaxed) == 0
    })
    .await;
    drop(stalled);
    // The hub serves the next follow from the start (200 records of it, then it ends).
    let mut s = open_follow_with(&target, "&limit=200").await;
    let mut got = Vec::new();
    let mut buf = vec![0u8; 1 << 16];
    let want = 200;
    let deadline = Instant::now() + Duration::from_secs(60);
    while count_lines(&got) < want as usize {
        assert!(
            Instant::now() < deadline,
            "follow got {} lines",
            count_lines(&got)
        );
        let n = tokio::time::timeout(Duration::from_secs(30), s.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(
            n > 0,
            "the follow ended early after {} records (dropped {}, active {})",
            count_lines(&got),
            st.follows_dropped.load(Ordering::Relaxed),
            st.follows_active.load(Ordering::Relaxed)
        );
        got.extend_from_slice(&buf[..n]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tier2_read_through_pages_respect_the_byte_bound() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = common::config(dir.path(), |c| {
        c.read.page_bytes_max = PAGE;
        c.wal.segment_bytes_max = 64 << 10;
        let t = &mut c.tier2;
        t.chunk_records_max = 40;
        t.chunk_age_max = Duration::from_secs(3600);
        t.tier1_retention_time = Duration::ZERO;
        t.tier1_retention_bytes = 0;
        t.tier1_budget_bytes = 1 << 40;
    });
    let hub = Hub::open(&cfg).unwrap();
    let t = core_hub::tiering::Tiering::open(hub.clone(), &cfg, None)
        .await
        .unwrap();
    // Records that do not compress, so that the WAL rolls and its files are evicted.
    for k in 0..30u64 {
        let recs: Vec<Record> = (0..8u64)
            .map(|i| {
                let seq = 1 + k * 8 + i;
                let len = 512 + (seq as usize * 7919) % (12 << 10);
                let mut r = big("dev1", seq, 0);
                r.fields[1].1 = Value::Bytes(noise(seq, len));
                r
            })
            .collect();
        let b = encode_block(VERSION_ROWS, 1, 1 + k * 8, &recs).unwrap();
        hub.commit_block("dev1", "telemetry", &b).await.unwrap();
    }
    for _ in 0..1000 {
        let r = t.run_once(true).await.unwrap();
        if r.ranges_planned == 0 && r.chunks_committed == 0 && r.wal_files_evicted == 0 {
            break;
        }
    }
    let sid = hub.stream_id("telemetry").unwrap();
    let evicted = core_hub::tiering::store::state(hub.catalog(), sid)
        .unwrap()
        .evicted_end;
    assert!(
        evicted > 40,
        "tiering evicted WAL files (tier-1 start {evicted})"
    );
    // Through the shared scan (tier 2, then tier 1) and through a TierReader directly.
    let h = hub.clone();
    let seqs = tokio::task::spawn_blocking(move || {
        let (mut from, mut seqs) = (0u64, Vec::new());
        loop {
            let page = read_records(&h, "telemetry", from, 10_000).unwrap();
            if page.records.is_empty() {
                return seqs;
            }
            let bytes: u64 = page.records.iter().map(|r| r.decoded_bytes()).sum();
            assert!(bytes <= PAGE || page.records.len() == 1, "page from {from}");
            assert_eq!(page.records[0].offset, from);
            seqs.extend(page.records.iter().map(|r| r.seq));
            from = page.next;
        }
    })
    .await
    .unwrap();
    assert_eq!(seqs, (1..=240).collect::<Vec<u64>>());
    let mut reader = core_hub::tiering::read::TierReader::new(t.clone(), "telemetry", None, 0)
        .unwrap()
        .until(evicted);
    let mut direct = Vec::new();
    loop {
        let page = reader.next_page(10_000).await.unwrap();
        if page.records.is_empty() {
            break;
        }
        let bytes: u64 = page.records.iter().map(|r| r.decoded_bytes()).sum();
        assert!(bytes <= PAGE || page.records.len() == 1);
        direct.extend(page.records.iter().map(|r| r.offset));
    }
    assert_eq!(
        direct,
        (0..evicted).collect::<Vec<u64>>(),
        "tier 2 pages continue exactly"
    );
}

#[test]
fn read_keys_parse_with_defaults_and_name_the_key_at_fault() {
    let c = HubConfig::from_toml("data_dir = \"/tmp/x\"").unwrap();
    assert_eq!(c.read.page_bytes_max, 4 << 20);
    assert_eq!(c.read.cache_bytes_max, 256 << 20);
    assert_eq!(c.read.follows_max, 256);
    let c = HubConfig::from_toml(
        "data_dir = \"/tmp/x\"\n[read]\npage_bytes_max = \"1MiB\"\ncache_bytes_max = \"8MiB\"\n\
         follows_max = 3\nfollow_buffer_bytes_max = \"64KiB\"\nfollow_stall_timeout = \"5s\"\n",
    )
    .unwrap();
    assert_eq!(c.read.page_bytes_max, 1 << 20);
    assert_eq!(c.read.cache_bytes_max, 8 << 20);
    assert_eq!(c.read.follows_max, 3);
    assert_eq!(c.read.follow_buffer_bytes_max, 64 << 10);
    assert_eq!(c.read.follow_stall_timeout, Duration::from_secs(5));
    for (toml, key) in [
        ("page_bytes_max = \"10\"", "read.page_bytes_max"),
        ("follows_max = 0", "read.follows_max"),
        (
            "follow_buffer_bytes_max = \"1KiB\"",
            "read.follow_buffer_bytes_max",
        ),
        ("follow_stall_timeout = \"0s\"", "read.follow_stall_timeout"),
    ] {
        let e = HubConfig::from_toml(&format!("data_dir = \"/tmp/x\"\n[read]\n{toml}\n"))
            .unwrap_err()
            .to_string();
        assert!(e.contains(key), "{toml}: {e}");
    }
    let e = HubConfig::from_toml("data_dir = \"/tmp/x\"\n[read]\npage_records_max = 5\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("page_records_max"), "{e}");
}

/// Opens `follow=true` from the start on a raw connection that nobody reads yet.
async fn open_follow(target: &ApiTarget) -> tokio::net::TcpStream {
    open_follow_with(target, "").await
}

/// As [`open_follow`], with more query parameters (`&limit=N`).
async fn open_follow_with(target: &ApiTarget, more: &str) -> tokio::net::TcpStream {
    let mut s = tokio::net::TcpStream::connect(&target.authority)
        .await
        .unwrap();
    let req = format!(
        "GET /v1/streams/telemetry/records?from=start&follow=true{more} HTTP/1.1\r\nHost: {}\r\n\r\n",
        target.authority
    );
    s.write_all(req.as_bytes()).await.unwrap();
    s
}

/// Records in a raw response: one `"device":"dev1"` per NDJSON line (chunk framing falls
/// between whole lines).
fn count_lines(body: &[u8]) -> usize {
    let pat = br#""device":"dev1""#;
    body.windows(pat.len()).filter(|w| w == pat).count()
}

/// The value of an unlabelled series in Prometheus text.
fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in /metrics"))
}
