//! The disk budget at process level, `on_full = "block"`: once `disk_bytes_max` is reached,
//! producers get 503 with `Retry-After` and a message naming the setting; the agent stays
//! healthy; and everything acknowledged before is intact after a `kill -9` and a restart.

mod process_support;

use process_support::{Setup, by_seq, content, dir_bytes};
use serde_json::{Value as Json, json};

/// A record as a producer sent it: key, ts, fields.
type Rec = (String, i64, Json);

#[test]
fn block_policy_refuses_with_retry_after_and_keeps_acknowledged_data() {
    let setup = Setup::new(
        "on_full = \"block\"\ndisk_bytes_max = \"256KiB\"\nsegment_bytes_max = \"32KiB\"\nfsync = \"always\"",
    );
    let mut agent = setup.start();
    let client = setup.client();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();

    // Incompressible-ish payloads so the budget fills in a bounded number of batches.
    let mut acked: Vec<(u64, Vec<Rec>)> = Vec::new();
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut last_body;
    let refused = loop {
        let batch: Vec<Rec> = (0..20)
            .map(|i| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let ts = (acked.len() * 100 + i) as i64;
                (
                    format!("k{}", i % 4),
                    ts,
                    json!({ "pad": format!("{x:016x}").repeat(12), "i": i }),
                )
            })
            .collect();
        let body: String = batch
            .iter()
            .map(|(k, ts, f)| format!("{}\n", json!({"key": k, "ts": ts, "fields": f})))
            .collect();
        last_body = body.clone();
        let r = rt
            .block_on(client.post(
                "/v1/streams/telemetry/records",
                "application/x-ndjson",
                body,
            ))
            .unwrap();
        if r.status != 200 {
            break r;
        }
        let a: Json = serde_json::from_slice(&r.body).unwrap();
        acked.push((a["first_seq"].as_u64().unwrap(), batch));
        assert!(acked.len() < 2000, "the budget never filled");
    };
    assert_eq!(refused.status, 503, "{}", refused.text());
    let retry: u64 = refused
        .header("retry-after")
        .expect("a Retry-After header")
        .parse()
        .unwrap();
    assert!(retry >= 1);
    let message = refused.text();
    assert!(
        message.contains("storage.disk_bytes_max") && message.contains("on_full"),
        "{message}"
    );
    assert!(acked.len() >= 5, "only {} batches fit", acked.len());

    // A retry of the same batch is still refused; the agent stays healthy and counts refusals.
    let again = rt.block_on(client.post(
        "/v1/streams/telemetry/records",
        "application/x-ndjson",
        last_body,
    ));
    assert_eq!(again.unwrap().status, 503);
    assert_eq!(rt.block_on(client.get("/healthz")).unwrap().status, 200);
    let metrics = rt.block_on(client.get("/metrics")).unwrap().text();
    let full = metrics
        .lines()
        .find(|l| {
            l.starts_with(
                "tributary_edge_append_errors_total{stream=\"telemetry\",reason=\"full\"}",
            )
        })
        .unwrap();
    assert!(!full.ends_with(" 0"), "{full}");

    let segments = dir_bytes(&setup.data_dir().join("streams"));
    assert!(
        segments <= 256 * 1024 + 32 * 1024,
        "segments hold {segments} bytes, over the budget plus one segment"
    );

    agent.kill9();
    // A restart recovers the directory; dropping the agent kills it again.
    drop(setup.start());
    let lines = setup.inspect();
    let (_, seqs) = by_seq(&lines);
    let total: usize = acked.iter().map(|(_, b)| b.len()).sum();
    assert_eq!(
        seqs.len(),
        total,
        "exactly the acknowledged records are stored"
    );
    for (first, batch) in &acked {
        for (i, want) in batch.iter().enumerate() {
            assert_eq!(&content(seqs[&(first + i as u64)]), want);
        }
    }
}
