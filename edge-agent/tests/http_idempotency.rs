//! `Idempotency-Key` on `POST /v1/streams/{stream}/records`, against the real agent binary: a
//! retried batch gets the original answer and stores nothing twice, also after a `kill -9` and
//! restart (keys are durable); the same key with another body is refused; a failed request
//! does not burn its key; keys are per stream; a body cannot carry the reserved key field.
//!
//! The kill test: producers post keyed batches and retry every batch that got no answer (the
//! agent was killed) with the same key after the restart, and re-post some answered ones; every
//! batch must be stored exactly once, at the seqs of its first answer. It counts the retries
//! that found their batch already stored (the kill came after the batch was durable, before the
//! answer reached the client) and fails if there were none. 30 kills by default,
//! `TRIBUTARY_SOAK=1` runs 300; the seed is printed, `TRIBUTARY_SEED=N` replays its kill times.

mod process_support;

use std::collections::{HashMap, VecDeque};
use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use process_support::Setup;
use rand::rngs::SmallRng;
use rand::{Rng as _, SeedableRng as _};
use serde_json::Value as Json;

/// The status, headers (lower-cased) and JSON body of one raw HTTP/1.1 request.
struct Answer {
    status: u16,
    headers: String,
    body: Json,
}

fn post(setup: &Setup, stream: &str, key: Option<&str>, content_type: &str, body: &str) -> Answer {
    try_post(setup.port, stream, key, content_type, body).unwrap()
}

/// One request; `Err` when the connection failed or closed before a whole answer (a kill).
fn try_post(
    port: u16,
    stream: &str,
    key: Option<&str>,
    content_type: &str,
    body: &str,
) -> std::io::Result<Answer> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    let key_line = key.map_or(String::new(), |k| format!("Idempotency-Key: {k}\r\n"));
    write!(
        s,
        "POST /v1/streams/{stream}/records HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
         Content-Type: {content_type}\r\nContent-Length: {}\r\n{key_line}\r\n{body}",
        body.len()
    )?;
    let mut raw = String::new();
    s.read_to_string(&mut raw)?;
    let cut = || std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "answer cut short");
    let (head, rest) = raw.split_once("\r\n\r\n").ok_or_else(cut)?;
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(cut)?;
    // Bodies are small; axum sends them with a Content-Length, not chunked.
    let body = serde_json::from_str(rest.trim()).unwrap_or(Json::Null);
    Ok(Answer {
        status,
        headers: head.to_ascii_lowercase(),
        body,
    })
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
    let epoch = process_support::epoch_of(&first.body);
    assert_eq!(process_support::epoch_of(&retry.body), epoch);
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
    assert_eq!(process_support::epoch_of(&after.body), epoch);
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

#[test]
fn a_body_cannot_carry_the_reserved_key_field() {
    let setup = Setup::new("fsync = \"always\"");
    let mut agent = setup.start();
    let forged = "{\"key\":\"k\",\"ts\":1,\"fields\":{\"x\":1}}\n\n\
                  {\"key\":\"k\",\"ts\":2,\"fields\":{\"_idempotency\":\"1 00 1 1 x\"}}\n";
    for key in [None, Some("forged")] {
        let a = post(&setup, "telemetry", key, NDJSON, forged);
        assert_eq!(a.status, 400, "{}", a.body);
        let msg = a.body["error"].as_str().unwrap();
        assert!(msg.contains("\"_idempotency\" is reserved"), "{msg}");
        assert_eq!(a.body["line"], 3, "{}", a.body);
    }
    let lp = post(
        &setup,
        "telemetry",
        None,
        "text/plain",
        "telemetry _idempotency=\"x\" 5\n",
    );
    assert_eq!(lp.status, 400, "{}", lp.body);
    // The key record: the batch's last record carries the key, its body digest and its count.
    let ok = post(&setup, "telemetry", Some("order 7"), NDJSON, &batch(0..3));
    assert_eq!(ok.status, 200, "{}", ok.body);
    agent.terminate();
    let lines = setup.inspect();
    assert_eq!(lines.len(), 3);
    let tags: Vec<Option<&str>> = lines
        .iter()
        .map(|l| l["fields"]["_idempotency"].as_str())
        .collect();
    assert!(tags[0].is_none() && tags[1].is_none(), "{tags:?}");
    let tag = tags[2].expect("the last record carries the key");
    let parts: Vec<&str> = tag.splitn(5, ' ').collect();
    assert_eq!(
        (parts[0], parts[2], parts[4]),
        ("1", "3", "order 7"),
        "{tag}"
    );
}

