//! Simulated power loss under the hub's tier-1 WAL: seeded runs on `MemStorage`, each
//! crashing the log several times while devices append through group commit.
//!
//! Producers follow ingest's contract with the WAL: a lane's block is queued under the lane's
//! lock, and only while no earlier block of the lane has failed (the failure's callback takes
//! the same lock), which is what lets the writer fail every dependent request after a failure.
//!
//! Each run draws a small config (segments of a few KiB so files roll, a linger of 0-200 µs so
//! groups hold one or several requests) and, per cycle, one fault: a power cut at a random
//! storage operation, an EIO on one operation kind, ENOSPC from a capacity just above what
//! the files hold (the group is cut off, the writer refuses writes, then resumes once space is
//! back), or a catalog commit failing as SQLite does on a full disk (the writer rewinds to the
//! committed end). A sixth of the cycles lose power again during the recovery that follows.
//! Every cycle ends in a power cut in a random `CrashMode` (unsynced bytes dropped, torn, left
//! as zeros, or any subset in any order) and a reopen. Three to five cycles per run.
//!
//! The catalog is SQLite on real files (`/dev/shm` where it exists) and is not cut: with
//! `synchronous=FULL` a committed transaction survives and an uncommitted one does not, which
//! the simulated process (it never dies) gives for free. The WAL is what the power cut hits.
//!
//! After every reopen the checker asserts, from the catalog and the recovered WAL:
//! - the acknowledged blocks of every lane are exactly the catalog's blocks of that lane: each
//!   acknowledged block is present once, nothing unacknowledged is in the index, and each
//!   lane's mark is its last acknowledged seq;
//! - every indexed frame reads back from the WAL, verified, with the header and the bytes that
//!   were sent, at the hub offset its acknowledgement named;
//! - hub offsets of a stream run from 0 without holes, and the committed WAL end and each
//!   stream's next offset never move back across crashes.
//!
//! It counts the faults per phase (block write, fsync, roll, recovery, rewind or full disk),
//! prints the counts, and fails if a phase got none. On failure it prints the seed; replay one
//! with `TRIBUTARY_CRASH_SEED=<seed> cargo test -p core-hub --test crash_sim`. The seed fixes
//! the config, the workload and the faults; thread interleaving (how requests fall into
//! groups) is up to the scheduler.
//!
//! CI runs 1,000 runs over four tests; `TRIBUTARY_SOAK=1` runs 10,000.
//!
//! Mutation checks (feature `fault-injection`, on for this crate's tests): with the WAL
//! directory fsync after a roll left out, or the file fsync before the catalog commit left
//! out, the same checker fails on some seed. The bug this simulation found (after a full disk cut
//! files off, a removed file came back after the crash and shadowed committed data) is
//! replayed step by step in its own test, which also fails with the fix switched off
//! (`Mutation::SkipCutDirSync`).

use core_hub::catalog::{Catalog, DeviceId, StreamId};
use core_hub::storage::{CrashInfo, CrashMode, Fault, FaultError, MemStorage, OpKind};
use core_hub::streams::BlockHashes;
use core_hub::wal::{
    self, AppendDone, AppendRequest, CommitError, FaultPoint, Mutation, WAL_HEADER_LEN, WalEnv,
    WalHandle, WalReader, WalTuning, WriterConfig,
};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const SHARDS: u64 = 4;
const DEVICES: u32 = 3;
const STREAMS: u32 = 2;
const EPOCH: u64 = 1;
/// How long any completion or state change may take before the run counts as hung.
const DEADLINE: Duration = Duration::from_secs(20);

/// Faults that landed, by phase.
#[derive(Default)]
struct Phases {
    write: AtomicU64,
    fsync: AtomicU64,
    roll: AtomicU64,
    recovery: AtomicU64,
    rewind_or_full: AtomicU64,
    power_cuts: AtomicU64,
    acked: AtomicU64,
}

