//! Running out of file descriptors under the hub's tier-1 WAL (EMFILE from `MemStorage`'s
//! fault injection) never poisons the log.
//!
//! Files roll at every block (`segment_bytes_max = 1`), so every group creates a WAL file and
//! syncs the directory. While the "pressure" lasts, creating that file (or syncing the
//! directory, or opening a file for the idle probe) fails with EMFILE: each attempt's
//! requests fail with the retryable `FdExhausted`, producers retry as devices do, and once the
//! pressure is gone the same writer takes writes again, without a restart. The checker then
//! cuts the power (everything not synced is dropped), reopens, and asserts the ledger: every
//! acknowledged block is in the index exactly once, in seq order, readable from the WAL with
//! its bytes, hub offsets run from 0 without a hole, and each lane's mark is its last
//! acknowledged seq. Each scenario asserts that its fault fired and that the episode was
//! counted (`fd_exhausted_failures`, the `/metrics` counter's source).
//!
//! Mutation check: with `Mutation::FdExhaustionFatal` (feature `fault-injection`) EMFILE on a
//! roll poisons the log as any storage error did, and the same scenario fails.

use core_hub::catalog::{Catalog, DeviceId, StreamId};
use core_hub::storage::{CrashMode, Fault, FaultError, MemStorage, OpKind};
use core_hub::streams::BlockHashes;
use core_hub::wal::{
    self, AppendDone, AppendRequest, CommitError, Mutation, WalEnv, WalHandle, WalReader,
    WalTuning, WriterConfig,
};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::{Duration, Instant};

const EPOCH: u64 = 1;
const LANES: u32 = 3;
/// Blocks per lane before, during and after the pressure.
const BLOCKS: u64 = 12;
const RECORDS_PER_BLOCK: u32 = 5;
const DEADLINE: Duration = Duration::from_secs(20);

struct Run {
    wal: WalHandle,
    join: std::thread::JoinHandle<()>,
}

struct Rig {
    mem: MemStorage,
    dir: PathBuf,
    catalog_path: PathBuf,
    _tmp: tempfile::TempDir,
    lanes: Vec<(DeviceId, StreamId)>,
    /// Per lane: the acknowledged blocks as `(first_seq, hub_offset_base, bytes)`.
    acked: Vec<Vec<(u64, u64, Vec<u8>)>>,
    mutation: Mutation,
}

fn tuning(mutation: Mutation) -> WalTuning {
    WalTuning {
        writer_tick: Duration::from_millis(1),
        idle_flush: Duration::from_millis(20),
        disk_full_backoff_initial: Duration::from_millis(1),
        disk_full_backoff_max: Duration::from_millis(8),
        disk_full_resume_free_bytes: 0,
        mutation,
    }
}

impl Rig {
    fn new(mutation: Mutation) -> Rig {
        let tmp = tempfile::tempdir().unwrap();
        let catalog_path = tmp.path().join("catalog.sqlite");
        let c = Catalog::open(&catalog_path).unwrap();
        let lanes = (0..LANES)
            .map(|i| {
                let d = c.intern_device(&format!("dev-{i}")).unwrap();
                let s = c.intern_stream(&format!("stream-{}", i % 2)).unwrap();
                (d, s)
            })
            .collect();
        Rig {
            mem: MemStorage::with_seed(7),
            dir: PathBuf::from("/hub/wal"),
            catalog_path,
            _tmp: tmp,
            lanes,
            acked: vec![Vec::new(); LANES as usize],
            mutation,
        }
    }

    fn start(&self) -> Run {
        let catalog = Arc::new(Catalog::open(&self.catalog_path).unwrap());
        let offsets = catalog
            .streams()
            .unwrap()
            .into_iter()
            .map(|s| (s.id, s.next_offset))
            .collect();
        let cfg = WriterConfig {
            segment_bytes_max: 1,
            group_commit_linger: Duration::from_micros(100),
            faults: None,
            on_commit: None,
        };
        let env = WalEnv {
            storage: Arc::new(self.mem.clone()),
            tuning: tuning(self.mutation),
        };
        let (wal, join) = wal::start_with(env, &self.dir, catalog, offsets, cfg).unwrap();
        Run { wal, join }
    }

    fn next_seq(&self, lane: usize) -> u64 {
        self.acked[lane].len() as u64 * u64::from(RECORDS_PER_BLOCK) + 1
    }

    /// Appends the lane's next block once and waits for the outcome.
    fn try_append(&mut self, run: &Run, lane: usize) -> Result<AppendDone, CommitError> {
        let (device, stream) = self.lanes[lane];
        let first_seq = self.next_seq(lane);
        let block = format!("lane {lane} seqs from {first_seq}").into_bytes();
        let (tx, rx) = mpsc::channel();
        run.wal.append(AppendRequest {
            device,
            stream,
            epoch: EPOCH,
            first_seq,
            count: RECORDS_PER_BLOCK,
            checksum: first_seq ^ u64::from(device),
            min_ts: 0,
            max_ts: 0,
            block: block.clone(),
            key_hashes: BlockHashes::default(),
            done: Box::new(move |r| {
                let _ = tx.send(r);
            }),
        });
        let out = rx
            .recv_timeout(DEADLINE)
            .expect("no completion: the WAL hung");
        if let Ok(done) = &out {
            assert_eq!(done.last_seq, first_seq + u64::from(RECORDS_PER_BLOCK) - 1);
            self.acked[lane].push((first_seq, done.hub_offset_base, block));
        }
        out
    }

