//! The per-stream filter pipeline: stages compiled once at start-up, run on every record
//! before sequencing.
//!
//! Stages ([`StageSpec`]): a predicate (`where`), a deadband per key and field, downsampling per
//! key per interval (last or mean), tumbling-window aggregates per key (count, min, max, mean,
//! last), and field projection with renaming. Predicates are parsed once by [`predicate`] into a
//! tree of closures; no text is interpreted per record.
//!
//! Time is event time (`Record::ts`). A window (or downsampling interval) of a key closes when a
//! record of that key with a later window arrives, or, for a key that went quiet, by the clock
//! ([`idle`]: once its end plus `idle_close_after` has passed and the key sent nothing for that
//! long). Records older than the key's open window, or for a window the clock closed, are late,
//! counted and dropped, so a closed window is never emitted twice.
//!
//! **Internal fields.** Fields whose name starts with `_` are the agent's own (`_topic`,
//! `_mqtt_digest`, `_idempotency`; producers cannot send them). No stage ever aggregates one: a
//! `window` on a `_` field is refused at compile time, and `downsample` in `mean` mode never
//! averages them. An aggregated record (a `mean` interval, a window) carries the fields of
//! [`CARRIED_FIELDS`] (the source's identity: `_topic`) from the last record it summarises, and
//! drops every other internal field: a digest or key tag names one message or batch, not a
//! summary of many. `downsample` in `last` mode passes its record as it was, internal fields
//! included (they belong to that one record).
//!
//! Bad data never panics: a missing field or a field of the wrong type is counted in
//! [`FilterStats`] and the record is handled as documented on each stage.
//!
//! Configuration (`[[streams]] filters = [...]`) is parsed in `crate::config`. A stream's
//! pipeline runs in one of two places: on the ingest path of a plain stream
//! (`crate::http::Ingest`), or in a derived stream's runner ([`derive`]), which consumes a
//! source stream from the log and stores its position atomically with its outputs, so open
//! windows survive restarts exactly once. [`Pipeline::snapshot`] / [`Pipeline::restore`] carry
//! the stages' state across restarts for the runner. See `docs/filters.md`.

pub mod derive;
pub mod idle;
pub mod predicate;
mod snapshot;

pub use idle::{Clock, IdleClose};
pub(crate) use snapshot::record_to_json;
use snapshot::{
    array, closed_from_json, closed_to_json, field_from_json, field_to_json, i64_at,
    record_from_json, str_at, u64_at,
};

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use sync::{Record, Value};
use thiserror::Error;

/// The prefix of the agent's internal field names.
pub const INTERNAL_PREFIX: char = '_';

/// Internal fields an aggregated record carries from the last record it summarises: they
/// identify where the data came from (the MQTT topic), which a summary still shares.
pub const CARRIED_FIELDS: [&str; 1] = ["_topic"];

/// True for the agent's own fields (`_topic`, `_mqtt_digest`, `_idempotency`, ...).
pub fn is_internal(name: &str) -> bool {
    name.starts_with(INTERNAL_PREFIX)
}

/// The internal fields of `r` that an aggregate of it carries ([`CARRIED_FIELDS`]).
fn carried(r: &Record) -> impl Iterator<Item = (String, Value)> + '_ {
    r.fields
        .iter()
        .filter(|(n, _)| CARRIED_FIELDS.contains(&n.as_str()))
        .cloned()
}

/// Counters shared by a pipeline's stages.
#[derive(Debug, Default)]
pub struct FilterStats {
    /// A field a stage needs is missing from a record.
    pub missing_fields: AtomicU64,
    /// A field holds a type the stage cannot use (such as a string compared with a number).
    pub type_mismatches: AtomicU64,
    /// Records older than their key's open window, dropped.
    pub late_records: AtomicU64,
    /// Records into and out of each stage, in pipeline order (empty for a bare `default()`).
    pub stages: Vec<StageCounters>,
    /// For a derived stream: the source seq (in the source's current epoch) its runner has
    /// consumed up to. 0 for a plain stream's pipeline.
    pub consumed_seq: AtomicU64,
}

