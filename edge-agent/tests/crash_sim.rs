//! Simulated power loss on `MemStorage`: seeded runs, each crashing the log at a random storage
//! operation, then recovering and checking promises 1 and 2 for the local log.
//!
//! Each run draws a config (fsync `Always` or `Interval`, tiny segments so rolls happen, small
//! blocks so batches split with `FLAG_BATCH_CONTINUES`) and a workload (1-3 producer threads,
//! random batch sizes, a few hundred records), and picks the operation at which power is lost.
//! Two crash cycles per run, so recovery of a recovered log is covered too; a quarter of the
//! cycles mint a new epoch first, and a fifth lose power again during recovery. After every
//! crash and reopen it checks, in every epoch:
//! - every acknowledged append is present, with identical content, at its acknowledged seqs;
//! - seqs run from 1 without holes other than recorded gap markers (a third of the runs have a
//!   disk budget of a few segments, so `drop-oldest` runs), no seq is both held and in a gap,
//!   and nothing appears twice;
//! - every recovered record is one a producer sent, and batches are all or nothing;
//! - the next append continues after the recovered tail and never reuses an acknowledged seq.
//!
//! A power cut leaves each file's unsynced suffix dropped, torn, scattered into data, zeros and
//! garbage, or with a later write persisted without an earlier one (`MemStorage::crash`). After
//! each crash, before recovery, the run looks for a hole followed by a valid frame in the
//! segments; recovery must find every such hole never durable: the checker fails on any
//! quarantined file or `Corrupt` gap marker, since power cuts alone never damage durable data.
//!
//! It counts where the crashes landed (block write, fsync, segment roll), what the crashes did to
//! unsynced suffixes, and how many left a hole followed by a valid frame; it prints the counts and
//! fails if any of them is zero. On failure it prints the seed; replay one with
//! `TRIBUTARY_CRASH_SEED=<seed> cargo test -p edge-agent --test crash_sim`. The seed fixes the
//! config, the workload and the crash point; thread interleaving is up to the scheduler.
//!
//! CI runs 1,000 runs split over four tests; `TRIBUTARY_SOAK=1` runs 10,000.
//!
//! Mutation checks: with the `fault-injection` feature (on for this crate's tests), a test turns
//! the batch-completeness rule off, and another the never-durable hole rule, and asserts that the
//! same checker then fails on some seed.

mod log_util;

use edge_agent::catalog::CatalogLocation;
use edge_agent::log::switches;
use edge_agent::log::{AppendAck, FsyncPolicy, Gap, GapReason, Log, LogConfig, LogHandle, OnFull};
use edge_agent::storage::{CrashInfo, CrashStats, MemStorage, OpKind, Storage};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::collections::{BTreeMap, HashMap};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use sync::{Record, Value};

const SHARDS: u64 = 4;
const CYCLES: u64 = 2;

#[derive(Default)]
struct Phases {
    block_write: AtomicU64,
    fsync: AtomicU64,
    roll: AtomicU64,
    other: AtomicU64,
    no_crash: AtomicU64,
    /// Crashes after which a segment held a hole followed by a valid frame.
    holes: AtomicU64,
    /// Holes that recovery judged never durable (its report).
    holes_never_durable: AtomicU64,
    /// What crashes did to unsynced suffixes, summed over runs.
    dropped: AtomicU64,
    torn: AtomicU64,
    scattered: AtomicU64,
    reordered: AtomicU64,
    zero_pieces: AtomicU64,
    garbage_pieces: AtomicU64,
}

impl Phases {
    fn count(&self, info: Option<&CrashInfo>) {
        let slot = match info {
            None => &self.no_crash,
            Some(i) => {
                let seg = i.path.extension().is_some_and(|x| x == "seg");
                match i.op {
                    OpKind::Create if seg => &self.roll,
                    OpKind::SyncDir => &self.roll,
                    OpKind::Append if seg && i.file_len < 16 => &self.roll,
                    OpKind::Append if seg => &self.block_write,
                    OpKind::Sync if seg && i.file_len <= 16 => &self.roll,
                    OpKind::Sync if seg => &self.fsync,
                    _ => &self.other,
                }
            }
        };
        slot.fetch_add(1, Ordering::Relaxed);
    }

    fn add_stats(&self, st: &CrashStats) {
        let add = |a: &AtomicU64, v: u64| a.fetch_add(v, Ordering::Relaxed);
        add(&self.dropped, st.dropped);
        add(&self.torn, st.torn);
        add(&self.scattered, st.scattered);
        add(&self.reordered, st.reordered);
        add(&self.zero_pieces, st.zero_pieces);
        add(&self.garbage_pieces, st.garbage_pieces);
    }