impl Phases {
    fn report(&self, name: &str) -> Vec<(&'static str, u64)> {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let counts = vec![
            ("block write faults", g(&self.write)),
            ("fsync faults", g(&self.fsync)),
            ("roll faults", g(&self.roll)),
            ("recovery faults", g(&self.recovery)),
            ("rewind or disk-full faults", g(&self.rewind_or_full)),
            ("power cuts", g(&self.power_cuts)),
            ("acknowledged blocks", g(&self.acked)),
        ];
        let line: Vec<String> = counts.iter().map(|(n, c)| format!("{n}: {c}")).collect();
        println!("crash_sim {name}: {}", line.join(", "));
        counts
    }

    /// Where a power cut at `c` landed (outside recovery).
    fn count_cut(&self, c: &CrashInfo) {
        let phase = match c.op {
            OpKind::Create | OpKind::SyncDir => &self.roll,
            OpKind::Append | OpKind::WriteAt if c.file_len == 0 => &self.roll,
            OpKind::Sync if c.file_len <= WAL_HEADER_LEN as u64 => &self.roll,
            OpKind::Append | OpKind::WriteAt => &self.write,
            OpKind::Sync => &self.fsync,
            OpKind::Truncate | OpKind::Remove | OpKind::Open | OpKind::Rename => {
                &self.rewind_or_full
            }
            OpKind::CreateDir => &self.recovery,
        };
        phase.fetch_add(1, Ordering::Relaxed);
    }
}

/// One acknowledged block, as the producer keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Acked {
    first_seq: u64,
    count: u32,
    checksum: u64,
    hub_offset_base: u64,
    block: Vec<u8>,
}

/// What the producers know: per lane, the acknowledged blocks in seq order.
#[derive(Default)]
struct Model {
    lanes: BTreeMap<(DeviceId, StreamId), Vec<Acked>>,
    committed_end: u64,
    next_offsets: BTreeMap<StreamId, u64>,
}

impl Model {
    fn next_seq(&self, lane: (DeviceId, StreamId)) -> u64 {
        self.lanes
            .get(&lane)
            .and_then(|v| v.last())
            .map_or(1, |a| a.first_seq + u64::from(a.count))
    }
}

/// The fault a cycle injects before its closing power cut.
#[derive(Debug, Clone, Copy)]
enum Plan {
    /// Power is lost at the `k`-th storage operation from now.
    CutAt(u64),
    /// One operation of this kind fails with EIO, after `skip` pass.
    Eio(OpKind, u64),
    /// The files may grow by this many bytes, then appends fail with ENOSPC.
    Capacity(u64),
    /// The `n`-th catalog commit from now fails as on a full disk.
    CatalogFull(u64),
}

/// The knobs of one run.
struct Sim {
    rng: SmallRng,
    mem: MemStorage,
    dir: PathBuf,
    catalog_path: PathBuf,
    _tmp: tempfile::TempDir,
    segment_bytes_max: u64,
    linger: Duration,
    mutation: Mutation,
    model: Model,
    devices: Vec<DeviceId>,
    streams: Vec<StreamId>,
}

fn tuning(mutation: Mutation) -> WalTuning {
    WalTuning {
        writer_tick: Duration::from_millis(1),
        idle_flush: Duration::from_millis(20),
        disk_full_backoff_initial: Duration::from_micros(200),
        disk_full_backoff_max: Duration::from_millis(2),
        disk_full_resume_free_bytes: 0,
        mutation,
    }
}

fn scratch() -> tempfile::TempDir {
    let shm = Path::new("/dev/shm");
    if shm.is_dir()
        && let Ok(t) = tempfile::tempdir_in(shm)
    {
        return t;
    }
    tempfile::tempdir().expect("temp dir")
}

/// A running WAL and what the cycle needs to drive it.
struct Running {
    wal: WalHandle,
    join: std::thread::JoinHandle<()>,
    catalog_full_at: Arc<AtomicU64>,
    catalog_commits: Arc<AtomicU64>,
}

impl Sim {
    fn new(seed: u64, mutation: Mutation) -> Sim {
        let mut rng = SmallRng::seed_from_u64(seed);
        let tmp = scratch();
        let catalog_path = tmp.path().join("catalog.sqlite");
        let segment_bytes_max = rng.random_range(1_500..6_000);
        let linger = Duration::from_micros(rng.random_range(0..200));
        Sim {
            mem: MemStorage::with_seed(seed ^ 0x5EED),
            rng,
            dir: PathBuf::from("/hub/wal"),
            catalog_path,
            _tmp: tmp,
            segment_bytes_max,
            linger,
            mutation,
            model: Model::default(),
            devices: Vec::new(),
            streams: Vec::new(),
        }
    }

