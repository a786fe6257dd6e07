//! The ledger checker: what producers were acknowledged, compared with what the hub holds.
//!
//! Producers record every acknowledged batch (the agent's ingest answer
//! `{"stream","epoch","first_seq","last_seq","count"}` plus the records they sent). Batches whose
//! answer was lost, e.g. because a kill landed mid-request, go into a `maybe` set: they may or may
//! not have been stored, and either is correct, but at most once.
//!
//! [`Ledger::check`] then verifies the hub's records, in the hub's order:
//! - every acknowledged record is present, with identical content;
//! - nothing appears twice: not the same `(device, stream, epoch, seq)`, and not the same content
//!   more often than it was sent;
//! - per `(device, stream, key)`, `(epoch, seq)` increases in the observed order (seqs are
//!   assigned per stream, so order is only meaningful within a stream);
//! - nothing unacknowledged appears unless it is in the `maybe` set.
//!
//! Content is compared exactly (`serde_json::Value` equality: `1` and `1.0` differ, as the record
//! model's i64 and f64 differ). The unit tests at the bottom are mutation tests of the checker
//! itself: each one breaks a correct history in one way and asserts the checker notices.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;

use anyhow::{Context, Result, bail, ensure};
use serde::Deserialize;
use serde_json::Value;

/// Problems kept in a [`Report`] for its summary; the counts always cover all of them.
pub const PROBLEMS_KEPT: usize = 20;

/// One record as a producer sent it.
#[derive(Debug, Clone, PartialEq)]
pub struct SentRecord {
    pub key: String,
    pub ts: i64,
    /// The `fields` object, exactly as sent.
    pub fields: Value,
}

impl SentRecord {
    pub fn new(key: impl Into<String>, ts: i64, fields: Value) -> Self {
        SentRecord {
            key: key.into(),
            ts,
            fields,
        }
    }

    /// The NDJSON ingest form: `{"key":..,"ts":..,"fields":{..}}`.
    pub fn to_json(&self) -> Value {
        serde_json::json!({ "key": self.key, "ts": self.ts, "fields": self.fields })
    }

    /// A batch as an NDJSON request body.
    pub fn ndjson(records: &[SentRecord]) -> Vec<u8> {
        let mut body = Vec::new();
        for record in records {
            body.extend_from_slice(record.to_json().to_string().as_bytes());
            body.push(b'\n');
        }
        body
    }
}

/// The agent's answer to an ingest request.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct IngestAck {
    pub stream: String,
    /// 16 hex digits in the agent's JSON, as every epoch (`sync::epoch`).
    #[serde(with = "sync::epoch::serde_hex")]
    pub epoch: u64,
    pub first_seq: u64,
    pub last_seq: u64,
    pub count: u64,
}

/// One record as read back from the hub.
#[derive(Debug, Clone, PartialEq)]
pub struct ObservedRecord {
    pub device: String,
    pub stream: String,
    pub epoch: u64,
    pub seq: u64,
    pub key: String,
    pub ts: i64,
    pub fields: Value,
}

impl ObservedRecord {
    /// Parses one line of the hub's NDJSON read output (`device`, `epoch`, `seq`, `key`, `ts`,
    /// `fields`); the stream is the one that was read.
    pub fn from_json(stream: &str, line: &Value) -> Result<Self> {
        let text = |name: &str| line.get(name).and_then(Value::as_str).map(str::to_string);
        let int = |name: &str| line.get(name).and_then(Value::as_u64);
        Ok(ObservedRecord {
            device: text("device").context("missing string `device`")?,
            stream: stream.to_string(),
            // The hub writes epochs as 16 hex digits (`sync::epoch`); older output had integers.
            epoch: line
                .get("epoch")
                .and_then(|v| {
                    v.as_u64()
                        .or_else(|| v.as_str().and_then(sync::epoch::parse))
                })
                .context("missing epoch (16 hex digits)")?,
            seq: int("seq").context("missing integer `seq`")?,
            key: text("key").context("missing string `key`")?,
            ts: line
                .get("ts")
                .and_then(Value::as_i64)
                .context("missing integer `ts`")?,
            fields: line.get("fields").cloned().context("missing `fields`")?,
        })
    }