/// Records into and out of one stage. What went in and did not come out was dropped (filtered,
/// merged into a window or an interval, or late).
#[derive(Debug, Default)]
pub struct StageCounters {
    /// The stage's kind as configured: `where`, `deadband`, `downsample`, `window`, `project`.
    pub kind: &'static str,
    pub input: AtomicU64,
    pub output: AtomicU64,
}

impl StageCounters {
    /// Records the stage took in and did not pass on.
    pub fn dropped(&self) -> u64 {
        self.input
            .load(Ordering::Relaxed)
            .saturating_sub(self.output.load(Ordering::Relaxed))
    }
}

impl FilterStats {
    fn missing(&self) {
        self.missing_fields.fetch_add(1, Ordering::Relaxed);
    }
    fn mismatch(&self) {
        self.type_mismatches.fetch_add(1, Ordering::Relaxed);
    }
}

/// How a downsampling stage summarises an interval.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DownsampleMode {
    /// The interval's last record (by arrival), as it was.
    Last,
    /// One record at the interval's start holding the mean of each numeric field.
    Mean,
}

/// A window aggregate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Agg {
    Count,
    Min,
    Max,
    Mean,
    Last,
}

impl Agg {
    fn name(self) -> &'static str {
        match self {
            Agg::Count => "count",
            Agg::Min => "min",
            Agg::Max => "max",
            Agg::Mean => "mean",
            Agg::Last => "last",
        }
    }
}

/// One stage as configured.
#[derive(Debug, Clone, PartialEq)]
pub enum StageSpec {
    /// Keeps records for which the expression holds (see [`predicate`]).
    Where(String),
    /// Keeps a record when `field` moved by at least `threshold` since the last kept record of
    /// its key. Records without the field, or with a non-numeric one, pass (counted).
    Deadband { field: String, threshold: f64 },
    /// One record per key per `interval_ns`.
    Downsample {
        interval_ns: i64,
        mode: DownsampleMode,
    },
    /// Per key, per tumbling `interval_ns` window of `field`: one record at the window's start
    /// with fields `<field>.<agg>`. Records without a numeric `field` are counted and skipped.
    Window {
        interval_ns: i64,
        field: String,
        aggs: Vec<Agg>,
    },
    /// Keeps only these fields, renamed when a new name is given.
    Project(Vec<(String, Option<String>)>),
}

impl StageSpec {
    /// The stage's kind, as configured and as labelled on `/metrics`.
    pub fn kind(&self) -> &'static str {
        match self {
            StageSpec::Where(_) => "where",
            StageSpec::Deadband { .. } => "deadband",
            StageSpec::Downsample { .. } => "downsample",
            StageSpec::Window { .. } => "window",
            StageSpec::Project(_) => "project",
        }
    }
}

/// Why a pipeline could not be compiled.
#[derive(Debug, Error, PartialEq)]
pub enum CompileError {
    #[error("stage {stage}: {message}")]
    Stage { stage: usize, message: String },
}

/// Why a snapshot could not be restored into a pipeline.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum RestoreError {
    #[error(
        "the snapshot was taken from another pipeline (fingerprint {found:016x}, expected {expected:016x})"
    )]
    OtherPipeline { found: u64, expected: u64 },
    #[error("stage {stage}: malformed snapshot: {message}")]
    Malformed { stage: usize, message: String },
}

pub(crate) type Json = serde_json::Value;

trait Stage: Send + Sync {
    /// Takes one record that reached the stage at processing time `now` (ns).
    fn process(&mut self, r: Record, now: i64, out: &mut Vec<Record>, stats: &FilterStats);
    /// Closes the intervals of quiet keys that are due at `now` ([`idle`]).
    fn close_idle(&mut self, _now: i64, _idle: IdleClose, _out: &mut Vec<Record>) {}
    /// The stage's state, for [`Pipeline::snapshot`]; `null` for stateless stages.
    fn snapshot(&self) -> Json {
        Json::Null
    }
    /// Replaces the stage's state with a snapshot's; `now` counts as the last arrival of
    /// every restored open interval.
    fn restore(&mut self, _state: &Json, _now: i64) -> Result<(), String> {
        Ok(())
    }
}