    fn catalog(&mut self) -> Result<Arc<Catalog>, String> {
        let c = Catalog::open(&self.catalog_path).map_err(|e| format!("catalog: {e}"))?;
        if self.devices.is_empty() {
            for d in 0..DEVICES {
                self.devices
                    .push(c.intern_device(&format!("dev-{d}")).unwrap());
            }
            for s in 0..STREAMS {
                self.streams
                    .push(c.intern_stream(&format!("stream-{s}")).unwrap());
            }
        }
        Ok(Arc::new(c))
    }

    /// Opens the WAL (recovery), losing power during it in some cycles.
    fn open(&mut self, phases: &Phases) -> Result<Running, String> {
        if self.rng.random_ratio(1, 6) {
            let k = self.rng.random_range(1..=6);
            self.mem.set_crash_at(self.mem.ops() + k);
            let attempt = self.start();
            let cut = self.mem.crash_info().is_some();
            if cut {
                phases.recovery.fetch_add(1, Ordering::Relaxed);
                if let Ok(r) = attempt {
                    stop(r);
                }
                let mode = self.mode();
                self.mem.crash(mode);
            } else {
                self.mem.disarm();
                return attempt.map_err(|e| format!("open failed: {e}"));
            }
        }
        self.start().map_err(|e| format!("open failed: {e}"))
    }

    fn start(&mut self) -> Result<Running, String> {
        let catalog = self.catalog()?;
        let offsets = catalog
            .streams()
            .map_err(|e| e.to_string())?
            .into_iter()
            .map(|s| (s.id, s.next_offset))
            .collect();
        let catalog_full_at = Arc::new(AtomicU64::new(0));
        let catalog_commits = Arc::new(AtomicU64::new(0));
        let hook = {
            let (at, n) = (catalog_full_at.clone(), catalog_commits.clone());
            Arc::new(move |p: FaultPoint| {
                p == FaultPoint::CatalogNoSpace && {
                    let i = n.fetch_add(1, Ordering::Relaxed) + 1;
                    at.load(Ordering::Relaxed) == i
                }
            })
        };
        let cfg = WriterConfig {
            segment_bytes_max: self.segment_bytes_max,
            group_commit_linger: self.linger,
            faults: Some(hook),
            on_commit: None,
        };
        let env = WalEnv {
            storage: Arc::new(self.mem.clone()),
            tuning: tuning(self.mutation),
        };
        let (wal, join) =
            wal::start_with(env, &self.dir, catalog, offsets, cfg).map_err(|e| e.to_string())?;
        Ok(Running {
            wal,
            join,
            catalog_full_at,
            catalog_commits,
        })
    }

    fn mode(&mut self) -> CrashMode {
        CrashMode::ALL[self.rng.random_range(0..CrashMode::ALL.len())]
    }

    fn plan(&mut self) -> Plan {
        match self.rng.random_range(0..8) {
            0..=3 => Plan::CutAt(self.rng.random_range(1..=80)),
            4 => {
                let kinds = [
                    OpKind::Append,
                    OpKind::Sync,
                    OpKind::Create,
                    OpKind::SyncDir,
                ];
                let kind = kinds[self.rng.random_range(0..kinds.len())];
                Plan::Eio(kind, self.rng.random_range(0..6))
            }
            5 | 6 => Plan::Capacity(self.rng.random_range(0..3_000)),
            _ => Plan::CatalogFull(self.rng.random_range(1..=4)),
        }
    }

    fn arm(&mut self, plan: Plan, run: &Running) {
        match plan {
            Plan::CutAt(k) => self.mem.set_crash_at(self.mem.ops() + k),
            Plan::Eio(op, skip) => self.mem.inject(Fault {
                skip,
                ..Fault::on(op, FaultError::Eio)
            }),
            Plan::Capacity(extra) => self.mem.set_capacity(Some(self.mem.used_bytes() + extra)),
            Plan::CatalogFull(n) => {
                let now = run.catalog_commits.load(Ordering::Relaxed);
                run.catalog_full_at.store(now + n, Ordering::Relaxed);
            }
        }
    }