    /// Parses a whole NDJSON read of `stream`.
    pub fn parse_ndjson(stream: &str, text: &str) -> Result<Vec<Self>> {
        let mut records = Vec::new();
        for (i, line) in text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
        {
            let value: Value =
                serde_json::from_str(line).with_context(|| format!("line {}: not JSON", i + 1))?;
            records.push(
                Self::from_json(stream, &value)
                    .with_context(|| format!("line {}: {line}", i + 1))?,
            );
        }
        Ok(records)
    }

    fn id(&self) -> RecordId {
        RecordId {
            device: self.device.clone(),
            stream: self.stream.clone(),
            epoch: self.epoch,
            seq: self.seq,
        }
    }

    fn content(&self) -> Content {
        Content::new(&self.key, self.ts, &self.fields)
    }
}

/// Where a record sits: `(device, stream, epoch, seq)`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RecordId {
    pub device: String,
    pub stream: String,
    pub epoch: u64,
    pub seq: u64,
}

impl fmt::Display for RecordId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/{} epoch {} seq {}",
            self.device, self.stream, self.epoch, self.seq
        )
    }
}

/// A record's content in canonical text (object keys sorted), so it can be hashed and compared.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Content {
    key: String,
    canonical: String,
}

impl Content {
    fn new(key: &str, ts: i64, fields: &Value) -> Self {
        let mut canonical = format!("{}|{ts}|", serde_json::to_string(key).unwrap_or_default());
        write_canonical(fields, &mut canonical);
        Content {
            key: key.to_string(),
            canonical,
        }
    }
}

fn write_canonical(value: &Value, out: &mut String) {
    match value {
        Value::Object(map) => {
            let sorted: BTreeMap<&String, &Value> = map.iter().collect();
            out.push('{');
            for (i, (name, item)) in sorted.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&serde_json::to_string(name).unwrap_or_default());
                out.push(':');
                write_canonical(item, out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(item, out);
            }
            out.push(']');
        }
        scalar => out.push_str(&scalar.to_string()),
    }
}

/// What producers were told, per `(device, stream)`.
#[derive(Debug, Default)]
pub struct Ledger {
    acked: BTreeMap<RecordId, Content>,
    /// Acked ids by `(device, stream, content)`, to name the original of a duplicate.
    by_content: HashMap<(String, String, Content), Vec<RecordId>>,
    /// Unacknowledged batches: how many times each content may still land.
    maybe: HashMap<(String, String, Content), usize>,
}

impl Ledger {
    pub fn new() -> Self {
        Ledger::default()
    }

    /// Records an acknowledged batch: `sent[i]` got seq `first_seq + i`.
    ///
    /// Recording the same answer twice (a retried request with an idempotency key) is harmless;
    /// a different content at an already acknowledged seq is an error. Content that was in the
    /// `maybe` set is taken out of it: once acknowledged, a batch must land exactly once.
    pub fn record_ack(&mut self, device: &str, ack: &IngestAck, sent: &[SentRecord]) -> Result<()> {
        let span = ack.last_seq.checked_sub(ack.first_seq).map(|d| d + 1);
        ensure!(
            span == Some(ack.count) && ack.count == sent.len() as u64,
            "ack {ack:?} does not cover the {} records sent",
            sent.len()
        );
        for (seq, record) in (ack.first_seq..).zip(sent) {
            let id = RecordId {
                device: device.into(),
                stream: ack.stream.clone(),
                epoch: ack.epoch,
                seq,
            };
            let content = Content::new(&record.key, record.ts, &record.fields);
            if let Some(existing) = self.acked.get(&id) {
                if *existing != content {
                    bail!("{id} acknowledged twice with different content");
                }
                continue;
            }
            let slot = (device.to_string(), ack.stream.clone(), content.clone());
            if let Some(count) = self.maybe.get_mut(&slot) {
                *count -= 1;
                if *count == 0 {
                    self.maybe.remove(&slot);
                }
            }
            self.by_content.entry(slot).or_default().push(id.clone());
            self.acked.insert(id, content);
        }
        Ok(())
    }

    /// Parses the agent's JSON answer and records it; returns the parsed answer.
    pub fn record_ack_json(
        &mut self,
        device: &str,
        answer: &[u8],
        sent: &[SentRecord],
    ) -> Result<IngestAck> {
        let ack: IngestAck = serde_json::from_slice(answer).with_context(|| {
            format!(
                "ingest answer is not an ack: {}",
                String::from_utf8_lossy(answer)
            )
        })?;
        self.record_ack(device, &ack, sent)?;
        Ok(ack)
    }

