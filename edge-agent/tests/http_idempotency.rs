//! `Idempotency-Key` on `POST /v1/streams/{stream}/records`, against the real agent binary: a
//! retried batch gets the original answer and stores nothing twice, also after a `kill -9` and
//! restart (keys are durable); the same key with another body is refused; a failed request
//! does not burn its key; keys are per stream.

mod process_support;

use std::io::{Read as _, Write as _};
use std::net::TcpStream;

use process_support::Setup;
use serde_json::Value as Json;

/// The status, headers (lower-cased) and JSON body of one raw HTTP/1.1 request.
struct Answer {
    status: u16,
    headers: String,
    body: Json,
}

fn post(setup: &Setup, stream: &str, key: Option<&str>, content_type: &str, body: &str) -> Answer {
    let mut s = TcpStream::connect(("127.0.0.1", setup.port)).unwrap();
    let key_line = key.map_or(String::new(), |k| format!("Idempotency-Key: {k}\r\n"));
    write!(
        s,
        "POST /v1/streams/{stream}/records HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
         Content-Type: {content_type}\r\nContent-Length: {}\r\n{key_line}\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let (head, rest) = raw.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    // Bodies are small; axum sends them with a Content-Length, not chunked.
    let body = serde_json::from_str(rest.trim()).unwrap_or(Json::Null);
    Answer {
        status,
        headers: head.to_ascii_lowercase(),
        body,
    }
}

const NDJSON: &str = "application/x-ndjson";

fn batch(ids: std::ops::Range<u32>) -> String {
    ids.map(|i| format!("{{\"key\":\"k\",\"ts\":{i},\"fields\":{{\"id\":{i}}}}}\n"))
        .collect()
}

#[test]
fn retried_key_replays_the_answer_and_stores_nothing_twice() {
    let setup = Setup::new("fsync = \"always\"");
    let mut agent = setup.start();

    let first = post(&setup, "telemetry", Some("batch-1"), NDJSON, &batch(0..3));
    assert_eq!(first.status, 200, "{}", first.body);
    assert!(!first.headers.contains("idempotency-replayed"));
    assert_eq!(first.body["first_seq"], 1);
    assert_eq!(first.body["last_seq"], 3);

    let retry = post(&setup, "telemetry", Some("batch-1"), NDJSON, &batch(0..3));
    assert_eq!(retry.status, 200, "{}", retry.body);
    assert_eq!(retry.body, first.body);
    assert!(
        retry.headers.contains("idempotency-replayed: true"),
        "{}",
        retry.headers
    );

    // The same key with another body is a client bug, not a retry.
    let reused = post(&setup, "telemetry", Some("batch-1"), NDJSON, &batch(5..6));
    assert_eq!(reused.status, 422, "{}", reused.body);
    assert!(
        reused.body["error"]
            .as_str()
            .unwrap()
            .contains("different body")
    );

    // A malformed batch does not store its key: the fixed retry goes through.
    let bad = post(&setup, "telemetry", Some("batch-2"), NDJSON, "{\"key\":");
    assert_eq!(bad.status, 400, "{}", bad.body);
    let fixed = post(&setup, "telemetry", Some("batch-2"), NDJSON, &batch(3..5));
    assert_eq!(fixed.status, 200, "{}", fixed.body);
    assert_eq!(fixed.body["first_seq"], 4);

    // Keys that are not printable ASCII are refused.
    let long = "x".repeat(300);
    let too_long = post(&setup, "telemetry", Some(&long), NDJSON, &batch(9..10));
    assert_eq!(too_long.status, 400, "{}", too_long.body);

    // Keys are durable: after kill -9 the retry still replays.
    agent.kill9();
    let mut agent = setup.start();
    let after = post(&setup, "telemetry", Some("batch-1"), NDJSON, &batch(0..3));
    assert_eq!(after.status, 200);
    assert_eq!(after.body, first.body);
    assert!(after.headers.contains("idempotency-replayed: true"));
    // Without a key, a resend is a new batch.
    let plain = post(&setup, "telemetry", None, NDJSON, &batch(5..6));
    assert_eq!(plain.status, 200);
    assert_eq!(plain.body["first_seq"], 6);
    agent.terminate();

    let ids: Vec<u64> = setup
        .inspect()
        .iter()
        .map(|l| l["fields"]["id"].as_u64().unwrap())
        .collect();
    assert_eq!(ids, [0, 1, 2, 3, 4, 5]);
}

#[test]
fn concurrent_retries_store_the_batch_once() {
    let setup = Setup::new("fsync = \"always\"");
    let mut agent = setup.start();
    let body = batch(0..100);
    let answers: Vec<Answer> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..8)
            .map(|_| s.spawn(|| post(&setup, "telemetry", Some("same"), NDJSON, &body)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // Each answer is the original one, or 409 while the first is still being served.
    let ok: Vec<&Answer> = answers.iter().filter(|a| a.status == 200).collect();
    assert!(!ok.is_empty());
    for a in &answers {
        assert!(
            a.status == 200 || a.status == 409,
            "{} {}",
            a.status,
            a.body
        );
    }
    for a in &ok {
        assert_eq!(a.body["first_seq"], 1);
        assert_eq!(a.body["last_seq"], 100);
    }
    agent.terminate();
    assert_eq!(setup.inspect().len(), 100);
}
