//! MQTT republish under hostile records, against a real mosquitto: a producer cannot steer
//! where the hub publishes, a hostile key fills only its own topic level, and a record that
//! cannot be published is dead-lettered, counted and skipped while the stream keeps flowing,
//! also across a hub restart.
//!
//! - `record_topics_and_hostile_keys_stay_in_their_place`: a `_topic` on a stream not listed
//!   in `republish.topic_from_record` is ignored; keys with `/`, `+`, `#`, `$SYS`, NUL and a
//!   4 KiB key are escaped or dead-lettered; on a listed stream, `_topic`s with wildcards, a
//!   leading `$`, NUL or 70,000 bytes are dead-lettered. A subscriber on `#` sees only topics
//!   under the template's prefix (and the honoured `sensors/...` ones), each with the
//!   template's four levels.
//! - `an_unpublishable_record_is_dead_lettered_and_the_rest_flows_across_a_restart`: a packet
//!   over the broker's `max_packet_size` and a topic its ACL refuses are dead-lettered and
//!   counted; every other record arrives in order; after a hub restart the sink resumes from
//!   its checkpoint without publishing either of them again.
//! - `mutations_are_caught`: with escaping or the topic check switched off (feature
//!   `fault-injection`), the first scenario's checker reports violations.
//!
//! Needs `mosquitto` (see `mqtt_support`).

mod common;
mod mqtt_support;

use core_hub::Hub;
use core_hub::republish::{self, Mutation, RawRepublish, Reason, RepublishConfig};
use mqtt_support::{Broker, DEADLINE, Msg, subscriber};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};
use sync::block::{VERSION_ROWS, encode_block};
use sync::record::{Record, Value};
use tokio::sync::{mpsc, watch};

const DEVICE: &str = "dev1";
/// Streams get their own epochs, so `(epoch, seq)` from the user properties names a record.
const TELEMETRY: (&str, u64) = ("telemetry", 1);
const BRIDGED: (&str, u64) = ("bridged", 2);
/// How long a mutated run waits for its markers before its checker reports the stall.
const MUTATION_DEADLINE: Duration = Duration::from_secs(8);

fn config(port: u16, edit: impl FnOnce(&mut RawRepublish)) -> RepublishConfig {
    let mut raw = RawRepublish {
        url: Some(format!("mqtt://127.0.0.1:{port}")),
        streams: Some(vec![TELEMETRY.0.into(), BRIDGED.0.into()]),
        topic_template: Some("hub/{stream}/{device}/{key}".into()),
        batch_records: Some(16),
        batch_bytes_max: Some("2KiB".into()),
        poll_interval: Some("10ms".into()),
        ..RawRepublish::default()
    };
    edit(&mut raw);
    raw.parse().unwrap()
}

fn rec(key: &str, topic: Option<&str>, extra: Option<(&str, Value)>) -> Record {
    let mut fields = vec![("v".to_string(), Value::F64(1.5))];
    if let Some(t) = topic {
        fields.push(("_topic".into(), Value::Str(t.into())));
    }
    if let Some((n, v)) = extra {
        fields.push((n.into(), v));
    }
    Record {
        tags: Vec::new(),
        key: key.into(),
        ts: 1_764_374_400_000_000_000,
        fields,
    }
}

/// What should become of one committed record.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Fate {
    Topic(String),
    Dead(Reason),
}

/// Commits each record in its own block of `DEVICE`; returns `(seq, fate)` of those ingest
/// accepted. A record ingest refuses never reaches the sink; that is reported, not hidden.
async fn commit_each(
    hub: &Hub,
    (stream, epoch): (&str, u64),
    first_seq: u64,
    records: Vec<(Record, Fate)>,
) -> Vec<(u64, Fate)> {
    let mut seq = first_seq;
    let mut out = Vec::new();
    for (r, fate) in records {
        let block = encode_block(VERSION_ROWS, epoch, seq, std::slice::from_ref(&r)).unwrap();
        match hub.commit_block(DEVICE, stream, &block).await {
            Ok(_) => {
                out.push((seq, fate));
                seq += 1;
            }
            Err(e) => eprintln!(
                "ingest refused key {:?} on {stream} (it never reaches the sink): {e}",
                &r.key[..r.key.len().min(40)]
            ),
        }
    }
    out
}

