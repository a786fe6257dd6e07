//! The per-stream filter pipeline: stages compiled once at start-up, run on every record
//! before sequencing.
//!
//! Stages ([`StageSpec`]): a predicate (`where`), a deadband per key and field, downsampling per
//! key per interval (last or mean), tumbling-window aggregates per key (count, min, max, mean,
//! last), and field projection with renaming. Predicates are parsed once by [`predicate`] into a
//! tree of closures; no text is interpreted per record.
//!
//! Time is event time (`Record::ts`). A window (or downsampling interval) of a key closes when a
//! record of that key with a later window arrives; records older than the key's open window are
//! late, counted and dropped, so a closed window is never emitted twice.
//!
//! Bad data never panics: a missing field or a field of the wrong type is counted in
//! [`FilterStats`] and the record is handled as documented on each stage.
//!
//! Not done yet: wiring into `[[streams]] filters` and derived streams with a durable
//! consumed-up-to seq; open windows live in memory only.

pub mod predicate;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use sync::{Record, Value};
use thiserror::Error;

/// Counters shared by a pipeline's stages.
#[derive(Debug, Default)]
pub struct FilterStats {
    /// A field a stage needs is missing from a record.
    pub missing_fields: AtomicU64,
    /// A field holds a type the stage cannot use (such as a string compared with a number).
    pub type_mismatches: AtomicU64,
    /// Records older than their key's open window, dropped.
    pub late_records: AtomicU64,
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

/// Why a pipeline could not be compiled.
#[derive(Debug, Error, PartialEq)]
pub enum CompileError {
    #[error("stage {stage}: {message}")]
    Stage { stage: usize, message: String },
}

trait Stage: Send {
    fn process(&mut self, r: Record, out: &mut Vec<Record>, stats: &FilterStats);
}

/// A compiled pipeline for one stream.
pub struct Pipeline {
    stages: Vec<Box<dyn Stage>>,
    stats: Arc<FilterStats>,
    buf: Vec<Record>,
    next: Vec<Record>,
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
                    Box::new(Window {
                        interval: *interval_ns,
                        names: aggs
                            .iter()
                            .map(|a| format!("{field}.{}", a.name()))
                            .collect(),
                        field: field.clone(),
                        aggs: aggs.clone(),
                        open: HashMap::new(),
                    })
                }
                StageSpec::Project(keep) => Box::new(Project(keep.clone())),
            });
        }
        Ok(Pipeline {
            stages,
            stats: Arc::default(),
            buf: Vec::new(),
            next: Vec::new(),
        })
    }

    /// The pipeline's counters.
    pub fn stats(&self) -> &Arc<FilterStats> {
        &self.stats
    }

    /// Runs one record through every stage, appending what comes out to `out`.
    pub fn push(&mut self, r: Record, out: &mut Vec<Record>) {
        if self.stages.is_empty() {
            out.push(r);
            return;
        }
        self.buf.clear();
        self.buf.push(r);
        let last = self.stages.len() - 1;
        for (i, stage) in self.stages.iter_mut().enumerate() {
            let target = if i == last { &mut *out } else { &mut self.next };
            for r in self.buf.drain(..) {
                stage.process(r, target, &self.stats);
            }
            if i != last {
                std::mem::swap(&mut self.buf, &mut self.next);
            }
            if self.buf.is_empty() && i != last {
                return;
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

/// The start of the tumbling window holding `ts`.
fn window_start(ts: i64, interval: i64) -> i64 {
    ts - ts.rem_euclid(interval)
}

struct Where(predicate::Predicate);

impl Stage for Where {
    fn process(&mut self, r: Record, out: &mut Vec<Record>, stats: &FilterStats) {
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
    fn process(&mut self, r: Record, out: &mut Vec<Record>, stats: &FilterStats) {
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
}

struct OpenInterval {
    start: i64,
    last: Record,
    sums: Vec<(String, f64, u64)>,
}

struct Downsample {
    interval: i64,
    mode: DownsampleMode,
    open: HashMap<String, OpenInterval>,
}

impl Downsample {
    fn emit(&self, o: OpenInterval, out: &mut Vec<Record>) {
        match self.mode {
            DownsampleMode::Last => out.push(o.last),
            DownsampleMode::Mean => out.push(Record {
                key: o.last.key,
                ts: o.start,
                fields: o
                    .sums
                    .into_iter()
                    .map(|(n, s, c)| (n, Value::F64(s / c as f64)))
                    .collect(),
            }),
        }
    }

    fn add(sums: &mut Vec<(String, f64, u64)>, r: &Record) {
        for (name, v) in &r.fields {
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
    fn process(&mut self, r: Record, out: &mut Vec<Record>, stats: &FilterStats) {
        let start = window_start(r.ts, self.interval);
        let current = self.open.get(&r.key).map(|o| o.start);
        match current {
            Some(s) if start < s => {
                stats.late_records.fetch_add(1, Ordering::Relaxed);
            }
            Some(s) if start == s => {
                if let Some(o) = self.open.get_mut(&r.key) {
                    Downsample::add(&mut o.sums, &r);
                    o.last = r;
                }
            }
            _ => {
                let mut sums = Vec::new();
                Downsample::add(&mut sums, &r);
                let new = OpenInterval {
                    start,
                    last: r,
                    sums,
                };
                if let Some(closed) = self.open.insert(new.last.key.clone(), new) {
                    self.emit(closed, out);
                }
            }
        }
    }
}

#[derive(Clone, Copy)]
struct WindowState {
    start: i64,
    count: u64,
    min: f64,
    max: f64,
    sum: f64,
    last: f64,
}

struct Window {
    interval: i64,
    field: String,
    aggs: Vec<Agg>,
    names: Vec<String>,
    open: HashMap<String, WindowState>,
}

impl Window {
    fn emit(&self, key: String, w: WindowState, out: &mut Vec<Record>) {
        let fields = self
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
        out.push(Record {
            key,
            ts: w.start,
            fields,
        });
    }
}

impl Stage for Window {
    fn process(&mut self, r: Record, out: &mut Vec<Record>, stats: &FilterStats) {
        let Some(v) = numeric(&r, &self.field, stats) else {
            return;
        };
        let start = window_start(r.ts, self.interval);
        let fresh = WindowState {
            start,
            count: 1,
            min: v,
            max: v,
            sum: v,
            last: v,
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
}

struct Project(Vec<(String, Option<String>)>);

impl Stage for Project {
    fn process(&mut self, mut r: Record, out: &mut Vec<Record>, _stats: &FilterStats) {
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
