//! Simulated power loss under the whole hub: tier 1, tiering, eviction and the tier-2 scrub,
//! on `MemStorage`. Seeded runs, each crashing the hub several times.
//!
//! The hub is opened with `Hub::open_on` on one `MemStorage` that holds its WAL and its
//! `file://` tier 2 (`core_hub::storage::StorageStore`); the catalog is SQLite on real files
//! (`/dev/shm` where it exists) and is not cut, as in `crash_sim.rs`: with `synchronous=FULL`
//! a committed transaction survives and an uncommitted one does not.
//!
//! A cycle:
//! 1. **block commit**: three devices commit blocks through the hub (group commit), each from
//!    the mark the hub holds for it, each keeping what was acknowledged;
//! 2. **tiering**: rounds (plan, chunk upload, manifest, commit, eviction) until one does
//!    nothing; tier-1 retention is zero, so every tiered WAL file but the active one goes;
//! 3. **scrub**: a committed chunk that tier 1 still holds gets a flipped byte (bit rot), and
//!    a full tier-2 scrub pass quarantines it, moves it aside and repairs it from tier 1;
//! 4. a power cut in a random `CrashMode`, then **recovery**: `Hub::open_on`, `Tiering::open`
//!    (which finishes evictions), the start-up tier-2 scrub of the recent chunks and a full
//!    pass (tending the quarantine a crash left behind).
//!
//! Each cycle also arms a power cut at a random storage operation of one of these phases (the
//! operation fails and so does every later one until the cut). Where it lands is counted by
//! phase: block commit, chunk upload, manifest, eviction, scrub/repair, recovery. The tiering
//! commit itself is a catalog transaction with no storage operation: a cut at the manifest's
//! last sync is a cut before it, one at the first eviction operation a cut after it. A cut in
//! recovery is followed by another power cut and a clean recovery.
//!
//! After every recovery the checker reads the stream back through the hub's own read path
//! across both tiers (`TierReader`: tier-2 chunks below the tier-1 start, then the WAL) and
//! asserts: each device's acknowledged records are there exactly once, in seq order, with
//! their content, at dense offsets from 0, and nothing else is (nothing unacknowledged); no
//! chunk was skipped as damaged; each device's durable mark is its last acknowledged seq. It
//! also decodes every Parquet file SQL engines would glob (`streams/`): each record at most
//! once, and only acknowledged ones.
//!
//! It prints the faults that landed per phase and fails if a phase got none. On failure it
//! prints the seed; replay with
//! `TRIBUTARY_CRASH_SEED=<seed> cargo test -p core-hub --test crash_sim_tier`. The seed fixes
//! the config, the workload and the cut points; thread interleaving is the scheduler's.
//!
//! CI runs 1,000 seeds (docs/reliability.md has the time); `TRIBUTARY_SOAK=1` runs 10,000.
//!
//! Mutation checks (feature `fault-injection`): with the tier-2 object's file sync, or its
//! directory syncs, left out of the storage-backed store (the `SyncProbe` switches), the same
//! checker fails on some seed.

mod common;

use core_hub::Hub;
use core_hub::config::HubConfig;
use core_hub::scrub::{Tier2ScrubConfig, scrub_tier2, scrub_tier2_recent};
use core_hub::storage::{CrashInfo, CrashMode, MemStorage, OpKind, Storage};
use core_hub::tiering::read::TierReader;
use core_hub::tiering::{TierFaultHook, TierFaultPoint, Tiering, store};
use core_hub::wal::{WalEnv, WalTuning};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::collections::{BTreeMap, BTreeSet};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const STREAM: &str = "telemetry";
const DEVICES: usize = 3;
const EPOCH: u64 = 1;
const SHARDS: u64 = 4;

/// Where a power cut landed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Phase {
    BlockCommit,
    ChunkUpload,
    Manifest,
    Eviction,
    Scrub,
    Recovery,
}