/// A compiled pipeline for one stream.
pub struct Pipeline {
    stages: Vec<Box<dyn Stage>>,
    /// Identifies the configured stages, so a snapshot is never restored into another pipeline.
    fingerprint: u64,
    stats: Arc<FilterStats>,
    buf: Vec<Record>,
    next: Vec<Record>,
    idle: IdleClose,
    clock: Clock,
}

impl std::fmt::Debug for Pipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pipeline")
            .field("stages", &self.stages.len())
            .finish_non_exhaustive()
    }
}

impl Pipeline {
    /// Compiles the stages once.
    pub fn compile(specs: &[StageSpec]) -> Result<Self, CompileError> {
        let mut stages: Vec<Box<dyn Stage>> = Vec::with_capacity(specs.len());
        for (i, spec) in specs.iter().enumerate() {
            let bad = |message: String| CompileError::Stage { stage: i, message };
            stages.push(match spec {
                StageSpec::Where(text) => Box::new(Where(
                    predicate::compile(text).map_err(|e| bad(e.to_string()))?,
                )),
                StageSpec::Deadband { field, threshold } => {
                    if !(threshold.is_finite() && *threshold >= 0.0) {
                        return Err(bad("deadband threshold must be a finite number >= 0".into()));
                    }
                    Box::new(Deadband {
                        field: field.clone(),
                        threshold: *threshold,
                        last: HashMap::new(),
                    })
                }
                StageSpec::Downsample { interval_ns, mode } => {
                    if *interval_ns <= 0 {
                        return Err(bad("downsample interval must be positive".into()));
                    }
                    Box::new(Downsample {
                        interval: *interval_ns,
                        mode: *mode,
                        open: HashMap::new(),
                        closed: HashMap::new(),
                    })
                }
                StageSpec::Window {
                    interval_ns,
                    field,
                    aggs,
                } => {
                    if *interval_ns <= 0 || aggs.is_empty() {
                        return Err(bad(
                            "window needs a positive interval and at least one aggregate".into(),
                        ));
                    }
                    if is_internal(field) {
                        return Err(bad(format!(
                            "window field {field:?} is one of the agent's internal fields \
                             (names starting with `_`), which are never aggregated"
                        )));
                    }
                    Box::new(Window {
                        interval: *interval_ns,
                        names: aggs
                            .iter()
                            .map(|a| format!("{field}.{}", a.name()))
                            .collect(),
                        field: field.clone(),
                        aggs: aggs.clone(),
                        open: HashMap::new(),
                        closed: HashMap::new(),
                    })
                }
                StageSpec::Project(keep) => Box::new(Project(keep.clone())),
            });
        }
        let stats = FilterStats {
            stages: specs
                .iter()
                .map(|s| StageCounters {
                    kind: s.kind(),
                    ..StageCounters::default()
                })
                .collect(),
            ..FilterStats::default()
        };
        Ok(Pipeline {
            stages,
            fingerprint: fnv1a(format!("{specs:?}").as_bytes()),
            stats: Arc::new(stats),
            buf: Vec::new(),
            next: Vec::new(),
            idle: IdleClose::default(),
            clock: idle::wall_clock(),
        })
    }

    /// Sets when the clock closes the intervals of quiet keys (default: after each stage's
    /// interval).
    pub fn with_idle_close(mut self, idle: IdleClose) -> Self {
        self.idle = idle;
        self
    }

    /// Replaces the processing-time clock (the wall clock by default), for tests.
    pub fn with_clock(mut self, clock: Clock) -> Self {
        self.clock = clock;
        self
    }

    /// Closes the intervals of quiet keys that are due now ([`idle`]) and runs what they emit
    /// through the stages after theirs, returning what comes out. Deterministic for a given
    /// state and clock: due keys close in key order.
    pub fn close_idle(&mut self) -> Vec<Record> {
        let now = (self.clock)();
        let mut out = Vec::new();
        for i in 0..self.stages.len() {
            let mut emitted = Vec::new();
            self.stages[i].close_idle(now, self.idle, &mut emitted);
            if emitted.is_empty() {
                continue;
            }
            self.stats.stages[i]
                .output
                .fetch_add(emitted.len() as u64, Ordering::Relaxed);
            self.buf.clear();
            self.buf.extend(emitted);
            if i + 1 == self.stages.len() {
                out.append(&mut self.buf);
            } else {
                self.feed(i + 1, now, &mut out);
            }
        }
        out
    }