    /// Records a batch whose answer was lost: it may land once, or not at all.
    pub fn record_maybe(&mut self, device: &str, stream: &str, sent: &[SentRecord]) {
        for record in sent {
            let content = Content::new(&record.key, record.ts, &record.fields);
            *self
                .maybe
                .entry((device.into(), stream.into(), content))
                .or_default() += 1;
        }
    }

    /// Acknowledged records recorded so far.
    pub fn acked_len(&self) -> usize {
        self.acked.len()
    }

    /// Records in the `maybe` set.
    pub fn maybe_len(&self) -> usize {
        self.maybe.values().sum()
    }

    /// Checks the hub's records, in the hub's order, against every stream of the ledger.
    pub fn check(&self, observed: impl IntoIterator<Item = ObservedRecord>) -> Report {
        Checker::new(self, |_| true).run(observed)
    }

    /// Like [`Ledger::check`] for a read of some streams only: acknowledged records of other
    /// streams are not expected.
    pub fn check_streams(
        &self,
        streams: &[&str],
        observed: impl IntoIterator<Item = ObservedRecord>,
    ) -> Report {
        Checker::new(self, |stream| streams.contains(&stream)).run(observed)
    }
}

/// What became of one posted batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PostOutcome {
    /// Stored and acknowledged; recorded in the ledger.
    Acked(IngestAck),
    /// Refused with a status that means nothing was stored (4xx, or 503 for backpressure).
    Rejected { status: u16, body: String },
    /// The answer was lost (connection error, timeout, other 5xx): recorded as `maybe`.
    Unknown { reason: String },
}

/// Posts NDJSON batches to an agent's ingest API and records every outcome in a [`Ledger`].
#[derive(Debug, Clone)]
pub struct Producer {
    pub device: String,
    /// The agent's HTTP address.
    pub addr: std::net::SocketAddr,
    /// Extra headers for every request, e.g. an authorization token.
    pub headers: Vec<(String, String)>,
    pub timeout: std::time::Duration,
}

impl Producer {
    pub fn new(device: impl Into<String>, addr: std::net::SocketAddr) -> Self {
        Producer {
            device: device.into(),
            addr,
            headers: Vec::new(),
            timeout: crate::http::TIMEOUT,
        }
    }

    /// `POST /v1/streams/{stream}/records` with `batch` as NDJSON (and an `Idempotency-Key` when
    /// given), then records the outcome. An `Err` means the harness or the agent broke a contract
    /// (e.g. an ack that does not cover the batch), not that the request failed.
    pub fn post(
        &self,
        ledger: &mut Ledger,
        stream: &str,
        batch: &[SentRecord],
        idempotency_key: Option<&str>,
    ) -> Result<PostOutcome> {
        let path = format!("/v1/streams/{stream}/records");
        let mut headers: Vec<(&str, &str)> = vec![("Content-Type", "application/x-ndjson")];
        headers.extend(self.headers.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        if let Some(key) = idempotency_key {
            headers.push(("Idempotency-Key", key));
        }
        let body = SentRecord::ndjson(batch);
        let answer = crate::http::request_timeout(
            self.addr,
            "POST",
            &path,
            &headers,
            Some(&body),
            self.timeout,
        );
        let response = match answer {
            Ok(response) => response,
            Err(error) => {
                ledger.record_maybe(&self.device, stream, batch);
                return Ok(PostOutcome::Unknown {
                    reason: format!("{error:#}"),
                });
            }
        };
        match response.status {
            200..=299 => Ok(PostOutcome::Acked(ledger.record_ack_json(
                &self.device,
                &response.body,
                batch,
            )?)),
            400..=499 | 503 => Ok(PostOutcome::Rejected {
                status: response.status,
                body: response.text(),
            }),
            status => {
                ledger.record_maybe(&self.device, stream, batch);
                Ok(PostOutcome::Unknown {
                    reason: format!("status {status}: {}", response.text()),
                })
            }
        }
    }
}

/// One thing the checker found wrong.
#[derive(Debug, Clone, PartialEq)]
pub enum Problem {
    /// An acknowledged record the hub does not hold.
    Missing { id: RecordId },
    /// The same `(device, stream, epoch, seq)` observed again.
    DuplicateSeq { id: RecordId },
    /// Content observed at `id` that already landed at `same_as` and may not land twice.
    DuplicateContent { id: RecordId, same_as: RecordId },
    /// An acknowledged seq holding other content than was sent.
    ContentMismatch {
        id: RecordId,
        expected: String,
        observed: String,
    },
    /// A key's records observed out of `(epoch, seq)` order.
    OrderInversion {
        id: RecordId,
        key: String,
        previous: (u64, u64),
    },
    /// A record that was never acknowledged and is not in the `maybe` set.
    Unexpected { id: RecordId },
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Problem::Missing { id } => write!(f, "missing: {id}"),
            Problem::DuplicateSeq { id } => write!(f, "duplicate seq: {id}"),
            Problem::DuplicateContent { id, same_as } => {
                write!(f, "duplicate content: {id} repeats {same_as}")
            }
            Problem::ContentMismatch {
                id,
                expected,
                observed,
            } => {
                write!(
                    f,
                    "content mismatch at {id}: expected {expected}, observed {observed}"
                )
            }
            Problem::OrderInversion { id, key, previous } => write!(
                f,
                "order inversion for key {key:?}: {id} after epoch {} seq {}",
                previous.0, previous.1
            ),
            Problem::Unexpected { id } => write!(f, "unexpected (never acknowledged): {id}"),
        }
    }
}