    fn report(&self, label: &str) -> [(&'static str, u64); 10] {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        println!(
            "{label}: crashes during block write {}, fsync {}, segment roll {}, other {}, no crash point reached {}",
            g(&self.block_write),
            g(&self.fsync),
            g(&self.roll),
            g(&self.other),
            g(&self.no_crash)
        );
        println!(
            "{label}: unsynced suffixes dropped {}, torn {}, scattered {}, reordered {} (pieces zeroed {}, garbage {}); crashes leaving a hole then a valid frame {}, holes recovery judged never durable {}",
            g(&self.dropped),
            g(&self.torn),
            g(&self.scattered),
            g(&self.reordered),
            g(&self.zero_pieces),
            g(&self.garbage_pieces),
            g(&self.holes),
            g(&self.holes_never_durable)
        );
        [
            ("crash during a block write", g(&self.block_write)),
            ("crash during an fsync", g(&self.fsync)),
            ("crash during a segment roll", g(&self.roll)),
            ("unsynced suffix dropped", g(&self.dropped)),
            ("unsynced suffix torn", g(&self.torn)),
            ("unsynced suffix scattered", g(&self.scattered)),
            (
                "later write persisted without an earlier one",
                g(&self.reordered),
            ),
            ("piece left as zeros", g(&self.zero_pieces)),
            ("crash leaving a hole then a valid frame", g(&self.holes)),
            ("hole judged never durable", g(&self.holes_never_durable)),
        ]
    }
}

fn runs_total() -> u64 {
    if std::env::var("TRIBUTARY_SOAK").is_ok_and(|v| v == "1") {
        10_000
    } else {
        1_000
    }
}

fn shard(k: u64) {
    let phases = Phases::default();
    let seeds: Vec<u64> = match std::env::var("TRIBUTARY_CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        Some(seed) if k == 0 => vec![seed],
        Some(_) => return,
        None => {
            let n = runs_total() / SHARDS;
            (k * n..(k + 1) * n).map(|i| 0x00C0_FFEE_0000 + i).collect()
        }
    };
    let single = seeds.len() == 1;
    for seed in seeds {
        let res = catch_unwind(AssertUnwindSafe(|| run_one(seed, &phases)));
        match res {
            Ok(Ok(())) => {}
            Ok(Err(e)) => panic!("crash_sim failed with seed {seed}: {e}"),
            Err(p) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()));
                panic!(
                    "crash_sim panicked with seed {seed}: {}",
                    msg.unwrap_or_default()
                );
            }
        }
    }
    let counts = phases.report(&format!("shard {k}"));
    if !single {
        for (name, c) in counts {
            assert!(
                c > 0,
                "no {name} in shard {k}: the simulation does not cover it"
            );
        }
    }
}

#[test]
fn crash_sim_shard_0() {
    shard(0);
}
#[test]
fn crash_sim_shard_1() {
    shard(1);
}
#[test]
fn crash_sim_shard_2() {
    shard(2);
}
#[test]
fn crash_sim_shard_3() {
    shard(3);
}

/// Runs seeds of shard 0 with a recovery rule switched off (on this thread only) and returns
/// the first seed the checker rejects, with its error, or `None` if all of `budget` passed.
fn first_failure_without(switch: fn(bool), budget: u64) -> Option<(u64, String)> {
    let phases = Phases::default();
    switch(false);
    let found = (0..budget).map(|i| 0x00C0_FFEE_0000 + i).find_map(|seed| {
        match catch_unwind(AssertUnwindSafe(|| run_one(seed, &phases))) {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some((seed, e)),
            Err(_) => Some((seed, "panicked".to_string())),
        }
    });
    switch(true);
    found
}

/// Mutation check: without the batch-completeness rule, recovery keeps fragments of batches
/// and the checker says so.
#[test]
fn checker_fails_without_the_batch_rule() {
    let found = first_failure_without(switches::set_batch_rule, 250);
    let (seed, err) = found.expect("with the batch rule off, no seed of 250 failed the checker");
    println!("batch rule off: seed {seed} fails: {err}");
    assert!(err.contains("partly stored"), "seed {seed}: {err}");
}

/// Mutation check: taking every hole followed by a valid frame for corruption (the rule before
/// sync marks) quarantines never-durable regions, and the checker says so.
#[test]
fn checker_fails_without_the_never_durable_hole_rule() {
    let found = first_failure_without(switches::set_hole_rule, 250);
    let (seed, err) = found.expect("with the hole rule off, no seed of 250 failed the checker");
    println!("hole rule off: seed {seed} fails: {err}");
    assert!(
        err.contains("must not look like corruption"),
        "seed {seed}: {err}"
    );
}