/// The shared state of the kill test's producers.
#[derive(Debug, Default)]
struct Work {
    /// Batches that got no answer yet, retried first.
    pending: VecDeque<u64>,
    /// The first answer of each answered batch.
    answered: HashMap<u64, Json>,
    /// Batches answered before, to post again.
    answered_order: Vec<u64>,
    next: u64,
    /// Retries of unanswered batches that were answered as replays (stored before the kill).
    retried_replayed: u64,
    /// Retries of unanswered batches that stored them now.
    retried_appended: u64,
    /// Answered batches posted again (each must replay the first answer).
    reposted: u64,
    /// 503 "may be stored" answers.
    may_be_stored: u64,
}

/// The records of batch `b`: a fixed size per batch, so a retry sends the same body.
fn kill_batch(b: u64) -> String {
    let n = 1 + (b * 7) % 30;
    (0..n)
        .map(|i| {
            format!(
                "{{\"key\":\"dev-{}\",\"ts\":{},\"fields\":{{\"batch\":{b},\"i\":{i},\"n\":{n}}}}}\n",
                b % 4,
                b * 1000 + i
            )
        })
        .collect()
}

/// Takes the next batch to post: a pending one, now and then an answered one, else a new one.
fn take(work: &Mutex<Work>, rng: &mut SmallRng) -> (u64, bool) {
    let mut w = work.lock().unwrap();
    if let Some(b) = w.pending.pop_front() {
        return (b, true);
    }
    if !w.answered_order.is_empty() && rng.random_bool(0.15) {
        let b = w.answered_order[rng.random_range(0..w.answered_order.len())];
        return (b, false);
    }
    w.next += 1;
    (w.next, false)
}

/// Records one answer (or its absence) for batch `b`.
fn settle(work: &Mutex<Work>, b: u64, retry: bool, answer: std::io::Result<Answer>) -> bool {
    let mut w = work.lock().unwrap();
    let a = match answer {
        Ok(a) if a.status == 200 => a,
        Ok(a) if a.status == 503 && a.body["may_be_stored"] == true => {
            w.may_be_stored += 1;
            w.pending.push_back(b);
            return false;
        }
        // Two producers posting the same answered batch again at once.
        Ok(a) if a.status == 409 && w.answered.contains_key(&b) => return true,
        Ok(a) => panic!("batch {b}: unexpected answer {} {}", a.status, a.body),
        Err(_) => {
            // Killed: no answer; retry with the same key after the restart.
            if !w.answered.contains_key(&b) {
                w.pending.push_back(b);
            }
            return false;
        }
    };
    let replayed = a.headers.contains("idempotency-replayed: true");
    if let Some(first) = w.answered.get(&b) {
        assert_eq!(&a.body, first, "batch {b} replayed another answer");
        assert!(replayed, "batch {b} answered twice without a replay");
        w.reposted += 1;
        return true;
    }
    if retry && replayed {
        w.retried_replayed += 1;
    } else if retry {
        w.retried_appended += 1;
    }
    w.answered.insert(b, a.body);
    w.answered_order.push(b);
    true
}

fn producer(port: u16, work: &Mutex<Work>, answers: &AtomicU64, stop: &AtomicBool, seed: u64) {
    let mut rng = SmallRng::seed_from_u64(seed);
    while !stop.load(Ordering::Relaxed) {
        let (b, retry) = take(work, &mut rng);
        let key = format!("batch-{b}");
        let answer = try_post(port, "telemetry", Some(&key), NDJSON, &kill_batch(b));
        if !settle(work, b, retry, answer) {
            // No answer: the agent is gone (or going); the batch waits for the restart.
            return;
        }
        answers.fetch_add(1, Ordering::Relaxed);
    }
}