/// The result of a check: full counts, and the first [`PROBLEMS_KEPT`] problems.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Report {
    /// Acknowledged records in scope.
    pub acked: usize,
    /// Records observed at the hub.
    pub observed: usize,
    /// Acknowledged records found with identical content.
    pub matched: usize,
    /// Unacknowledged (`maybe`) records that landed, once each.
    pub maybe_landed: usize,
    pub missing: usize,
    /// Duplicates by seq and by content together.
    pub duplicates: usize,
    pub mismatched: usize,
    pub order_inversions: usize,
    pub unexpected: usize,
    pub problems: Vec<Problem>,
}

impl Report {
    pub fn is_ok(&self) -> bool {
        self.missing + self.duplicates + self.mismatched + self.order_inversions + self.unexpected
            == 0
    }

    /// One line of counts, then the first problems, one per line.
    pub fn summary(&self) -> String {
        let mut text = format!(
            "ledger check {}: acked={} observed={} matched={} maybe_landed={} | missing={} duplicates={} \
             mismatched={} order_inversions={} unexpected={}",
            if self.is_ok() { "passed" } else { "FAILED" },
            self.acked,
            self.observed,
            self.matched,
            self.maybe_landed,
            self.missing,
            self.duplicates,
            self.mismatched,
            self.order_inversions,
            self.unexpected,
        );
        for problem in &self.problems {
            text.push_str(&format!("\n  {problem}"));
        }
        let total = self.missing
            + self.duplicates
            + self.mismatched
            + self.order_inversions
            + self.unexpected;
        if total > self.problems.len() {
            text.push_str(&format!("\n  ... and {} more", total - self.problems.len()));
        }
        text
    }

    /// Panics with the summary unless the check passed.
    #[track_caller]
    pub fn assert_ok(&self) {
        assert!(self.is_ok(), "{}", self.summary());
    }

    fn add(&mut self, problem: Problem) {
        let counter = match &problem {
            Problem::Missing { .. } => &mut self.missing,
            Problem::DuplicateSeq { .. } | Problem::DuplicateContent { .. } => &mut self.duplicates,
            Problem::ContentMismatch { .. } => &mut self.mismatched,
            Problem::OrderInversion { .. } => &mut self.order_inversions,
            Problem::Unexpected { .. } => &mut self.unexpected,
        };
        *counter += 1;
        if self.problems.len() < PROBLEMS_KEPT {
            self.problems.push(problem);
        }
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.summary())
    }
}

/// One pass over the observed records.
struct Checker<'a, F> {
    ledger: &'a Ledger,
    in_scope: F,
    report: Report,
    seen: HashSet<RecordId>,
    maybe_left: HashMap<(String, String, Content), usize>,
    /// Where each content first landed outside its acknowledged seq.
    landed_elsewhere: HashMap<(String, String, Content), RecordId>,
    last_per_key: HashMap<(String, String, String), (u64, u64)>,
}