    /// A few rounds of appends from random lanes, each waiting for its acknowledgements.
    fn ingest(&mut self, run: &Running, plan: Plan, phases: &Phases) -> Result<(), String> {
        let rounds = self.rng.random_range(3..10);
        for _ in 0..rounds {
            self.round(&run.wal)?;
            let stats = run.wal.stats();
            if self.mem.crash_info().is_some() || stats.poisoned.load(Ordering::Acquire) {
                return Ok(());
            }
            if let Plan::Capacity(_) = plan
                && stats.disk_full().is_some()
            {
                // Space comes back: the writer's probe must resume writes on its own.
                self.mem.set_capacity(None);
                phases.rewind_or_full.fetch_add(1, Ordering::Relaxed);
            }
            wait_until(
                || stats.disk_full().is_none(),
                "writes resume after a full disk",
            )?;
        }
        Ok(())
    }

    /// One burst: a few lanes send one to three consecutive blocks each, all queued before
    /// any completes; then every outcome is folded into the model.
    fn round(&mut self, wal: &WalHandle) -> Result<(), String> {
        let (tx, rx) = mpsc::channel();
        let mut sent: BTreeMap<(DeviceId, StreamId), Vec<(AppendRequestInfo, usize)>> =
            BTreeMap::new();
        let mut n = 0;
        for _ in 0..self.rng.random_range(1..=5) {
            let lane = (
                self.devices[self.rng.random_range(0..self.devices.len())],
                self.streams[self.rng.random_range(0..self.streams.len())],
            );
            if sent.contains_key(&lane) {
                continue;
            }
            let mut seq = self.model.next_seq(lane);
            let blocks: Vec<AppendRequestInfo> = (0..self.rng.random_range(1..=3))
                .map(|_| {
                    let info = self.block(lane, seq);
                    seq += u64::from(info.count);
                    info
                })
                .collect();
            // As ingest does: a lane's block is queued under the lane's lock, and only while
            // no earlier block of the lane has failed (a failure's callback takes the lock).
            let failed = Arc::new(Mutex::new(false));
            let mut infos = Vec::new();
            for info in blocks {
                let lane_lock = failed.lock().expect("lane lock");
                if *lane_lock {
                    break;
                }
                let (tx, idx, f) = (tx.clone(), n, failed.clone());
                let req = info.request(Box::new(move |r| {
                    if r.is_err() {
                        *f.lock().expect("lane lock") = true;
                    }
                    let _ = tx.send((idx, r));
                }));
                if let Err(req) = wal.try_append(req) {
                    drop(lane_lock);
                    (req.done)(Err(CommitError::Stopped));
                }
                infos.push((info, idx));
                n += 1;
            }
            sent.insert(lane, infos);
        }
        drop(tx);
        let mut results: BTreeMap<usize, Result<AppendDone, CommitError>> = BTreeMap::new();
        let deadline = Instant::now() + DEADLINE;
        while results.len() < n {
            let left = deadline.saturating_duration_since(Instant::now());
            let (i, r) = rx
                .recv_timeout(left)
                .map_err(|_| "an append never completed")?;
            results.insert(i, r);
        }
        for (lane, infos) in sent {
            self.fold(lane, infos, &mut results)?;
        }
        Ok(())
    }

    /// Adds a lane's acknowledged blocks to the model. Within a lane, a block after a failed
    /// one must fail too: acknowledging it would leave a hole.
    fn fold(
        &mut self,
        lane: (DeviceId, StreamId),
        infos: Vec<(AppendRequestInfo, usize)>,
        results: &mut BTreeMap<usize, Result<AppendDone, CommitError>>,
    ) -> Result<(), String> {
        let mut failed = None;
        for (info, idx) in infos {
            match results.remove(&idx).expect("every append completed") {
                Ok(done) => {
                    if let Some(e) = &failed {
                        return Err(format!(
                            "lane {lane:?}: seq {} acknowledged after an earlier block failed ({e})",
                            info.first_seq
                        ));
                    }
                    if done.last_seq != info.first_seq + u64::from(info.count) - 1 {
                        return Err(format!(
                            "lane {lane:?}: ack names last seq {}",
                            done.last_seq
                        ));
                    }
                    self.model.lanes.entry(lane).or_default().push(Acked {
                        first_seq: info.first_seq,
                        count: info.count,
                        checksum: info.checksum,
                        hub_offset_base: done.hub_offset_base,
                        block: info.block,
                    });
                }
                Err(e) => failed = failed.or(Some(e)),
            }
        }
        Ok(())
    }