fn seed() -> u64 {
    let seed = std::env::var("TRIBUTARY_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    println!("seed {seed} (replay with TRIBUTARY_SEED={seed})");
    seed
}

/// One start, producers posting, and a SIGKILL at a random moment.
fn kill_cycle(setup: &Setup, work: &Arc<Mutex<Work>>, rng: &mut SmallRng, cycle: u64) {
    let mut agent = setup.start();
    let answers = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let producers: Vec<_> = (0..3)
        .map(|p| {
            let (work, answers, stop) = (work.clone(), answers.clone(), stop.clone());
            let (port, seed) = (setup.port, rng.random::<u64>() ^ (cycle << 8 | p));
            std::thread::spawn(move || producer(port, &work, &answers, &stop, seed))
        })
        .collect();
    if rng.random_bool(0.5) {
        let want = rng.random_range(0..10u64);
        let deadline = Instant::now() + Duration::from_secs(20);
        while answers.load(Ordering::Relaxed) < want && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
    } else {
        // The kill moment itself is what is drawn here, not a wait for a condition.
        std::thread::sleep(Duration::from_micros(rng.random_range(0..20_000)));
    }
    agent.kill9();
    stop.store(true, Ordering::Relaxed);
    for p in producers {
        p.join().unwrap();
    }
}

/// Every answered batch is stored exactly once, whole, at the seqs of its first answer, and
/// nothing else is stored.
fn check_stored_once(setup: &Setup, work: &Work) {
    let mut rows: HashMap<u64, Vec<(u64, u64)>> = HashMap::new();
    for l in setup.inspect() {
        let b = l["fields"]["batch"].as_u64().unwrap();
        let seq = l["seq"].as_u64().unwrap();
        rows.entry(b).or_default().push((
            seq,
            sync::epoch::parse(l["epoch"].as_str().unwrap()).unwrap(),
        ));
    }
    assert_eq!(
        rows.len(),
        work.answered.len(),
        "stored batches that were never answered, or answered ones missing"
    );
    for (b, answer) in &work.answered {
        let mut got = rows.remove(b).unwrap_or_default();
        got.sort();
        let (first, last) = (
            answer["first_seq"].as_u64().unwrap(),
            answer["last_seq"].as_u64().unwrap(),
        );
        let epoch = sync::epoch::parse(answer["epoch"].as_str().unwrap()).unwrap();
        let want: Vec<(u64, u64)> = (first..=last).map(|s| (s, epoch)).collect();
        assert_eq!(
            got, want,
            "batch {b} is not stored once at its answered seqs {answer}"
        );
    }
}

#[test]
fn kill9_during_keyed_posts_and_retries_stores_every_batch_once() {
    let seed = seed();
    let mut rng = SmallRng::seed_from_u64(seed);
    let kills = if std::env::var("TRIBUTARY_SOAK").is_ok_and(|v| v == "1") {
        300
    } else {
        30
    };
    let setup =
        Setup::new("fsync = \"always\"\nsegment_bytes_max = \"64KiB\"\nblock_records_max = 8");
    let work = Arc::new(Mutex::new(Work::default()));
    for cycle in 0..kills {
        kill_cycle(&setup, &work, &mut rng, cycle);
    }
    // A last start: every batch still without an answer is retried until it has one.
    let mut agent = setup.start();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let next = work.lock().unwrap().pending.pop_front();
        let Some(b) = next else { break };
        assert!(Instant::now() < deadline, "batch {b} never got an answer");
        let answer = try_post(
            setup.port,
            "telemetry",
            Some(&format!("batch-{b}")),
            NDJSON,
            &kill_batch(b),
        );
        assert!(
            settle(&work, b, true, answer),
            "batch {b}: no answer from a running agent"
        );
    }
    agent.terminate();
    let work = work.lock().unwrap();
    println!(
        "{kills} kills: {} batches answered, {} retries after a kill found their batch stored \
         (replayed), {} stored it then, {} answered batches posted again, {} 'may be stored'",
        work.answered.len(),
        work.retried_replayed,
        work.retried_appended,
        work.reposted,
        work.may_be_stored
    );
    check_stored_once(&setup, &work);
    assert!(
        work.retried_replayed > 0,
        "no kill landed after a batch was durable and before its answer arrived"
    );
}

/// The `durable_seq` of `stream` in `/v1/status`.
fn durable_seq(setup: &Setup, stream: &str) -> u64 {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let r = rt.block_on(setup.client().get("/v1/status")).unwrap();
    let status: Json = serde_json::from_slice(&r.body).unwrap();
    status["streams"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["stream"] == stream)
        .map_or(0, |s| s["durable_seq"].as_u64().unwrap())
}

#[test]
fn derived_streams_take_no_keyed_posts_and_drop_the_key_record() {
    let setup = Setup::new("fsync = \"always\"");
    let port = setup.port;
    std::fs::write(
        &setup.config,
        format!(
            "data_dir = \"data\"\n[http]\nlisten = \"127.0.0.1:{port}\"\n[storage]\nfsync = \"always\"\n\
             [[streams]]\nname = \"telemetry\"\n\
             [[streams]]\nname = \"copy\"\nsource_stream = \"telemetry\"\n\
             filters = [{{ kind = \"where\", expr = \"id >= 0\" }}]\n"
        ),
    )
    .unwrap();
    let mut agent = setup.start();
    let to_copy = post(&setup, "copy", Some("k"), NDJSON, &batch(0..3));
    assert_eq!(to_copy.status, 409, "{}", to_copy.body);
    let ok = post(&setup, "telemetry", Some("k"), NDJSON, &batch(0..3));
    assert_eq!(ok.status, 200, "{}", ok.body);
    let deadline = Instant::now() + Duration::from_secs(30);
    while durable_seq(&setup, "copy") < 3 {
        assert!(
            Instant::now() < deadline,
            "the derived stream never took the batch"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    agent.terminate();
    let out = setup.cli(
        &[
            "inspect",
            "--stream",
            "copy",
            "--config",
            setup.config.to_str().unwrap(),
        ],
        None,
    );
    assert!(out.status.success());
    let lines: Vec<Json> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3);
    for l in &lines {
        assert!(l["fields"].get("_idempotency").is_none(), "{l}");
    }
    let source = setup.inspect();
    assert!(source[2]["fields"].get("_idempotency").is_some());
}