/// What producers sent and what was acknowledged, across cycles.
#[derive(Default)]
struct Ledger {
    /// Every record ever sent, by id.
    sent: HashMap<i64, Record>,
    /// Batch id -> size.
    batches: HashMap<i64, usize>,
    acked: Vec<(AppendAck, Vec<Record>)>,
}

fn config(rng: &mut SmallRng) -> LogConfig {
    let fsync = if rng.random_bool(0.5) {
        FsyncPolicy::Always
    } else {
        FsyncPolicy::Interval(Duration::from_micros(rng.random_range(100..1500)))
    };
    let segment_bytes_max = rng.random_range(1024..4096);
    // A third of the runs have a budget of a few segments, so drop-oldest runs (and crashes
    // land between writing a gap marker and deleting the segment).
    let disk_bytes_max = if rng.random_bool(0.35) {
        segment_bytes_max * rng.random_range(2..6)
    } else {
        1 << 30
    };
    LogConfig {
        data_dir: PathBuf::from("/data"),
        streams: vec!["s".into()],
        fsync,
        segment_bytes_max,
        disk_bytes_max,
        on_full: OnFull::DropOldest,
        block_records_max: rng.random_range(1..=24),
        block_bytes_max: rng.random_range(200..3000),
        block_linger: Duration::from_micros(rng.random_range(0..800)),
        zstd_level: 1,
        catalog: CatalogLocation::Memory,
        ..LogConfig::default()
    }
}

fn run_one(seed: u64, phases: &Phases) -> Result<(), String> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mem = MemStorage::with_seed(seed);
    let storage: Arc<dyn Storage> = Arc::new(mem.clone());
    let cfg = config(&mut rng);
    let (h, _) = Log::open(cfg.clone(), storage.clone()).map_err(|e| format!("first open: {e}"))?;
    let mut epochs = vec![h.epoch()];
    drop(h);
    let mut ledger = Ledger::default();
    for cycle in 0..CYCLES {
        let (h, _) = Log::open(cfg.clone(), storage.clone())
            .map_err(|e| format!("open before cycle {cycle}: {e}"))?;
        let window = rng.random_range(20..160);
        mem.set_crash_at(mem.ops() + rng.random_range(1..=window));
        // Sometimes start a new epoch first (as after a detected restore); power may go mid-mint.
        if rng.random_bool(0.25)
            && let Ok(e) = h.mint_epoch()
        {
            epochs.push(e);
        }
        produce(&h, &mut rng, cycle, &mut ledger);
        h.shutdown();
        drop(h);
        let info = mem.crash();
        phases.count(info.as_ref());
        if hole_then_valid(&mem) {
            phases.holes.fetch_add(1, Ordering::Relaxed);
        }
        // Sometimes lose power again while recovering.
        if rng.random_bool(0.2) {
            mem.set_crash_at(mem.ops() + rng.random_range(1..40));
            if let Ok((h, report)) = Log::open(cfg.clone(), storage.clone()) {
                phases
                    .holes_never_durable
                    .fetch_add(report.holes_never_durable, Ordering::Relaxed);
                h.shutdown();
            }
            mem.crash();
            if hole_then_valid(&mem) {
                phases.holes.fetch_add(1, Ordering::Relaxed);
            }
        }
        let (h, report) = Log::open(cfg.clone(), storage.clone())
            .map_err(|e| format!("reopen after crash: {e}"))?;
        phases
            .holes_never_durable
            .fetch_add(report.holes_never_durable, Ordering::Relaxed);
        let cur = h.epoch();
        if epochs.contains(&cur) && Some(&cur) != epochs.last() {
            return Err(format!("the epoch went back to {cur:x} after {epochs:x?}"));
        }
        if !epochs.contains(&cur) {
            // A mint whose answer was lost to the power cut but whose record was not.
            epochs.push(cur);
        }
        if !report.quarantined.is_empty() {
            return Err(format!(
                "a power cut must not look like corruption (nothing durable was damaged): {:?}",
                report.quarantined
            ));
        }
        verify(&h, &epochs, &mut ledger, cycle)?;
        h.shutdown();
    }
    phases.add_stats(&mem.crash_stats());
    Ok(())
}