    /// A block for `lane` starting at `seq`, with content derived from the seed.
    fn block(&mut self, lane: (DeviceId, StreamId), seq: u64) -> AppendRequestInfo {
        let count = self.rng.random_range(1..=20);
        let len = self.rng.random_range(16..400);
        let mut block = vec![0u8; len];
        self.rng.fill(&mut block[..]);
        let checksum = xxhash_like(&block);
        AppendRequestInfo {
            device: lane.0,
            stream: lane.1,
            first_seq: seq,
            count,
            checksum,
            block,
        }
    }
}

/// The parts of an append the model keeps.
#[derive(Debug, Clone)]
struct AppendRequestInfo {
    device: DeviceId,
    stream: StreamId,
    first_seq: u64,
    count: u32,
    checksum: u64,
    block: Vec<u8>,
}

impl AppendRequestInfo {
    fn request(&self, done: wal::Completion<AppendDone>) -> AppendRequest {
        AppendRequest {
            device: self.device,
            stream: self.stream,
            epoch: EPOCH,
            first_seq: self.first_seq,
            count: self.count,
            checksum: self.checksum,
            min_ts: 0,
            max_ts: 0,
            block: self.block.clone(),
            key_hashes: BlockHashes::default(),
            done,
        }
    }
}

/// A content checksum for the entry header (the WAL only stores it).
fn xxhash_like(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| {
        (h ^ u64::from(x)).wrapping_mul(0x100_0000_01b3)
    })
}

fn wait_until(mut cond: impl FnMut() -> bool, what: &str) -> Result<(), String> {
    let deadline = Instant::now() + DEADLINE;
    while !cond() {
        if Instant::now() >= deadline {
            return Err(format!("timed out waiting until {what}"));
        }
        std::thread::yield_now();
    }
    Ok(())
}

fn stop(run: Running) {
    run.wal.stop();
    drop(run.wal);
    run.join.join().expect("the WAL writer panicked");
}

/// Checks the reopened log against the model (see the module doc for the rules).
fn check(sim: &mut Sim) -> Result<(), String> {
    let catalog = Catalog::open(&sim.catalog_path).map_err(|e| e.to_string())?;
    let end = catalog.wal_committed_end().map_err(|e| e.to_string())?;
    if end < sim.model.committed_end {
        return Err(format!(
            "committed end moved back: {} -> {end}",
            sim.model.committed_end
        ));
    }
    sim.model.committed_end = end;
    let reader = WalReader::with_storage(Arc::new(sim.mem.clone()), &sim.dir);
    for stream in sim.streams.clone() {
        check_stream(sim, &catalog, &reader, stream)?;
    }
    let marks = catalog.all_marks().map_err(|e| e.to_string())?;
    for m in marks {
        let want = sim.model.next_seq((m.device, m.stream)) - 1;
        if m.epoch != EPOCH || m.durable_seq != want {
            return Err(format!(
                "mark of {:?} is {}, acknowledged {want}",
                (m.device, m.stream),
                m.durable_seq
            ));
        }
    }
    Ok(())
}