impl<'a, F: Fn(&str) -> bool> Checker<'a, F> {
    fn new(ledger: &'a Ledger, in_scope: F) -> Self {
        Checker {
            ledger,
            in_scope,
            report: Report::default(),
            seen: HashSet::new(),
            maybe_left: ledger.maybe.clone(),
            landed_elsewhere: HashMap::new(),
            last_per_key: HashMap::new(),
        }
    }

    fn run(mut self, observed: impl IntoIterator<Item = ObservedRecord>) -> Report {
        for record in observed {
            self.report.observed += 1;
            self.observe(&record);
        }
        let ledger = self.ledger;
        self.report.acked = ledger
            .acked
            .keys()
            .filter(|id| (self.in_scope)(&id.stream))
            .count();
        for id in ledger.acked.keys() {
            if (self.in_scope)(&id.stream) && !self.seen.contains(id) {
                self.report.add(Problem::Missing { id: id.clone() });
            }
        }
        self.report
    }

    fn observe(&mut self, record: &ObservedRecord) {
        let id = record.id();
        if !self.seen.insert(id.clone()) {
            self.report.add(Problem::DuplicateSeq { id });
            return;
        }
        self.check_order(record, &id);
        let content = record.content();
        match self.ledger.acked.get(&id) {
            Some(expected) if *expected == content => self.report.matched += 1,
            Some(expected) => self.report.add(Problem::ContentMismatch {
                id,
                expected: expected.canonical.clone(),
                observed: content.canonical,
            }),
            None => self.observe_unacked(id, content),
        }
    }

    fn observe_unacked(&mut self, id: RecordId, content: Content) {
        let slot = (id.device.clone(), id.stream.clone(), content);
        if let Some(left) = self.maybe_left.get_mut(&slot).filter(|left| **left > 0) {
            *left -= 1;
            self.report.maybe_landed += 1;
            self.landed_elsewhere.entry(slot).or_insert(id);
            return;
        }
        let original = self
            .ledger
            .by_content
            .get(&slot)
            .and_then(|ids| ids.first())
            .cloned();
        match original.or_else(|| self.landed_elsewhere.get(&slot).cloned()) {
            Some(same_as) => self.report.add(Problem::DuplicateContent { id, same_as }),
            None => self.report.add(Problem::Unexpected { id }),
        }
    }