/// The hostile telemetry records: `_topic` ignored, keys escaped, the 4 KiB key dead.
fn telemetry_records() -> Vec<(Record, Fate)> {
    let t = |s: &str| Fate::Topic(format!("hub/telemetry/dev1/{s}"));
    let long_key = format!("dev1/{}", "#".repeat(4091));
    vec![
        (rec("dev1/first", None, None), t("dev1%2Ffirst")),
        (rec("dev1/a/b", None, None), t("dev1%2Fa%2Fb")),
        (rec("dev1/+", None, None), t("dev1%2F%2B")),
        (rec("dev1/#", None, None), t("dev1%2F%23")),
        (
            rec("dev1/$SYS/broker/load", None, None),
            t("dev1%2F$SYS%2Fbroker%2Fload"),
        ),
        (rec("dev1/nul\0key", None, None), t("dev1%2Fnul%00key")),
        (rec(&long_key, None, None), Fate::Dead(Reason::TopicTooLong)),
        (
            rec("dev1/steer", Some("plant/line1/valve7/cmd/open"), None),
            t("dev1%2Fsteer"),
        ),
        (rec("dev1/last", None, None), t("dev1%2Flast")),
    ]
}

/// The bridged stream honours `_topic`, but only one that passes the topic check.
fn bridged_records() -> Vec<(Record, Fate)> {
    let long = "a".repeat(70_000);
    let dead = Fate::Dead(Reason::TopicInvalid);
    vec![
        (
            rec("dev1/x", Some("sensors/dev1/temp"), None),
            Fate::Topic("sensors/dev1/temp".into()),
        ),
        (
            rec("dev1/x", Some(&long), None),
            Fate::Dead(Reason::TopicTooLong),
        ),
        (rec("dev1/x", Some("sensors/+/temp"), None), dead.clone()),
        (
            rec("dev1/x", Some("$SYS/broker/clients"), None),
            dead.clone(),
        ),
        (rec("dev1/x", Some("sensors/dev1/nul\0"), None), dead),
        (
            rec("dev1/x", None, None),
            Fate::Topic("hub/bridged/dev1/dev1%2Fx".into()),
        ),
        (
            rec("dev1/x", Some("sensors/dev1/last"), None),
            Fate::Topic("sensors/dev1/last".into()),
        ),
    ]
}

/// Everything the subscriber received, by `(epoch, seq)`, in arrival order.
#[derive(Debug, Default)]
struct Seen {
    topics: BTreeMap<(u64, u64), Vec<String>>,
    order: Vec<(u64, u64)>,
    all: Vec<Msg>,
}

impl Seen {
    fn add(&mut self, m: Msg) {
        let id = (m.epoch, m.seq);
        if !self.topics.contains_key(&id) {
            self.order.push(id);
        }
        self.topics.entry(id).or_default().push(m.topic.clone());
        self.all.push(m);
    }
}

/// Receives until every id in `want` was seen or `deadline` passes; says whether it was.
async fn collect(
    rx: &mut mpsc::UnboundedReceiver<Msg>,
    seen: &mut Seen,
    want: &BTreeSet<(u64, u64)>,
    deadline: Duration,
) -> bool {
    let start = Instant::now();
    while !want.iter().all(|id| seen.topics.contains_key(id)) {
        let left = deadline.saturating_sub(start.elapsed());
        if left.is_zero() {
            return false;
        }
        if let Ok(Some(m)) = tokio::time::timeout(left, rx.recv()).await {
            seen.add(m);
        }
    }
    true
}