fn check_stream(
    sim: &mut Sim,
    catalog: &Catalog,
    reader: &WalReader,
    stream: StreamId,
) -> Result<(), String> {
    let rows = catalog
        .blocks_from(stream, 0, usize::MAX)
        .map_err(|e| e.to_string())?;
    let mut offset = 0;
    let mut lanes: BTreeMap<DeviceId, Vec<Acked>> = BTreeMap::new();
    for row in &rows {
        if row.hub_offset_base != offset {
            return Err(format!(
                "stream {stream}: offset {} where {offset} was next",
                row.hub_offset_base
            ));
        }
        let count = row.last_seq - row.first_seq + 1;
        offset += count;
        let (h, block) = reader
            .read(row)
            .map_err(|e| format!("stream {stream}: indexed frame unreadable: {e}"))?;
        let same = h.device == row.device
            && h.stream == stream
            && h.first_seq == row.first_seq
            && u64::from(h.count) == count
            && h.hub_offset_base == row.hub_offset_base
            && h.checksum == row.checksum;
        if !same {
            return Err(format!(
                "stream {stream}: frame header {h:?} differs from its row {row:?}"
            ));
        }
        lanes.entry(row.device).or_default().push(Acked {
            first_seq: row.first_seq,
            count: count as u32,
            checksum: row.checksum,
            hub_offset_base: row.hub_offset_base,
            block,
        });
    }
    for &device in &sim.devices {
        let mut got = lanes.remove(&device).unwrap_or_default();
        got.sort_by_key(|a| a.first_seq);
        let want = sim
            .model
            .lanes
            .get(&(device, stream))
            .cloned()
            .unwrap_or_default();
        if got != want {
            return Err(format!(
                "lane ({device}, {stream}): the catalog holds {} blocks {:?}, acknowledged {} {:?}",
                got.len(),
                got.iter().map(|a| a.first_seq).collect::<Vec<_>>(),
                want.len(),
                want.iter().map(|a| a.first_seq).collect::<Vec<_>>()
            ));
        }
    }
    let next = catalog
        .streams()
        .map_err(|e| e.to_string())?
        .into_iter()
        .find(|s| s.id == stream)
        .map_or(0, |s| s.next_offset);
    let before = sim.model.next_offsets.insert(stream, next).unwrap_or(0);
    if next != offset || next < before {
        return Err(format!(
            "stream {stream}: next offset {next}, blocks end at {offset}, was {before}"
        ));
    }
    Ok(())
}

/// One seeded run: several cycles of ingest, fault, power cut, recovery and check.
fn run_one(seed: u64, mutation: Mutation, phases: &Phases) -> Result<(), String> {
    let mut sim = Sim::new(seed, mutation);
    let cycles = sim.rng.random_range(3..=5);
    for _ in 0..cycles {
        let run = sim.open(phases)?;
        check(&mut sim)?;
        let plan = sim.plan();
        let fired_before = sim.mem.faults_fired();
        sim.arm(plan, &run);
        sim.ingest(&run, plan, phases)?;
        let full = run.wal.stats().disk_full_failures.load(Ordering::Relaxed);
        stop(run);
        count_plan(
            &sim,
            plan,
            sim.mem.faults_fired() - fired_before,
            full,
            phases,
        );
        sim.mem.clear_faults();
        sim.mem.set_capacity(None);
        let mode = sim.mode();
        if let Some(c) = sim.mem.crash(mode) {
            phases.count_cut(&c);
        }
        phases.power_cuts.fetch_add(1, Ordering::Relaxed);
    }
    sim.open(phases).map(stop)?;
    check(&mut sim)?;
    let acked: usize = sim.model.lanes.values().map(Vec::len).sum();
    phases.acked.fetch_add(acked as u64, Ordering::Relaxed);
    Ok(())
}

fn count_plan(_sim: &Sim, plan: Plan, fired: u64, disk_full_failures: u64, phases: &Phases) {
    match plan {
        Plan::CutAt(_) => {}
        Plan::Eio(op, _) if fired > 0 => {
            let phase = match op {
                OpKind::Append => &phases.write,
                OpKind::Sync => &phases.fsync,
                _ => &phases.roll,
            };
            phase.fetch_add(fired, Ordering::Relaxed);
        }
        Plan::Eio(..) => {}
        Plan::Capacity(_) | Plan::CatalogFull(_) => {
            phases
                .rewind_or_full
                .fetch_add(disk_full_failures, Ordering::Relaxed);
        }
    }
}

fn runs_total() -> u64 {
    if std::env::var("TRIBUTARY_SOAK").is_ok_and(|v| v == "1") {
        10_000
    } else {
        1_000
    }
}

fn seed_of(i: u64) -> u64 {
    0x00AB_0000_0000 + i
}