    fn check_order(&mut self, record: &ObservedRecord, id: &RecordId) {
        let slot = (
            record.device.clone(),
            record.stream.clone(),
            record.key.clone(),
        );
        let position = (record.epoch, record.seq);
        if let Some(previous) = self
            .last_per_key
            .insert(slot, position)
            .filter(|p| *p >= position)
        {
            let key = record.key.clone();
            self.report.add(Problem::OrderInversion {
                id: id.clone(),
                key,
                previous,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Two devices, one stream each, two keys interleaved, five batches of four records.
    fn history() -> (Ledger, Vec<ObservedRecord>) {
        let mut ledger = Ledger::new();
        let mut observed = Vec::new();
        for device in ["dev-a", "dev-b"] {
            for batch in 0..5u64 {
                let sent: Vec<SentRecord> = (0..4u64)
                    .map(|i| {
                        let n = batch * 4 + i;
                        SentRecord::new(
                            format!("key-{}", n % 2),
                            n as i64 * 1000,
                            json!({"v": n, "dev": device}),
                        )
                    })
                    .collect();
                let first_seq = batch * 4 + 1;
                let ack = IngestAck {
                    stream: "s".into(),
                    epoch: 1,
                    first_seq,
                    last_seq: first_seq + 3,
                    count: 4,
                };
                ledger.record_ack(device, &ack, &sent).unwrap();
                for (seq, record) in (first_seq..).zip(&sent) {
                    observed.push(observe(device, seq, record));
                }
            }
        }
        (ledger, observed)
    }

    fn observe(device: &str, seq: u64, record: &SentRecord) -> ObservedRecord {
        ObservedRecord {
            device: device.into(),
            stream: "s".into(),
            epoch: 1,
            seq,
            key: record.key.clone(),
            ts: record.ts,
            fields: record.fields.clone(),
        }
    }

    #[test]
    fn a_correct_history_passes() {
        let (ledger, observed) = history();
        let report = ledger.check(observed);
        report.assert_ok();
        assert_eq!(
            (report.acked, report.matched, report.observed),
            (40, 40, 40)
        );
    }

    #[test]
    fn fails_on_a_missing_record() {
        let (ledger, mut observed) = history();
        observed.remove(7);
        let report = ledger.check(observed);
        assert!(!report.is_ok());
        assert_eq!(report.missing, 1, "{report}");
        assert!(
            matches!(&report.problems[0], Problem::Missing { id } if id.seq == 8 && id.device == "dev-a")
        );
        assert!(
            report.summary().contains("missing: dev-a/s epoch 1 seq 8"),
            "{report}"
        );
    }

    #[test]
    fn fails_on_a_duplicate_seq() {
        let (ledger, mut observed) = history();
        observed.push(observed[3].clone());
        let report = ledger.check(observed);
        assert_eq!(report.duplicates, 1, "{report}");
        assert!(!report.is_ok());
    }

    #[test]
    fn fails_on_duplicate_content_at_another_seq() {
        let (ledger, mut observed) = history();
        // The hub stored a retried batch again under fresh seqs: dedup failed.
        let mut copy = observed[39].clone();
        copy.seq = 21;
        observed.push(copy);
        let report = ledger.check(observed);
        assert_eq!(report.duplicates, 1, "{report}");
        assert!(
            matches!(&report.problems[0], Problem::DuplicateContent { same_as, .. } if same_as.seq == 20)
        );
    }

    #[test]
    fn fails_on_an_order_inversion() {
        let (ledger, mut observed) = history();
        // Seqs 1 and 3 share key-0; the hub returning 3 before 1 breaks per-key order.
        observed.swap(0, 2);
        let report = ledger.check(observed);
        assert_eq!(report.order_inversions, 1, "{report}");
        assert_eq!(report.matched, 40);
        assert!(!report.is_ok());
    }

    #[test]
    fn other_keys_may_interleave() {
        let (ledger, mut observed) = history();
        // Seqs 1 (key-0) and 2 (key-1) swapped: per-key order still holds.
        observed.swap(0, 1);
        ledger.check(observed).assert_ok();
    }

    #[test]
    fn fails_on_changed_content() {
        let (ledger, observed) = history();
        for mutate in [
            (|r: &mut ObservedRecord| r.fields["v"] = json!(999)) as fn(&mut ObservedRecord),
            |r| r.fields["v"] = json!(r.fields["v"].as_u64().unwrap() as f64),
            |r| r.ts += 1,
            |r| r.key.push('x'),
        ] {
            let mut observed = observed.clone();
            mutate(&mut observed[5]);
            let report = ledger.check(observed);
            assert!(!report.is_ok());
            assert_eq!(report.mismatched, 1, "{report}");
        }
    }

    #[test]
    fn fails_on_an_unacknowledged_record() {
        let (ledger, mut observed) = history();
        let mut extra = observed[0].clone();
        extra.seq = 100;
        extra.fields = json!({"v": "never sent"});
        observed.push(extra);
        let report = ledger.check(observed);
        assert_eq!(report.unexpected, 1, "{report}");
    }

    #[test]
    fn a_maybe_batch_may_land_once_or_not_at_all() {
        let (mut ledger, observed) = history();
        let lost = SentRecord::new("key-0", 99_000, json!({"v": "lost ack"}));
        ledger.record_maybe("dev-a", "s", std::slice::from_ref(&lost));
        ledger.check(observed.clone()).assert_ok();

        let mut landed = observed.clone();
        landed.push(observe("dev-a", 21, &lost));
        let report = ledger.check(landed.clone());
        report.assert_ok();
        assert_eq!(report.maybe_landed, 1);

        landed.push(observe("dev-a", 22, &lost));
        let report = ledger.check(landed);
        assert_eq!(report.duplicates, 1, "{report}");
    }

    #[test]
    fn an_acked_retry_resolves_the_maybe_set() {
        let (mut ledger, mut observed) = history();
        let batch = vec![SentRecord::new("key-0", 5, json!({"v": "retried"}))];
        ledger.record_maybe("dev-b", "s", &batch);
        let ack = IngestAck {
            stream: "s".into(),
            epoch: 1,
            first_seq: 22,
            last_seq: 22,
            count: 1,
        };
        ledger.record_ack("dev-b", &ack, &batch).unwrap();
        assert_eq!(ledger.maybe_len(), 0);
        // The lost first attempt landed at seq 21 and the acknowledged retry at 22: a duplicate.
        observed.push(observe("dev-b", 21, &batch[0]));
        observed.push(observe("dev-b", 22, &batch[0]));
        let report = ledger.check(observed);
        assert_eq!(report.duplicates, 1, "{report}");
    }

    #[test]
    fn acks_must_match_what_was_sent() {
        let mut ledger = Ledger::new();
        let sent = vec![SentRecord::new("k", 1, json!({})); 3];
        let bad = IngestAck {
            stream: "s".into(),
            epoch: 1,
            first_seq: 1,
            last_seq: 2,
            count: 3,
        };
        assert!(ledger.record_ack("d", &bad, &sent).is_err());
        let good = IngestAck { last_seq: 3, ..bad };
        ledger.record_ack("d", &good, &sent).unwrap();
        ledger.record_ack("d", &good, &sent).unwrap();
        assert_eq!(ledger.acked_len(), 3);
        let other = vec![SentRecord::new("k", 2, json!({})); 3];
        assert!(ledger.record_ack("d", &good, &other).is_err());
    }

    #[test]
    fn check_streams_ignores_other_streams() {
        let (mut ledger, observed) = history();
        let sent = vec![SentRecord::new("k", 1, json!({"x": 1}))];
        let ack = IngestAck {
            stream: "other".into(),
            epoch: 1,
            first_seq: 1,
            last_seq: 1,
            count: 1,
        };
        ledger.record_ack("dev-a", &ack, &sent).unwrap();
        assert_eq!(ledger.check(observed.clone()).missing, 1);
        ledger.check_streams(&["s"], observed).assert_ok();
    }

    /// A fake agent that answers each request with the next canned answer (or closes).
    fn fake_agent(answers: Vec<Option<String>>) -> std::net::SocketAddr {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            for answer in answers {
                let (mut stream, _) = listener.accept().unwrap();
                let mut buf = [0u8; 4096];
                let _ = stream.read(&mut buf);
                if let Some(answer) = answer {
                    let _ = stream.write_all(answer.as_bytes());
                }
            }
        });
        addr
    }

    #[test]
    fn producer_records_acks_rejections_and_lost_answers() {
        let body =
            r#"{"stream":"s","epoch":"0000000000000001","first_seq":1,"last_seq":1,"count":1}"#;
        let ack = format!(
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        let busy = "HTTP/1.1 503 Busy\r\nContent-Length: 0\r\n\r\n".to_string();
        let addr = fake_agent(vec![Some(ack), Some(busy), None]);
        let producer = Producer::new("d", addr);
        let mut ledger = Ledger::new();
        let batch = |v: i64| vec![SentRecord::new("k", v, json!({"v": v}))];
        let outcome = producer
            .post(&mut ledger, "s", &batch(1), Some("idem-1"))
            .unwrap();
        assert!(
            matches!(outcome, PostOutcome::Acked(IngestAck { first_seq: 1, .. })),
            "{outcome:?}"
        );
        let outcome = producer.post(&mut ledger, "s", &batch(2), None).unwrap();
        assert!(
            matches!(outcome, PostOutcome::Rejected { status: 503, .. }),
            "{outcome:?}"
        );
        let outcome = producer.post(&mut ledger, "s", &batch(3), None).unwrap();
        assert!(
            matches!(outcome, PostOutcome::Unknown { .. }),
            "{outcome:?}"
        );
        assert_eq!((ledger.acked_len(), ledger.maybe_len()), (1, 1));
    }

    #[test]
    fn parses_hub_ndjson_and_the_ack_answer() {
        let text = "{\"device\":\"d\",\"epoch\":2,\"seq\":7,\"key\":\"k\",\"ts\":-5,\"fields\":{\"b\":1,\"a\":true}}\n\n";
        let records = ObservedRecord::parse_ndjson("s", text).unwrap();
        assert_eq!(records.len(), 1);
        let mut ledger = Ledger::new();
        let answer =
            br#"{"stream":"s","epoch":"0000000000000002","first_seq":7,"last_seq":7,"count":1}"#;
        let sent = [SentRecord::new("k", -5, json!({"a": true, "b": 1}))];
        ledger.record_ack_json("d", answer, &sent).unwrap();
        ledger.check(records).assert_ok();
        assert!(ObservedRecord::parse_ndjson("s", "{\"device\":\"d\"}").is_err());
        assert!(
            ledger
                .record_ack_json("d", b"{\"error\":\"x\"}", &sent)
                .is_err()
        );
    }
}