const PHASES: [Phase; 6] = [
    Phase::BlockCommit,
    Phase::ChunkUpload,
    Phase::Manifest,
    Phase::Eviction,
    Phase::Scrub,
    Phase::Recovery,
];

/// What the test is doing when a cut is armed: tiering's steps are told apart by the path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Ingest,
    Tiering,
    Scrub,
    Recovery,
}

const STEPS: [Step; 4] = [Step::Ingest, Step::Tiering, Step::Scrub, Step::Recovery];

/// Counts over a shard of runs.
#[derive(Default)]
struct Counts {
    landed: [AtomicU64; PHASES.len()],
    power_cuts: AtomicU64,
    acked_records: AtomicU64,
    tier2_reads: AtomicU64,
    repairs: AtomicU64,
}

impl Counts {
    fn land(&self, p: Phase) {
        self.landed[p as usize].fetch_add(1, Ordering::Relaxed);
    }

    fn report(&self, name: &str) -> Vec<(String, u64)> {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut out: Vec<(String, u64)> = PHASES
            .iter()
            .map(|p| (format!("{p:?} cuts"), g(&self.landed[*p as usize])))
            .collect();
        out.push(("power cuts".into(), g(&self.power_cuts)));
        out.push(("acknowledged records".into(), g(&self.acked_records)));
        out.push(("records read from tier 2".into(), g(&self.tier2_reads)));
        out.push(("chunks repaired from tier 1".into(), g(&self.repairs)));
        let line: Vec<String> = out.iter().map(|(n, c)| format!("{n}: {c}")).collect();
        println!("crash_sim_tier {name}: {}", line.join(", "));
        out
    }
}

/// A durability step of the tier-2 store left out on purpose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mutation {
    None,
    SkipFileSync,
    SkipDirSync,
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

fn tuning() -> WalTuning {
    WalTuning {
        writer_tick: Duration::from_millis(1),
        idle_flush: Duration::from_millis(20),
        ..WalTuning::default()
    }
}

fn scrub_config() -> Tier2ScrubConfig {
    Tier2ScrubConfig {
        interval: Duration::from_secs(3600),
        bytes_per_sec_max: 0,
        ..Tier2ScrubConfig::default()
    }
}

/// A running hub and its tiering.
struct Open {
    hub: Arc<Hub>,
    tiering: Arc<Tiering>,
}

/// One seeded run.
struct Sim {
    rng: SmallRng,
    mem: MemStorage,
    cfg: HubConfig,
    root: PathBuf,
    _tmp: tempfile::TempDir,
    mutation: Mutation,
    /// Per device: the last acknowledged seq.
    acked: BTreeMap<String, u64>,
    /// Per step: the most storage operations it took unarmed (where to draw a cut from).
    ops_seen: [u64; STEPS.len()],
    /// When non-zero, the next eviction arms a cut this many operations ahead (eviction is
    /// a few operations at the end of a round: drawn over the whole round, cuts miss it).
    evict_cut: Arc<AtomicU64>,
}