/// Runs `seed`, turning a panic into an error naming it.
fn run_caught(seed: u64, mutation: Mutation, phases: &Phases) -> Result<(), String> {
    match catch_unwind(AssertUnwindSafe(|| run_one(seed, mutation, phases))) {
        Ok(r) => r,
        Err(p) => Err(p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "panic".into())),
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
            (k * n..(k + 1) * n).map(seed_of).collect()
        }
    };
    let single = seeds.len() == 1;
    for seed in seeds {
        if let Err(e) = run_caught(seed, Mutation::None, &phases) {
            panic!(
                "crash_sim failed with seed {seed}: {e}\n\
                 replay: TRIBUTARY_CRASH_SEED={seed} cargo test -p core-hub --test crash_sim"
            );
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

/// With `mutation` on, some of the first `seeds` runs must fail the checker.
fn mutation_is_caught(mutation: Mutation, seeds: u64) {
    let phases = Phases::default();
    let caught: Vec<(u64, String)> = (0..seeds)
        .map(seed_of)
        .filter_map(|seed| run_caught(seed, mutation, &phases).err().map(|e| (seed, e)))
        .collect();
    println!(
        "crash_sim mutation {mutation:?}: {} of {seeds} runs failed the checker; first: {:?}",
        caught.len(),
        caught.first()
    );
    assert!(
        !caught.is_empty(),
        "{mutation:?} went unnoticed in {seeds} runs"
    );
}

#[test]
fn skipping_the_directory_fsync_after_a_roll_is_caught() {
    mutation_is_caught(Mutation::SkipRollDirSync, 200);
}

#[test]
fn skipping_the_fsync_before_the_catalog_commit_is_caught() {
    mutation_is_caught(Mutation::SkipCommitSync, 200);
}

/// The bug the simulation found, replayed step by step: a group rolls into a new file and
/// fails there for a full disk; the new file is removed and the old one cut back; a larger
/// block then commits in the old file past where the removed file started. After a power cut,
/// the removed file must stay removed, or recovery takes it for the file holding the
/// committed end.
fn cut_off_file_after_a_crash(mutation: Mutation) -> Result<(), String> {
    let mut sim = Sim::new(7, mutation);
    sim.segment_bytes_max = 1_000;
    sim.linger = Duration::from_millis(50);
    let run = sim.start()?;
    let lane = (sim.devices[0], sim.streams[0]);
    let mut seq = 1;
    let mut send = |lens: &[usize]| {
        let (tx, rx) = mpsc::channel();
        for &len in lens {
            let info = AppendRequestInfo {
                device: lane.0,
                stream: lane.1,
                first_seq: seq,
                count: 1,
                checksum: seq,
                block: vec![seq as u8; len],
            };
            seq += 1;
            let tx = tx.clone();
            run.wal.append(info.request(Box::new(move |r| {
                let _ = tx.send(r);
            })));
        }
        let acks: Vec<_> = (0..lens.len())
            .map(|_| rx.recv_timeout(DEADLINE).expect("completed"))
            .collect();
        acks
    };
    // Frames of 600, then 100 + 400 bytes in one group: the 400 rolls into a new file at
    // logical offset 700 and finds the disk full there.
    assert!(send(&[536])[0].is_ok());
    sim.mem
        .set_capacity(Some(sim.mem.used_bytes() + 100 + 16 + 10));
    let failed = send(&[36, 336]);
    assert!(failed.iter().all(Result::is_err), "{failed:?}");
    sim.mem.set_capacity(None);
    let stats = run.wal.stats().clone();
    wait_until(|| stats.disk_full().is_none(), "writes resume")?;
    // A 300-byte frame fits the old file and commits past offset 700.
    let ok = send(&[236]);
    assert!(ok[0].is_ok(), "{ok:?}");
    stop(run);
    sim.mem.crash(CrashMode::Drop);
    stop(sim.start()?);
    Ok(())
}

#[test]
fn a_file_cut_off_after_a_full_disk_stays_removed_after_a_crash() {
    cut_off_file_after_a_crash(Mutation::None).unwrap();
    let err = cut_off_file_after_a_crash(Mutation::SkipCutDirSync)
        .expect_err("with the directory fsync left out, the removed file comes back");
    println!("with SkipCutDirSync: {err}");
    assert!(
        err.contains("open failed") || err.contains("WAL holds"),
        "{err}"
    );
}