    /// True when the pipeline has no stages: records pass unchanged.
    pub fn is_empty(&self) -> bool {
        self.stages.is_empty()
    }

    /// Identifies the configured stages (a hash of their specs).
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// Runs a batch through the pipeline, returning what comes out.
    pub fn run(&mut self, records: Vec<Record>) -> Vec<Record> {
        if self.stages.is_empty() {
            return records;
        }
        let now = (self.clock)();
        let mut out = Vec::new();
        for r in records {
            self.push_at(r, now, &mut out);
        }
        out
    }

    /// The state of every stage (open windows and intervals, deadband references) as JSON.
    /// Floats are stored as their bits, so a restored pipeline continues bit for bit.
    pub fn snapshot(&self) -> Json {
        serde_json::json!({
            "fingerprint": format!("{:016x}", self.fingerprint),
            "stages": self.stages.iter().map(|s| s.snapshot()).collect::<Vec<_>>(),
        })
    }

    /// Replaces every stage's state with a [`Pipeline::snapshot`] of the same pipeline.
    /// On error the pipeline's state is unspecified: recompile it.
    pub fn restore(&mut self, snapshot: &Json) -> Result<(), RestoreError> {
        let found = snapshot
            .get("fingerprint")
            .and_then(Json::as_str)
            .and_then(|s| u64::from_str_radix(s, 16).ok())
            .unwrap_or(0);
        if found != self.fingerprint {
            return Err(RestoreError::OtherPipeline {
                found,
                expected: self.fingerprint,
            });
        }
        let states = snapshot
            .get("stages")
            .and_then(Json::as_array)
            .filter(|a| a.len() == self.stages.len())
            .ok_or_else(|| RestoreError::Malformed {
                stage: 0,
                message: "expected one state per stage".into(),
            })?;
        let now = (self.clock)();
        for (i, (stage, state)) in self.stages.iter_mut().zip(states).enumerate() {
            stage
                .restore(state, now)
                .map_err(|message| RestoreError::Malformed { stage: i, message })?;
        }
        Ok(())
    }

    /// The pipeline's counters.
    pub fn stats(&self) -> &Arc<FilterStats> {
        &self.stats
    }

    /// Runs one record through every stage, appending what comes out to `out`.
    pub fn push(&mut self, r: Record, out: &mut Vec<Record>) {
        let now = (self.clock)();
        self.push_at(r, now, out);
    }

    fn push_at(&mut self, r: Record, now: i64, out: &mut Vec<Record>) {
        if self.stages.is_empty() {
            out.push(r);
            return;
        }
        self.buf.clear();
        self.buf.push(r);
        self.feed(0, now, out);
    }

    /// Runs the records in `buf` through stages `from..`, appending what comes out of the last
    /// one to `out`.
    fn feed(&mut self, from: usize, now: i64, out: &mut Vec<Record>) {
        let last = self.stages.len() - 1;
        for i in from..=last {
            if self.buf.is_empty() {
                return;
            }
            let target = if i == last { &mut *out } else { &mut self.next };
            let before = target.len();
            let counters = &self.stats.stages[i];
            counters
                .input
                .fetch_add(self.buf.len() as u64, Ordering::Relaxed);
            for r in self.buf.drain(..) {
                self.stages[i].process(r, now, target, &self.stats);
            }
            counters
                .output
                .fetch_add((target.len() - before) as u64, Ordering::Relaxed);
            if i != last {
                std::mem::swap(&mut self.buf, &mut self.next);
            }
        }
    }
}