impl Sim {
    fn new(seed: u64, mutation: Mutation) -> Sim {
        let mut rng = SmallRng::seed_from_u64(seed);
        let tmp = scratch();
        let root = tmp.path().join("tier2");
        let segment = rng.random_range(3_000..12_000);
        let chunk_records = rng.random_range(40..200);
        let cfg = common::config(&tmp.path().join("hub"), |c| {
            c.wal.segment_bytes_max = segment;
            c.wal.group_commit_linger = Duration::from_micros(rng.random_range(0..300));
            let t = &mut c.tier2;
            t.url = format!("file://{}", root.display());
            t.chunk_records_max = chunk_records;
            t.chunk_age_max = Duration::from_secs(3600);
            t.tier1_budget_bytes = 1 << 40;
            t.tier1_retention_time = Duration::ZERO;
            t.tier1_retention_bytes = 0;
            t.request_timeout = Duration::from_secs(20);
        });
        Sim {
            mem: MemStorage::with_seed(seed ^ 0x71E2),
            rng,
            cfg,
            root,
            _tmp: tmp,
            mutation,
            acked: (0..DEVICES).map(|d| (format!("truck-{d}"), 0)).collect(),
            ops_seen: [40, 80, 30, 10],
            evict_cut: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Arms a cut somewhere in the next operations `step` usually takes.
    fn arm(&mut self, step: Step) {
        let span = self.ops_seen[step as usize].max(1);
        let at = self.mem.ops() + self.rng.random_range(1..=span);
        self.mem.set_crash_at(at);
    }

    /// Whether a cut landed; disarms one that did not.
    fn landed(&self) -> Option<CrashInfo> {
        let c = self.mem.crash_info();
        if c.is_none() {
            self.mem.disarm();
        }
        c
    }

    fn classify(&self, step: Step, c: &CrashInfo) -> Phase {
        let in_tier2 = c.path.starts_with(&self.root);
        let manifest = c.path.to_string_lossy().contains("/_tributary/manifests/");
        match step {
            Step::Ingest => Phase::BlockCommit,
            Step::Scrub => Phase::Scrub,
            Step::Recovery => Phase::Recovery,
            Step::Tiering if manifest => Phase::Manifest,
            Step::Tiering if !in_tier2 && matches!(c.op, OpKind::Open | OpKind::Remove) => {
                Phase::Eviction
            }
            Step::Tiering => Phase::ChunkUpload,
        }
    }

    /// Runs `f` as `step`, with a cut armed when `armed`. Returns where a cut landed.
    async fn step<F, Fut>(&mut self, step: Step, armed: bool, f: F) -> Result<Option<Phase>, String>
    where
        F: FnOnce(SimRef) -> Fut,
        Fut: std::future::Future<Output = Result<(), String>>,
    {
        let before = self.mem.ops();
        if armed {
            self.arm(step);
        }
        let r = f(SimRef {
            mem: self.mem.clone(),
            root: self.root.clone(),
        })
        .await;
        match self.landed() {
            Some(c) => Ok(Some(self.classify(step, &c))),
            None => {
                r?;
                let used = self.mem.ops() - before;
                let seen = &mut self.ops_seen[step as usize];
                *seen = (*seen).max(used);
                Ok(None)
            }
        }
    }

    /// Opens the hub and its tiering on the storage, and runs the start-up scrub. Errors are
    /// reported as strings (a cut during it makes them expected).
    async fn open(&self) -> Result<Open, String> {
        let hub = reopen(&self.cfg, &self.mem).await?;
        let (mem, cut) = (self.mem.clone(), self.evict_cut.clone());
        let hook: TierFaultHook = Arc::new(move |p| {
            if p == TierFaultPoint::BeforeEvict {
                let k = cut.swap(0, Ordering::Relaxed);
                if k > 0 {
                    mem.set_crash_at(mem.ops() + k);
                }
            }
            false
        });
        let tiering = Tiering::open(hub.clone(), &self.cfg, Some(hook))
            .await
            .map_err(|e| format!("tiering open: {e}"))?;
        let probe = tiering
            .store()
            .sync_probe()
            .expect("local tier 2 has a probe");
        probe.skip_file_syncs(self.mutation == Mutation::SkipFileSync);
        probe.skip_dir_syncs(self.mutation == Mutation::SkipDirSync);
        let scfg = scrub_config();
        scrub_tier2_recent(&tiering, &scfg, scfg.restart_window, None)
            .await
            .map_err(|e| format!("start-up tier-2 scrub: {e}"))?;
        scrub_tier2(&tiering, &scfg, None)
            .await
            .map_err(|e| format!("tier-2 scrub pass: {e}"))?;
        Ok(Open { hub, tiering })
    }

    /// A power cut in a random mode with nothing running.
    fn power_cut(&mut self, counts: &Counts) {
        let mode = CrashMode::ALL[self.rng.random_range(0..CrashMode::ALL.len())];
        self.mem.crash(mode);
        counts.power_cuts.fetch_add(1, Ordering::Relaxed);
    }

    /// Recovery after a power cut, itself cut when `armed`, until one completes.
    async fn recover(&mut self, armed: bool, counts: &Counts) -> Result<Open, String> {
        let mut armed = armed;
        loop {
            let before = self.mem.ops();
            if armed {
                self.arm(Step::Recovery);
            }
            let r = self.open().await;
            if let Some(c) = self.landed() {
                counts.land(self.classify(Step::Recovery, &c));
                if let Ok(o) = r {
                    close(o).await;
                }
                self.power_cut(counts);
                armed = false;
                continue;
            }
            let used = self.mem.ops() - before;
            let seen = &mut self.ops_seen[Step::Recovery as usize];
            *seen = (*seen).max(used);
            return r;
        }
    }

    /// One cycle: ingest, tiering, scrub (a cut armed in one of them or in the recovery),
    /// then a power cut and the recovery. Returns the recovered hub.
    async fn cycle(&mut self, o: Open, counts: &Counts) -> Result<Open, String> {
        let target = STEPS[self.rng.random_range(0..STEPS.len())];
        let plan = self.workload();
        let hub = o.hub.clone();
        let acks = Arc::new(Mutex::new(BTreeMap::new()));
        let a = acks.clone();
        let landed = self
            .step(Step::Ingest, target == Step::Ingest, |_| {
                ingest(hub, plan, a)
            })
            .await;
        // Acknowledgements that arrived before any cut.
        for (dev, seq) in acks.lock().unwrap().iter() {
            let acked = self.acked.get_mut(dev).expect("known device");
            *acked = (*acked).max(*seq);
        }
        let mut landed = landed?;
        if landed.is_none() {
            let t = o.tiering.clone();
            // Half the cuts aimed at tiering go to its eviction step (the file's open, then
            // its removal, of the first files evicted).
            let at_evict = target == Step::Tiering && self.rng.random_bool(0.5);
            if at_evict {
                self.evict_cut
                    .store(self.rng.random_range(1..=4), Ordering::Relaxed);
            }
            let armed = target == Step::Tiering && !at_evict;
            landed = self.step(Step::Tiering, armed, |_| tier(t)).await?;
            self.evict_cut.store(0, Ordering::Relaxed);
        }
        if landed.is_none() {
            let t = o.tiering.clone();
            let pick = self.rng.random::<u64>();
            landed = self
                .step(Step::Scrub, target == Step::Scrub, move |s| {
                    damage_and_scrub(t, s, pick, counts)
                })
                .await?;
        }
        if let Some(p) = landed {
            counts.land(p);
        }
        close(o).await;
        self.power_cut(counts);
        let o = self.recover(target == Step::Recovery, counts).await?;
        self.check(&o, counts).await?;
        Ok(o)
    }

    /// Per device, the blocks to send this cycle: (first seq, last seq).
    fn workload(&mut self) -> Vec<(String, Vec<(u64, u64)>)> {
        let mut out = Vec::new();
        for (dev, &acked) in &self.acked {
            let mut next = acked + 1;
            let mut blocks = Vec::new();
            for _ in 0..self.rng.random_range(2..6) {
                let n = self.rng.random_range(5..60);
                blocks.push((next, next + n - 1));
                next += n;
            }
            out.push((dev.clone(), blocks));
        }
        out
    }

    /// The checker (module doc).
    async fn check(&self, o: &Open, counts: &Counts) -> Result<(), String> {
        for (dev, &acked) in &self.acked {
            let mark = mark_of(&o.hub, dev);
            if mark != acked {
                return Err(format!("{dev}: durable mark {mark}, acknowledged {acked}"));
            }
        }
        let (records, gaps) = read_all(&o.tiering).await?;
        if !gaps.is_empty() {
            return Err(format!("damaged chunks skipped by the reader: {gaps:?}"));
        }
        let mut next: BTreeMap<&str, u64> = BTreeMap::new();
        for (i, r) in records.iter().enumerate() {
            if r.offset != i as u64 {
                return Err(format!("offset {} at position {i}: not dense", r.offset));
            }
            let n = next.entry(r.device.as_str()).or_insert(1);
            if r.seq != *n || r.epoch != EPOCH {
                return Err(format!(
                    "{} seq {} (epoch {}) where {} was due",
                    r.device, r.seq, r.epoch, n
                ));
            }
            *n += 1;
            same_content(&r.device, r.seq, r.ts, &r.fields)?;
        }
        for (dev, &acked) in &self.acked {
            let got = next.get(dev.as_str()).map_or(0, |n| n - 1);
            if got != acked {
                return Err(format!(
                    "{dev}: {got} records readable, {acked} acknowledged"
                ));
            }
        }
        if let Some(sid) = o.hub.lookup_stream(STREAM) {
            let evicted = store::state(o.hub.catalog(), sid)
                .map_err(|e| e.to_string())?
                .evicted_end;
            counts.tier2_reads.fetch_add(evicted, Ordering::Relaxed);
        }
        self.check_sql_view(&o.tiering).await
    }

    /// Every Parquet file under `streams/` decodes; records in them are acknowledged ones,
    /// each at most once.
    async fn check_sql_view(&self, t: &Tiering) -> Result<(), String> {
        let files = t
            .store()
            .list(&tier::chunks_prefix(STREAM))
            .await
            .map_err(|e| format!("listing streams/: {e}"))?;
        let mut seen = BTreeSet::new();
        for f in files.iter().filter(|f| f.path.ends_with(".parquet")) {
            let recs = t
                .store()
                .read_chunk(&f.path)
                .await
                .map_err(|e| format!("{} does not decode: {e}", f.path))?;
            for r in recs {
                if !seen.insert((r.device.clone(), r.seq)) {
                    return Err(format!("{} seq {} twice in streams/", r.device, r.seq));
                }
                if self.acked.get(&r.device).is_none_or(|&a| r.seq > a) {
                    return Err(format!(
                        "{} seq {} in streams/ was never acknowledged",
                        r.device, r.seq
                    ));
                }
                same_content(&r.device, r.seq, r.ts_ns, &r.fields)?;
            }
        }
        Ok(())
    }
}

/// What a step may touch of the simulation.
struct SimRef {
    mem: MemStorage,
    root: PathBuf,
}

fn mark_of(hub: &Hub, device: &str) -> u64 {
    hub.marks(device)
        .iter()
        .find(|m| m.stream == STREAM && m.epoch == EPOCH)
        .map_or(0, |m| m.durable_seq)
}

fn same_content(
    device: &str,
    seq: u64,
    ts: i64,
    fields: &[(String, sync::record::Value)],
) -> Result<(), String> {
    let want = common::record(device, seq);
    let mut got = fields.to_vec();
    got.sort_by(|a, b| a.0.cmp(&b.0));
    let mut w = want.fields.clone();
    w.sort_by(|a, b| a.0.cmp(&b.0));
    if ts != want.ts || got != w {
        return Err(format!("{device} seq {seq}: content differs: {got:?}"));
    }
    Ok(())
}

/// Opens the hub on `mem`, waiting for the previous instance to let go of the lock.
async fn reopen(cfg: &HubConfig, mem: &MemStorage) -> Result<Arc<Hub>, String> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let env = WalEnv {
            storage: Arc::new(mem.clone()),
            tuning: tuning(),
        };
        match Hub::open_on(cfg, env, None) {
            Ok(hub) => return Ok(hub),
            Err(core_hub::ingest::OpenError::Locked(path)) if Instant::now() < deadline => {
                let _ = path;
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            Err(e) => return Err(format!("hub open: {e}")),
        }
    }
}

async fn close(o: Open) {
    let Open { hub, tiering } = o;
    drop(tiering);
    hub.shutdown();
}

/// The devices commit their blocks concurrently, each in order, stopping at its first error.
/// Each acknowledged block's last seq goes into `acks` as it arrives.
async fn ingest(
    hub: Arc<Hub>,
    plan: Vec<(String, Vec<(u64, u64)>)>,
    acks: Arc<Mutex<BTreeMap<String, u64>>>,
) -> Result<(), String> {
    let mut tasks = Vec::new();
    for (dev, blocks) in plan {
        let hub = hub.clone();
        let acks = acks.clone();
        tasks.push(tokio::spawn(async move {
            for (first, last) in blocks {
                let block = common::block(&dev, EPOCH, first, last);
                match hub.commit_block(&dev, STREAM, &block).await {
                    Ok(done) if done.durable_seq() == last => {
                        acks.lock().unwrap().insert(dev.clone(), last);
                    }
                    Ok(done) => return Err(format!("{dev} {first}..={last}: acked as {done:?}")),
                    Err(e) => return Err(format!("{dev} {first}..={last}: {e}")),
                }
            }
            Ok(())
        }));
    }
    let mut first_err = Ok(());
    for t in tasks {
        let r = t.await.map_err(|e| e.to_string()).and_then(|r| r);
        if first_err.is_ok() {
            first_err = r;
        }
    }
    first_err
}

/// Tiering rounds, sealing everything, until one does nothing.
async fn tier(t: Arc<Tiering>) -> Result<(), String> {
    for _ in 0..200 {
        let r = t
            .run_once(true)
            .await
            .map_err(|e| format!("tiering: {e}"))?;
        if r.ranges_planned == 0 && r.chunks_committed == 0 && r.wal_files_evicted == 0 {
            return Ok(());
        }
    }
    Err("tiering did not settle".into())
}

/// Flips a byte in a committed chunk that tier 1 still holds (if any), then runs a full
/// tier-2 scrub pass, which must repair it.
async fn damage_and_scrub(
    t: Arc<Tiering>,
    s: SimRef,
    pick: u64,
    counts: &Counts,
) -> Result<(), String> {
    let hub = t.hub().clone();
    let Some(sid) = hub.lookup_stream(STREAM) else {
        return Ok(()); // nothing committed yet
    };
    let cat = hub.catalog();
    let evicted = store::state(cat, sid)
        .map_err(|e| e.to_string())?
        .evicted_end;
    let repairable: Vec<store::ChunkRow> = store::committed_chunks(cat, sid)
        .map_err(|e| e.to_string())?
        .into_iter()
        .filter(|c| c.first_offset >= evicted && c.rows > 0)
        .collect();
    let victim = (!repairable.is_empty())
        .then(|| repairable[(pick % repairable.len() as u64) as usize].clone());
    if let Some(v) = &victim {
        flip_byte(&s.mem, &s.root.join(&v.path)).map_err(|e| format!("damaging: {e}"))?;
    }
    let report = scrub_tier2(&t, &scrub_config(), None)
        .await
        .map_err(|e| format!("tier-2 scrub: {e}"))?;
    if let Some(v) = victim {
        if !report.repaired.contains(&v.path) {
            return Err(format!("{} damaged, not repaired: {report:?}", v.path));
        }
        counts.repairs.fetch_add(1, Ordering::Relaxed);
    }
    Ok(())
}

/// Bit rot: one flipped bit in the middle of the file, synced.
fn flip_byte(mem: &MemStorage, path: &Path) -> std::io::Result<()> {
    let f = mem.open(path)?;
    let at = f.len() / 2;
    let mut b = [0u8];
    f.read_at(&mut b, at)?;
    f.write_at(&[b[0] ^ 0x04], at)?;
    f.sync()
}

/// Every record of the stream through the hub's read path over both tiers.
async fn read_all(
    t: &Arc<Tiering>,
) -> Result<(Vec<core_hub::read::ReadRecord>, Vec<String>), String> {
    if t.hub().lookup_stream(STREAM).is_none() {
        return Ok((Vec::new(), Vec::new()));
    }
    let mut reader = TierReader::new(t.clone(), STREAM, None, 0).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    loop {
        let page = reader
            .next_page(1_000)
            .await
            .map_err(|e| format!("reading: {e}"))?;
        if page.records.is_empty() {
            let gaps = reader.gaps().iter().map(|g| format!("{g:?}")).collect();
            return Ok((out, gaps));
        }
        out.extend(page.records);
    }
}

async fn run_async(seed: u64, mutation: Mutation, counts: &Counts) -> Result<(), String> {
    let mut sim = Sim::new(seed, mutation);
    let mut o = sim.open().await?;
    let cycles = sim.rng.random_range(3..=5);
    for _ in 0..cycles {
        o = sim.cycle(o, counts).await?;
    }
    let acked: u64 = sim.acked.values().sum();
    counts.acked_records.fetch_add(acked, Ordering::Relaxed);
    close(o).await;
    Ok(())
}

fn run_one(seed: u64, mutation: Mutation, counts: &Counts) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(run_async(seed, mutation, counts))
}