    /// Appends the lane's next block, retrying retryable refusals as a device does.
    fn append(&mut self, run: &Run, lane: usize) -> u64 {
        let deadline = Instant::now() + DEADLINE;
        let mut refusals = 0;
        loop {
            match self.try_append(run, lane) {
                Ok(_) => return refusals,
                Err(CommitError::FdExhausted { .. } | CommitError::EarlierFailed) => {
                    refusals += 1;
                    assert!(Instant::now() < deadline, "writes never resumed");
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(e) => panic!("lane {lane}: not a retryable refusal: {e}"),
            }
        }
    }

    /// Power cut, reopen, and the ledger check (see the module doc).
    fn check_after_crash(&mut self, run: Run) {
        stop(run);
        self.mem.crash(CrashMode::Drop);
        let reopened = self.start();
        let catalog = Catalog::open(&self.catalog_path).unwrap();
        let reader = WalReader::with_storage(Arc::new(self.mem.clone()), &self.dir);
        let mut found: Vec<Vec<(u64, u64, Vec<u8>)>> = vec![Vec::new(); LANES as usize];
        for stream in catalog.streams().unwrap() {
            let rows = catalog.blocks_from(stream.id, 0, usize::MAX).unwrap();
            let mut next = 0;
            for row in rows {
                assert_eq!(row.hub_offset_base, next, "hole or overlap in hub offsets");
                next += row.last_seq - row.first_seq + 1;
                let (h, bytes) = reader.read(&row).expect("indexed frame unreadable");
                assert_eq!((h.device, h.first_seq), (row.device, row.first_seq));
                let lane = self
                    .lanes
                    .iter()
                    .position(|&l| l == (row.device, stream.id))
                    .expect("a known lane");
                found[lane].push((row.first_seq, row.hub_offset_base, bytes));
            }
        }
        assert_eq!(
            found, self.acked,
            "the index holds exactly the acknowledged blocks"
        );
        for m in catalog.all_marks().unwrap() {
            let lane = self
                .lanes
                .iter()
                .position(|&l| l == (m.device, m.stream))
                .unwrap();
            assert_eq!(m.durable_seq, self.next_seq(lane) - 1, "lane {lane}'s mark");
        }
        stop(reopened);
    }
}

fn stop(run: Run) {
    run.wal.stop();
    drop(run.wal);
    run.join.join().expect("the WAL writer panicked");
}

fn emfile(op: OpKind) -> Fault {
    Fault {
        path_contains: Some("/hub/wal".into()),
        sticky: true,
        ..Fault::on(op, FaultError::Emfile)
    }
}

fn wait(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + DEADLINE;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Blocks before the pressure, refusals under it (the fault on `ops`), recovery after it.
fn scenario(mutation: Mutation, ops: &[OpKind]) {
    let mut rig = Rig::new(mutation);
    let run = rig.start();
    for _ in 0..BLOCKS / 3 {
        for lane in 0..LANES as usize {
            assert_eq!(rig.append(&run, lane), 0, "no refusal without pressure");
        }
    }
    let stats = run.wal.stats().clone();

    for &op in ops {
        rig.mem.inject(emfile(op));
    }
    let fired_before = rig.mem.faults_fired();
    for lane in 0..LANES as usize {
        let err = rig.try_append(&run, lane).unwrap_err();
        assert!(
            matches!(err, CommitError::FdExhausted { .. }),
            "lane {lane}: {err}"
        );
    }
    assert!(
        rig.mem.faults_fired() > fired_before,
        "the EMFILE never fired"
    );
    assert!(stats.fd_exhausted_failures.load(Ordering::SeqCst) >= 1);
    assert!(
        !stats.poisoned.load(Ordering::SeqCst),
        "EMFILE must not poison"
    );
    assert!(stats.fd_exhausted().is_some(), "the episode is visible");
    // Still under pressure after several backoffs: refused, never poisoned.
    std::thread::sleep(Duration::from_millis(30));
    assert!(rig.try_append(&run, 0).is_err());
    assert!(!stats.poisoned.load(Ordering::SeqCst));

    // Descriptors are back: the same writer resumes (the idle probe ends the episode).
    rig.mem.clear_faults();
    wait("the episode to end", || stats.fd_exhausted().is_none());
    for _ in 0..BLOCKS / 3 {
        for lane in 0..LANES as usize {
            rig.append(&run, lane);
        }
    }
    // Pressure comes and goes (one failed attempt at a time) while producers keep retrying:
    // nothing is lost or doubled.
    let mut refused = 0;
    for _ in 0..BLOCKS / 3 {
        for lane in 0..LANES as usize {
            rig.mem.inject(Fault {
                sticky: false,
                ..emfile(ops[0])
            });
            refused += rig.append(&run, lane);
        }
    }
    assert!(refused >= LANES as u64, "the one-shot faults were refused");
    assert!(!stats.poisoned.load(Ordering::SeqCst));
    rig.check_after_crash(run);
}

#[test]
fn emfile_on_roll_is_retried_and_the_ledger_is_exact() {
    scenario(Mutation::None, &[OpKind::Create, OpKind::Open]);
}

#[test]
fn emfile_on_the_roll_directory_sync_is_owed_and_retried() {
    scenario(Mutation::None, &[OpKind::SyncDir, OpKind::Open]);
}

#[test]
fn the_checker_catches_emfile_made_fatal_again() {
    let caught = std::panic::catch_unwind(|| {
        scenario(Mutation::FdExhaustionFatal, &[OpKind::Create, OpKind::Open])
    });
    let msg = caught.expect_err("the scenario passed with EMFILE fatal");
    let msg = msg
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| msg.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default();
    assert!(
        msg.contains("poison") || msg.contains("FdExhausted") || msg.contains("lane"),
        "failed for another reason: {msg}"
    );
}