/// True when a segment of the stream holds bytes that do not frame followed by a valid frame:
/// an earlier write of an unsynced group was lost while a later one persisted.
fn hole_then_valid(mem: &MemStorage) -> bool {
    let dir = Path::new("/data/streams/s");
    let names = mem.list(dir).unwrap_or_default();
    names.iter().filter(|n| n.ends_with(".seg")).any(|n| {
        let bytes = mem.contents(&dir.join(n)).unwrap_or_default();
        match sync::segment::scan(&bytes) {
            Ok(scan) => scan.fault.is_some_and(|(at, _)| {
                (at as usize + 1..bytes.len())
                    .any(|p| sync::segment::check_frame(&bytes, p).is_ok())
            }),
            Err(_) => false,
        }
    })
}

/// Runs 1-3 producer threads until each has sent its share or got an error.
fn produce(h: &LogHandle, rng: &mut SmallRng, cycle: u64, ledger: &mut Ledger) {
    let threads = rng.random_range(1..=3u64);
    let total: u64 = rng.random_range(120..320);
    let out = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for t in 0..threads {
            let seed = rng.random::<u64>();
            let out = &out;
            let h = h.clone();
            s.spawn(move || {
                let mut rng = SmallRng::seed_from_u64(seed);
                let mut sent = 0u64;
                let mut batch_no = 0i64;
                while sent < total / threads {
                    let n = if rng.random_bool(0.1) {
                        rng.random_range(20..60)
                    } else {
                        rng.random_range(1..12)
                    };
                    let batch_id = ((cycle as i64) << 40) | ((t as i64) << 32) | batch_no;
                    batch_no += 1;
                    let batch: Vec<Record> =
                        (0..n).map(|k| record(batch_id, k, n, &mut rng)).collect();
                    let res = h.append_blocking("s", batch.clone());
                    let failed = res.is_err();
                    out.lock().unwrap().push((batch_id, batch, res.ok()));
                    if failed {
                        return;
                    }
                    sent += n as u64;
                }
            });
        }
    });
    for (batch_id, batch, ack) in out.into_inner().unwrap() {
        ledger.batches.insert(batch_id, batch.len());
        for r in &batch {
            ledger.sent.insert(field_i64(r, "id"), r.clone());
        }
        if let Some(ack) = ack {
            ledger.acked.push((ack, batch));
        }
    }
}

fn record(batch_id: i64, k: usize, n: usize, rng: &mut SmallRng) -> Record {
    let id = (batch_id << 8) | k as i64;
    let pad = rng.random_range(0..80);
    Record {
        tags: Vec::new(),
        key: format!("truck-{}/engine", k % 3),
        ts: 1_764_374_400_000_000_000 + id,
        fields: vec![
            ("id".into(), Value::I64(id)),
            ("batch".into(), Value::I64(batch_id)),
            ("k".into(), Value::I64(k as i64)),
            ("n".into(), Value::I64(n as i64)),
            ("pad".into(), Value::Str(log_util::filler(id as u64, pad))),
        ],
    }
}

fn field_i64(r: &Record, name: &str) -> i64 {
    match r.field(name) {
        Some(Value::I64(v)) => *v,
        other => panic!("record lacks i64 field {name}: {other:?}"),
    }
}

fn verify(h: &LogHandle, epochs: &[u64], ledger: &mut Ledger, cycle: u64) -> Result<(), String> {
    let gaps = h.gaps("s");
    if let Some(g) = gaps
        .iter()
        .find(|g| g.reason != GapReason::Dropped || !epochs.contains(&g.epoch))
    {
        return Err(format!(
            "unexpected gap marker {g:?}: only the budget drops data here, and a power cut must not look like corruption"
        ));
    }
    let mut seen: HashMap<i64, (u64, u64)> = HashMap::new();
    for &epoch in epochs {
        let gaps: Vec<Gap> = gaps.iter().filter(|g| g.epoch == epoch).copied().collect();
        verify_epoch(h, epoch, &gaps, ledger, &mut seen)?;
    }
    // 4. The next append continues after the tail and never reuses an acknowledged seq.
    let epoch = h.epoch();
    let top = log_util::read_all(h, "s", epoch)
        .keys()
        .next_back()
        .copied()
        .unwrap_or(0);
    let gap_top = gaps
        .iter()
        .filter(|g| g.epoch == epoch)
        .map(|g| g.last_seq)
        .max()
        .unwrap_or(0);
    let acked_top = ledger
        .acked
        .iter()
        .filter(|(a, _)| a.epoch == epoch)
        .map(|(a, _)| a.last_seq)
        .max()
        .unwrap_or(0);
    let probe_id = ((cycle as i64) << 40) | (0xFF << 32);
    let probe = Record {
        tags: Vec::new(),
        key: "probe".into(),
        ts: 0,
        fields: vec![
            ("id".into(), Value::I64(probe_id)),
            ("batch".into(), Value::I64(probe_id)),
            ("k".into(), Value::I64(0)),
            ("n".into(), Value::I64(1)),
        ],
    };
    let ack = h
        .append_blocking("s", vec![probe.clone()])
        .map_err(|e| format!("append after recovery: {e}"))?;
    if ack.epoch != epoch || ack.first_seq != top.max(gap_top) + 1 || ack.first_seq <= acked_top {
        return Err(format!(
            "append after recovery got seq {}, tail {top}, gaps to {gap_top}, acked to {acked_top}",
            ack.first_seq
        ));
    }
    ledger.sent.insert(probe_id, probe.clone());
    ledger.batches.insert(probe_id, 1);
    ledger.acked.push((ack, vec![probe]));
    Ok(())
}