/// The numeric value of a field, counting a missing field or a non-numeric one.
fn numeric(r: &Record, field: &str, stats: &FilterStats) -> Option<f64> {
    match r.fields.iter().find(|(n, _)| n == field) {
        None => {
            stats.missing();
            None
        }
        Some((_, Value::F64(v))) => Some(*v),
        Some((_, Value::I64(v))) => Some(*v as f64),
        Some(_) => {
            stats.mismatch();
            None
        }
    }
}

/// The start of the tumbling window holding `ts`. Producers choose `ts`: near `i64::MIN` the
/// window starts at `i64::MIN` rather than overflowing.
fn window_start(ts: i64, interval: i64) -> i64 {
    ts.saturating_sub(ts.rem_euclid(interval))
}

struct Where(predicate::Predicate);

impl Stage for Where {
    fn process(&mut self, r: Record, _now: i64, out: &mut Vec<Record>, stats: &FilterStats) {
        if self.0.eval(&r, stats) {
            out.push(r);
        }
    }
}

struct Deadband {
    field: String,
    threshold: f64,
    last: HashMap<String, f64>,
}

impl Stage for Deadband {
    fn process(&mut self, r: Record, _now: i64, out: &mut Vec<Record>, stats: &FilterStats) {
        let Some(v) = numeric(&r, &self.field, stats) else {
            out.push(r);
            return;
        };
        match self.last.get_mut(&r.key) {
            Some(prev) if (v - *prev).abs() < self.threshold => {}
            Some(prev) => {
                *prev = v;
                out.push(r);
            }
            None => {
                self.last.insert(r.key.clone(), v);
                out.push(r);
            }
        }
    }

    fn snapshot(&self) -> Json {
        Json::Array(
            self.last
                .iter()
                .map(|(k, v)| serde_json::json!([k, v.to_bits()]))
                .collect(),
        )
    }

    fn restore(&mut self, state: &Json, _now: i64) -> Result<(), String> {
        self.last.clear();
        for e in array(state)? {
            self.last
                .insert(str_at(e, 0)?.to_owned(), f64::from_bits(u64_at(e, 1)?));
        }
        Ok(())
    }
}

struct OpenInterval {
    start: i64,
    last: Record,
    sums: Vec<(String, f64, u64)>,
    /// Processing time of the interval's last record ([`idle`]).
    seen: i64,
}

struct Downsample {
    interval: i64,
    mode: DownsampleMode,
    open: HashMap<String, OpenInterval>,
    /// Per key without an open interval: the start of the last one the clock closed.
    closed: HashMap<String, i64>,
}

impl Downsample {
    fn emit(&self, o: OpenInterval, out: &mut Vec<Record>) {
        match self.mode {
            DownsampleMode::Last => out.push(o.last),
            DownsampleMode::Mean => {
                let mut fields: Vec<(String, Value)> = o
                    .sums
                    .into_iter()
                    .map(|(n, s, c)| (n, Value::F64(s / c as f64)))
                    .collect();
                fields.extend(carried(&o.last));
                out.push(Record {
                    tags: Vec::new(),
                    key: o.last.key,
                    ts: o.start,
                    fields,
                })
            }
        }
    }

    /// Adds `r`'s numeric fields to the interval's sums; internal fields are never averaged.
    fn add(sums: &mut Vec<(String, f64, u64)>, r: &Record) {
        for (name, v) in &r.fields {
            if is_internal(name) {
                continue;
            }
            let x = match v {
                Value::F64(x) => *x,
                Value::I64(x) => *x as f64,
                _ => continue,
            };
            match sums.iter_mut().find(|(n, ..)| n == name) {
                Some(e) => {
                    e.1 += x;
                    e.2 += 1;
                }
                None => sums.push((name.clone(), x, 1)),
            }
        }
    }
}