/// Waits until `stream`'s checkpoint reaches `end` or `deadline` passes.
async fn checkpoint_reaches(hub: &Hub, stream: &str, end: u64, deadline: Duration) -> bool {
    let start = Instant::now();
    while republish::checkpoint(hub, stream).unwrap() < end {
        if start.elapsed() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    true
}

/// The sink's tasks and their stop switch.
struct Sink {
    stop: watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Sink {
    fn start(hub: &Arc<Hub>, cfg: RepublishConfig) -> Sink {
        let (stop, rx) = watch::channel(false);
        let tasks = republish::start(hub.clone(), cfg, rx);
        Sink { stop, tasks }
    }

    async fn stop(self) {
        self.stop.send(true).unwrap();
        for t in self.tasks {
            t.await.unwrap();
        }
    }
}

/// Runs the hostile scenario with `mutation`; returns every violation its checker found.
async fn hostile_run(mutation: Mutation, deadline: Duration) -> Vec<String> {
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let hub = common::open(dir.path());
    let (mut rx, _sub) = subscriber(broker.port, "abuse-subscriber").await;
    let telemetry = commit_each(&hub, TELEMETRY, 1, telemetry_records()).await;
    let bridged = commit_each(&hub, BRIDGED, 1, bridged_records()).await;
    assert!(
        telemetry.len() >= 8 && bridged.len() == 7,
        "ingest took the hostile keys and topics"
    );
    let mut cfg = config(broker.port, |c| {
        c.topic_from_record = Some(vec![BRIDGED.0.into()])
    });
    cfg.mutation = mutation;
    let sink = Sink::start(&hub, cfg);

    let expected: Vec<((u64, u64), Fate)> = telemetry
        .iter()
        .map(|(s, f)| ((TELEMETRY.1, *s), f.clone()))
        .chain(bridged.iter().map(|(s, f)| ((BRIDGED.1, *s), f.clone())))
        .collect();
    let markers: BTreeSet<_> = [
        (TELEMETRY.1, telemetry.last().unwrap().0),
        (BRIDGED.1, bridged.last().unwrap().0),
    ]
    .into();
    let mut seen = Seen::default();
    let mut violations = Vec::new();
    if !collect(&mut rx, &mut seen, &markers, deadline).await {
        violations.push("the last records were not republished: the stream stalled".into());
    }
    for (stream, n) in [(TELEMETRY.0, telemetry.len()), (BRIDGED.0, bridged.len())] {
        if !checkpoint_reaches(&hub, stream, n as u64, Duration::from_secs(5)).await {
            violations.push(format!("{stream}'s checkpoint did not reach its end"));
        }
    }
    sink.stop().await;
    violations.extend(check_topics(&seen, &expected));
    violations.extend(check_dead_letters(&hub, &expected));
    drop(broker);
    hub.shutdown();
    violations
}

/// Every message is under a permitted prefix with the template's levels, every record has
/// its expected fate, and each stream's records arrived in order.
fn check_topics(seen: &Seen, expected: &[((u64, u64), Fate)]) -> Vec<String> {
    let mut v = Vec::new();
    for m in &seen.all {
        let under_hub = m.topic.starts_with("hub/") && m.topic.split('/').count() == 4;
        let bridged = m.topic.starts_with("sensors/dev1/") && m.topic.split('/').count() == 3;
        if !under_hub && !bridged {
            v.push(format!("a message left its place: {}", short(&m.topic)));
        }
    }
    for (id, fate) in expected {
        let got = seen.topics.get(id);
        match (fate, got) {
            (Fate::Topic(t), Some(topics)) if topics.iter().all(|g| g == t) => {}
            (Fate::Dead(_), None) => {}
            (fate, got) => {
                let got: Option<Vec<String>> = got.map(|ts| ts.iter().map(|t| short(t)).collect());
                v.push(format!("{id:?}: expected {fate:?}, got {got:?}"))
            }
        }
    }
    for epoch in [TELEMETRY.1, BRIDGED.1] {
        let seqs: Vec<u64> = seen
            .order
            .iter()
            .filter(|(e, _)| *e == epoch)
            .map(|(_, s)| *s)
            .collect();
        if !seqs.is_sorted() {
            v.push(format!("epoch {epoch} arrived out of order: {seqs:?}"));
        }
    }
    v
}

/// A topic cut to 80 characters for a message.
fn short(topic: &str) -> String {
    match topic.char_indices().nth(80) {
        Some((i, _)) => format!("{}... ({} bytes)", &topic[..i], topic.len()),
        None => topic.to_string(),
    }
}

/// The dead letters recorded, and counted on `/metrics`, are exactly the expected ones.
fn check_dead_letters(hub: &Hub, expected: &[((u64, u64), Fate)]) -> Vec<String> {
    let epoch_of = |s: &str| {
        if s == TELEMETRY.0 {
            TELEMETRY.1
        } else {
            BRIDGED.1
        }
    };
    let want: BTreeSet<(u64, u64, Reason)> = expected
        .iter()
        .filter_map(|(id, f)| match f {
            Fate::Dead(r) => Some((id.0, id.1, *r)),
            Fate::Topic(_) => None,
        })
        .collect();
    let got: BTreeSet<(u64, u64, Reason)> = republish::dead_letters(hub, None, 1000)
        .into_iter()
        .map(|d| (epoch_of(&d.stream), d.seq, d.reason))
        .collect();
    let mut v = Vec::new();
    if got != want {
        v.push(format!("dead letters {got:?}, expected {want:?}"));
    }
    let metrics = core_hub::metrics::render(hub);
    let mut counts: BTreeMap<(&str, &str), u64> = BTreeMap::new();
    for (e, _, r) in &want {
        let s = if *e == TELEMETRY.1 {
            TELEMETRY.0
        } else {
            BRIDGED.0
        };
        *counts.entry((s, r.as_str())).or_default() += 1;
    }
    for ((s, r), n) in counts {
        let line = format!(
            "tributary_hub_republish_dead_letter_total{{stream=\"{s}\",reason=\"{r}\"}} {n}"
        );
        if !metrics.contains(&line) {
            v.push(format!("/metrics lacks `{line}`"));
        }
    }
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn record_topics_and_hostile_keys_stay_in_their_place() {
    let violations = hostile_run(Mutation::None, DEADLINE).await;
    assert!(violations.is_empty(), "{violations:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutations_are_caught() {
    for m in [Mutation::RawPlaceholders, Mutation::SkipTopicCheck] {
        let violations = hostile_run(m, MUTATION_DEADLINE).await;
        eprintln!("{m:?}: {violations:#?}");
        assert!(!violations.is_empty(), "{m:?} went unnoticed");
    }
}

/// Telemetry records `first..=last` of `DEVICE`: `big` carries a 20 KiB field, `denied` has
/// the key the broker's ACL refuses.
fn flowing_records(first: u64, last: u64, big: u64, denied: u64) -> Vec<Record> {
    (first..=last)
        .map(|seq| match seq {
            s if s == big => rec(
                &format!("dev1/r{s}"),
                None,
                Some(("blob", Value::Bytes(vec![7; 20_000]))),
            ),
            s if s == denied => rec("dev1/denied", None, None),
            s => rec(&format!("dev1/r{s}"), None, None),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unpublishable_record_is_dead_lettered_and_the_rest_flows_across_a_restart() {
    let acl = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        acl.path(),
        "topic read #\ntopic write hub/#\ntopic deny hub/telemetry/dev1/dev1%2Fdenied\n",
    )
    .unwrap();
    let broker = Broker::start_with(&[
        "max_packet_size 8192".into(),
        format!("acl_file {}", acl.path().display()),
    ]);
    let dir = tempfile::tempdir().unwrap();
    let hub = common::open(dir.path());
    let (mut rx, _sub) = subscriber(broker.port, "flow-subscriber").await;
    let (big, denied) = (15, 25);
    let block = encode_block(VERSION_ROWS, 1, 1, &flowing_records(1, 40, big, denied)).unwrap();
    hub.commit_block(DEVICE, TELEMETRY.0, &block).await.unwrap();
    let cfg = config(broker.port, |c| c.streams = Some(vec![TELEMETRY.0.into()]));
    let sink = Sink::start(&hub, cfg.clone());

    let want: BTreeSet<_> = (1..=40)
        .filter(|s| ![big, denied].contains(s))
        .map(|s| (1, s))
        .collect();
    let mut seen = Seen::default();
    assert!(
        collect(&mut rx, &mut seen, &want, DEADLINE).await,
        "records stalled"
    );
    assert!(checkpoint_reaches(&hub, TELEMETRY.0, 40, DEADLINE).await);
    sink.stop().await;
    assert_eq!(
        seen.order.iter().map(|(_, s)| *s).collect::<Vec<_>>(),
        want.iter().map(|(_, s)| *s).collect::<Vec<_>>(),
        "every other record, in order"
    );
    let dead: Vec<_> = republish::dead_letters(&hub, Some(TELEMETRY.0), 10)
        .into_iter()
        .map(|d| (d.seq, d.reason, d.offset))
        .collect();
    assert_eq!(
        dead,
        [
            (denied, Reason::BrokerRefused, denied - 1),
            (big, Reason::PacketTooLarge, big - 1)
        ],
        "newest first, each at its offset"
    );
    let metrics = core_hub::metrics::render(&hub);
    for reason in ["packet_too_large", "broker_refused"] {
        let line = format!(
            "tributary_hub_republish_dead_letter_total{{stream=\"telemetry\",reason=\"{reason}\"}} 1"
        );
        assert!(metrics.contains(&line), "{line} in\n{metrics}");
    }
    assert!(metrics.contains("tributary_hub_republish_checkpoint_offset{stream=\"telemetry\"} 40"));

    // A restarted hub resumes from the checkpoint: only the new records are published, and
    // neither dead-lettered record is tried again.
    hub.shutdown();
    drop(hub);
    let hub = common::open(dir.path());
    let block = encode_block(VERSION_ROWS, 1, 41, &flowing_records(41, 50, 0, 0)).unwrap();
    hub.commit_block(DEVICE, TELEMETRY.0, &block).await.unwrap();
    let before = seen.all.len();
    let sink = Sink::start(&hub, cfg);
    let more: BTreeSet<_> = (41..=50).map(|s| (1, s)).collect();
    assert!(
        collect(&mut rx, &mut seen, &more, DEADLINE).await,
        "stalled after the restart"
    );
    assert!(checkpoint_reaches(&hub, TELEMETRY.0, 50, DEADLINE).await);
    sink.stop().await;
    let after: Vec<u64> = seen.all[before..].iter().map(|m| m.seq).collect();
    assert_eq!(after, (41..=50).collect::<Vec<_>>(), "only the new records");
    assert_eq!(republish::dead_letters(&hub, None, 10).len(), 2);
    assert_dead_letters_api(&hub, big, denied).await;
    assert_eq!(
        republish::dead_letter_counts(&hub)
            .iter()
            .map(|(_, _, n)| n)
            .sum::<u64>(),
        2
    );
    hub.shutdown();
}

/// `GET /v1/republish/dead-letters` shows the entries and counts.
async fn assert_dead_letters_api(hub: &Arc<Hub>, big: u64, denied: u64) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, stop) = tokio::sync::oneshot::channel::<()>();
    let router = core_hub::api::router(hub.clone(), Vec::new());
    let server = tokio::spawn(core_hub::api::serve(listener, router, async {
        let _ = stop.await;
    }));
    let target = core_hub::client::ApiTarget::from_listen(addr, None);
    let resp = core_hub::client::get(&target, "/v1/republish/dead-letters?stream=telemetry")
        .await
        .unwrap();
    let body: serde_json::Value = serde_json::from_slice(&resp.body).unwrap();
    let letters = body["dead_letters"].as_array().unwrap();
    assert_eq!(letters.len(), 2, "{body}");
    assert_eq!(letters[0]["reason"], "broker_refused");
    assert_eq!(letters[0]["seq"], denied);
    assert_eq!(letters[1]["reason"], "packet_too_large");
    assert_eq!(letters[1]["offset"], big - 1);
    assert_eq!(letters[1]["key"], format!("dev1/r{big}"));
    assert_eq!(body["counts"].as_array().unwrap().len(), 2, "{body}");
    let _ = tx.send(());
    server.await.unwrap().unwrap();
}

/// Bridged records `first..=last` with honoured `_topic`s; `bad` carries a NUL in its topic.
fn bridged_flow(first: u64, last: u64, bad: u64) -> Vec<Record> {
    (first..=last)
        .map(|seq| {
            let topic = if seq == bad {
                "sensors/dev1/nul\0".to_string()
            } else {
                format!("sensors/dev1/r{seq}")
            };
            rec("dev1/x", Some(&topic), None)
        })
        .collect()
}

/// The last line of defence: a record that passes the sink's checks (here because the topic
/// check is switched off) but with which the broker closes the connection every time is
/// dead-lettered as `broker_disconnected` after `SUSPECT_FAILURES` tries on its own, and the
/// records after it flow in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_the_broker_keeps_dropping_the_connection_for_is_dead_lettered() {
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let hub = common::open(dir.path());
    let (mut rx, _sub) = subscriber(broker.port, "drop-subscriber").await;
    let bad = 6;
    let block = encode_block(VERSION_ROWS, BRIDGED.1, 1, &bridged_flow(1, 10, bad)).unwrap();
    hub.commit_block(DEVICE, BRIDGED.0, &block).await.unwrap();
    let mut cfg = config(broker.port, |c| {
        c.streams = Some(vec![BRIDGED.0.into()]);
        c.topic_from_record = Some(vec![BRIDGED.0.into()]);
    });
    cfg.mutation = Mutation::SkipTopicCheck;
    let sink = Sink::start(&hub, cfg);
    let want: BTreeSet<_> = (1..=10)
        .filter(|s| *s != bad)
        .map(|s| (BRIDGED.1, s))
        .collect();
    let mut seen = Seen::default();
    assert!(
        collect(&mut rx, &mut seen, &want, DEADLINE).await,
        "stalled"
    );
    assert!(checkpoint_reaches(&hub, BRIDGED.0, 10, DEADLINE).await);
    sink.stop().await;
    let order: Vec<u64> = seen.order.iter().map(|(_, s)| *s).collect();
    assert_eq!(order, want.iter().map(|(_, s)| *s).collect::<Vec<_>>());
    let dead: Vec<_> = republish::dead_letters(&hub, None, 10)
        .into_iter()
        .map(|d| (d.seq, d.reason))
        .collect();
    assert_eq!(dead, [(bad, Reason::BrokerDisconnected)]);
    hub.shutdown();
}