/// Runs `seed`, turning a panic into an error naming it.
fn run_caught(seed: u64, mutation: Mutation, counts: &Counts) -> Result<(), String> {
    match catch_unwind(AssertUnwindSafe(|| run_one(seed, mutation, counts))) {
        Ok(r) => r,
        Err(p) => Err(p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "panic".into())),
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
    0x7_1E20_0000 + i
}

fn shard(k: u64) {
    let counts = Counts::default();
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
    let started = Instant::now();
    for seed in seeds {
        if let Err(e) = run_caught(seed, Mutation::None, &counts) {
            panic!(
                "crash_sim_tier failed with seed {seed}: {e}\n\
                 replay: TRIBUTARY_CRASH_SEED={seed} cargo test -p core-hub --test crash_sim_tier"
            );
        }
    }
    let report = counts.report(&format!("shard {k} ({:?})", started.elapsed()));
    if !single {
        for (name, c) in report {
            assert!(
                c > 0,
                "no {name} in shard {k}: the simulation does not cover it"
            );
        }
    }
}

#[test]
fn crash_sim_tier_shard_0() {
    shard(0);
}
#[test]
fn crash_sim_tier_shard_1() {
    shard(1);
}
#[test]
fn crash_sim_tier_shard_2() {
    shard(2);
}
#[test]
fn crash_sim_tier_shard_3() {
    shard(3);
}

/// With `mutation` on, some of the first `seeds` runs must fail the checker.
fn mutation_is_caught(mutation: Mutation, seeds: u64) {
    let counts = Counts::default();
    let caught: Vec<(u64, String)> = (0..seeds)
        .map(seed_of)
        .filter_map(|seed| run_caught(seed, mutation, &counts).err().map(|e| (seed, e)))
        .collect();
    println!(
        "crash_sim_tier mutation {mutation:?}: {} of {seeds} runs failed the checker; first: {:?}",
        caught.len(),
        caught.first()
    );
    assert!(
        !caught.is_empty(),
        "{mutation:?} went unnoticed in {seeds} runs"
    );
}

#[test]
fn skipping_the_tier2_file_sync_is_caught() {
    mutation_is_caught(Mutation::SkipFileSync, 20);
}

#[test]
fn skipping_the_tier2_directory_syncs_is_caught() {
    mutation_is_caught(Mutation::SkipDirSync, 20);
}