impl Stage for Downsample {
    fn process(&mut self, r: Record, now: i64, out: &mut Vec<Record>, stats: &FilterStats) {
        let start = window_start(r.ts, self.interval);
        if closed_by_clock(
            &mut self.closed,
            &r.key,
            start,
            self.open.contains_key(&r.key),
        ) {
            stats.late_records.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let current = self.open.get(&r.key).map(|o| o.start);
        match current {
            Some(s) if start < s => {
                stats.late_records.fetch_add(1, Ordering::Relaxed);
            }
            Some(s) if start == s => {
                if let Some(o) = self.open.get_mut(&r.key) {
                    Downsample::add(&mut o.sums, &r);
                    o.last = r;
                    o.seen = now;
                }
            }
            _ => {
                let mut sums = Vec::new();
                Downsample::add(&mut sums, &r);
                let new = OpenInterval {
                    start,
                    last: r,
                    sums,
                    seen: now,
                };
                if let Some(closed) = self.open.insert(new.last.key.clone(), new) {
                    self.emit(closed, out);
                }
            }
        }
    }

    fn close_idle(&mut self, now: i64, idle: IdleClose, out: &mut Vec<Record>) {
        let Some(after) = idle.after_ns(self.interval) else {
            return;
        };
        let due = idle::due_keys(
            &self.open,
            |o| (o.start, o.seen),
            (self.interval, after, now),
        );
        for key in due {
            let o = self.open.remove(&key).expect("a due interval is open");
            self.closed.insert(key, o.start);
            self.emit(o, out);
        }
    }

    fn snapshot(&self) -> Json {
        Json::Array(
            self.open
                .values()
                .map(|o| {
                    let sums: Vec<Json> = o
                        .sums
                        .iter()
                        .map(|(n, s, c)| serde_json::json!([n, s.to_bits(), c]))
                        .collect();
                    serde_json::json!([o.start, record_to_json(&o.last), sums])
                })
                .chain(closed_to_json(&self.closed))
                .collect(),
        )
    }

    fn restore(&mut self, state: &Json, now: i64) -> Result<(), String> {
        self.open.clear();
        self.closed.clear();
        for e in array(state)? {
            if let Some((key, start)) = closed_from_json(e)? {
                self.closed.insert(key, start);
                continue;
            }
            let start = i64_at(e, 0)?;
            let last = record_from_json(e.get(1).ok_or("missing record")?)?;
            let mut sums = Vec::new();
            for s in array(e.get(2).ok_or("missing sums")?)? {
                sums.push((
                    str_at(s, 0)?.to_owned(),
                    f64::from_bits(u64_at(s, 1)?),
                    u64_at(s, 2)?,
                ));
            }
            self.open.insert(
                last.key.clone(),
                OpenInterval {
                    start,
                    last,
                    sums,
                    seen: now,
                },
            );
        }
        Ok(())
    }
}

#[derive(Clone)]
struct WindowState {
    start: i64,
    count: u64,
    min: f64,
    max: f64,
    sum: f64,
    last: f64,
    /// [`CARRIED_FIELDS`] of the window's last record.
    carried: Vec<(String, Value)>,
    /// Processing time of the window's last record ([`idle`]).
    seen: i64,
}

struct Window {
    interval: i64,
    field: String,
    aggs: Vec<Agg>,
    names: Vec<String>,
    open: HashMap<String, WindowState>,
    /// Per key without an open window: the start of the last one the clock closed.
    closed: HashMap<String, i64>,
}

impl Window {
    fn emit(&self, key: String, w: WindowState, out: &mut Vec<Record>) {
        let mut fields: Vec<(String, Value)> = self
            .aggs
            .iter()
            .zip(&self.names)
            .map(|(a, n)| {
                let v = match a {
                    Agg::Count => Value::I64(w.count as i64),
                    Agg::Min => Value::F64(w.min),
                    Agg::Max => Value::F64(w.max),
                    Agg::Mean => Value::F64(w.sum / w.count as f64),
                    Agg::Last => Value::F64(w.last),
                };
                (n.clone(), v)
            })
            .collect();
        fields.extend(w.carried);
        out.push(Record {
            tags: Vec::new(),
            key,
            ts: w.start,
            fields,
        });
    }
}

impl Stage for Window {
    fn process(&mut self, r: Record, now: i64, out: &mut Vec<Record>, stats: &FilterStats) {
        let Some(v) = numeric(&r, &self.field, stats) else {
            return;
        };
        let start = window_start(r.ts, self.interval);
        if closed_by_clock(
            &mut self.closed,
            &r.key,
            start,
            self.open.contains_key(&r.key),
        ) {
            stats.late_records.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let fresh = WindowState {
            start,
            count: 1,
            min: v,
            max: v,
            sum: v,
            last: v,
            carried: carried(&r).collect(),
            seen: now,
        };
        match self.open.get_mut(&r.key) {
            Some(w) if start < w.start => {
                stats.late_records.fetch_add(1, Ordering::Relaxed);
            }
            Some(w) if start == w.start => {
                w.count += 1;
                w.min = w.min.min(v);
                w.max = w.max.max(v);
                w.sum += v;
                w.last = v;
                w.carried = fresh.carried;
                w.seen = now;
            }
            Some(w) => {
                let closed = std::mem::replace(w, fresh);
                self.emit(r.key, closed, out);
            }
            None => {
                self.open.insert(r.key, fresh);
            }
        }
    }

    fn close_idle(&mut self, now: i64, idle: IdleClose, out: &mut Vec<Record>) {
        let Some(after) = idle.after_ns(self.interval) else {
            return;
        };
        let due = idle::due_keys(
            &self.open,
            |w| (w.start, w.seen),
            (self.interval, after, now),
        );
        for key in due {
            let w = self.open.remove(&key).expect("a due window is open");
            self.closed.insert(key.clone(), w.start);
            self.emit(key, w, out);
        }
    }

    fn snapshot(&self) -> Json {
        Json::Array(
            self.open
                .iter()
                .map(|(k, w)| {
                    serde_json::json!([
                        k,
                        w.start,
                        w.count,
                        w.min.to_bits(),
                        w.max.to_bits(),
                        w.sum.to_bits(),
                        w.last.to_bits(),
                        w.carried.iter().map(field_to_json).collect::<Vec<_>>()
                    ])
                })
                .chain(closed_to_json(&self.closed))
                .collect(),
        )
    }

    fn restore(&mut self, state: &Json, now: i64) -> Result<(), String> {
        self.open.clear();
        self.closed.clear();
        for e in array(state)? {
            if let Some((key, start)) = closed_from_json(e)? {
                self.closed.insert(key, start);
                continue;
            }
            let bits = |i| u64_at(e, i).map(f64::from_bits);
            self.open.insert(
                str_at(e, 0)?.to_owned(),
                WindowState {
                    start: i64_at(e, 1)?,
                    count: u64_at(e, 2)?,
                    min: bits(3)?,
                    max: bits(4)?,
                    sum: bits(5)?,
                    last: bits(6)?,
                    // Absent from snapshots taken before windows carried fields.
                    carried: match e.get(7) {
                        Some(c) => array(c)?
                            .iter()
                            .map(field_from_json)
                            .collect::<Result<_, _>>()?,
                        None => Vec::new(),
                    },
                    seen: now,
                },
            );
        }
        Ok(())
    }
}

/// True when `start` is at or before the interval the clock last closed for `key` (which
/// has no open interval): the record is late. A later interval forgets the mark, since the
/// interval it opens is the reference from then on.
fn closed_by_clock(closed: &mut HashMap<String, i64>, key: &str, start: i64, open: bool) -> bool {
    if open {
        return false;
    }
    match closed.get(key) {
        Some(c) if start <= *c => true,
        Some(_) => {
            closed.remove(key);
            false
        }
        None => false,
    }
}

struct Project(Vec<(String, Option<String>)>);

impl Stage for Project {
    fn process(&mut self, mut r: Record, _now: i64, out: &mut Vec<Record>, _stats: &FilterStats) {
        let mut fields = Vec::with_capacity(self.0.len());
        for (name, rename) in &self.0 {
            if let Some(i) = r.fields.iter().position(|(n, _)| n == name) {
                let (n, v) = r.fields.swap_remove(i);
                fields.push((rename.clone().unwrap_or(n), v));
            }
        }
        // A record left without fields carries nothing: drop it.
        if !fields.is_empty() {
            r.fields = fields;
            out.push(r);
        }
    }
}

/// FNV-1a 64: a stable hash (unlike `DefaultHasher`, the same in every build).
pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}