/// Checks 1-3 for one epoch; `seen` maps record ids to `(epoch, seq)` across epochs.
fn verify_epoch(
    h: &LogHandle,
    epoch: u64,
    gaps: &[Gap],
    ledger: &Ledger,
    seen: &mut HashMap<i64, (u64, u64)>,
) -> Result<(), String> {
    let held = log_util::read_all(h, "s", epoch);
    let in_gap = |s: u64| gaps.iter().any(|g| (g.first_seq..=g.last_seq).contains(&s));
    // 1. Every acknowledged record is present, identical, at its seq, unless the budget dropped
    //    it and said so.
    for (ack, batch) in ledger.acked.iter().filter(|(a, _)| a.epoch == epoch) {
        for (k, r) in batch.iter().enumerate() {
            let seq = ack.first_seq + k as u64;
            match held.get(&seq) {
                Some(got) if got == r => {}
                Some(got) => {
                    return Err(format!(
                        "acked seq {seq} holds different content: {got:?} != {r:?}"
                    ));
                }
                None if in_gap(seq) => {}
                None => {
                    let ranges = ranges_of(held.keys().copied());
                    return Err(format!(
                        "acked seq {seq} (batch {}..={}) of epoch {epoch:x} is missing; held {ranges:?}, gaps {gaps:?}",
                        ack.first_seq, ack.last_seq
                    ));
                }
            }
        }
    }
    // 2. No holes but gap markers, and no seq both held and marked as a gap.
    let top = held.keys().next_back().copied().unwrap_or(0);
    if let Some(s) = held.keys().find(|s| in_gap(**s)) {
        return Err(format!("seq {s} is held and also inside a gap marker"));
    }
    if let Some(s) = (1..=top).find(|s| !held.contains_key(s) && !in_gap(*s)) {
        return Err(format!(
            "seq {s} is missing without a gap marker (held up to {top}, gaps {gaps:?})"
        ));
    }
    // 3. Every record was sent, appears once, and batches are whole and in order.
    let mut per_batch: BTreeMap<i64, Vec<(u64, i64)>> = BTreeMap::new();
    for (seq, r) in &held {
        let id = field_i64(r, "id");
        if ledger.sent.get(&id) != Some(r) {
            return Err(format!("seq {seq} holds a record nobody sent: {r:?}"));
        }
        if let Some(prev) = seen.insert(id, (epoch, *seq)) {
            return Err(format!(
                "record {id} stored twice, at {prev:?} and ({epoch}, {seq})"
            ));
        }
        per_batch
            .entry(field_i64(r, "batch"))
            .or_default()
            .push((*seq, field_i64(r, "k")));
    }
    for (batch, recs) in &per_batch {
        let n = ledger.batches[batch];
        let base = recs[0].0 - recs[0].1 as u64;
        if recs.iter().any(|(seq, k)| *seq != base + *k as u64) {
            return Err(format!(
                "batch {batch} is not stored in order at consecutive seqs"
            ));
        }
        // Whole, or what is missing was dropped by the budget (a split batch can span segments).
        if let Some(k) =
            (0..n as u64).find(|k| !held.contains_key(&(base + k)) && !in_gap(base + k))
        {
            return Err(format!(
                "batch {batch} is partly stored: record {k} of {n} is missing without a gap"
            ));
        }
    }
    Ok(())
}

/// Compact `a..=b` runs of seqs, for failure messages.
fn ranges_of(seqs: impl Iterator<Item = u64>) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for s in seqs {
        match out.last_mut() {
            Some(r) if r.1 + 1 == s => r.1 = s,
            _ => out.push((s, s)),
        }
    }
    out
}
