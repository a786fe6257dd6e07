//! Storage faults at the hub, with the real hub and agent binaries.
//!
//! - **Full disk**: the hub's data directory is a small tmpfs (mounted here; the tests run as
//!   root, as CI does). Once it is filled, ingest must be refused with a clear, retryable error
//!   (`/healthz` 503 naming the full disk and its path, the log names the ENOSPC, the
//!   `tributary_hub_wal_disk_full` gauge is 1 and the log is *not* poisoned), the agent must
//!   keep the unshipped records, and nothing already stored may be lost: reads keep serving
//!   it. Then the test frees the space (deletes its filler file) and the SAME hub process
//!   (same pid, never restarted) resumes on its own: `/healthz` is 200 again, the agent
//!   reconnects and catches up, and the ledger check passes: no loss, no duplicate. The hub
//!   tells the agent `STORAGE_FULL` (agent metric `tributary_edge_link_storage_full_total`),
//!   so the agent, on its default 30 s backoff cap, retries every few seconds instead of
//!   backing off: it must have caught up within [`CATCH_UP_BOUND`] of the space being freed.
//! - **Bit flip at rest**: one byte of a block in a sealed WAL file is flipped while the hub is
//!   stopped (the test re-reads the frame and proves its crc32c no longer matches). The hub
//!   must start, keep serving the other stream in full, and detect the damage: with the
//!   scrubber hooked in (`core_hub::scrub`, metric `tributary_hub_quarantined_blocks`) the
//!   block is quarantined and exactly its records are missing from an otherwise served
//!   stream; without it, the read of the damaged range fails naming the damaged frame instead
//!   of serving wrong data.
//!
//! Each test asserts its fault happened: ENOSPC was hit while filling, the hub itself failed a
//! group commit for it (metric) and its log names it, and the flipped frame fails its checksum.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use serde_json::json;
use tributary_tests::cluster::{self, AgentSpec, HubSpec, Pki};
use tributary_tests::http;
use tributary_tests::ledger::{Ledger, PostOutcome, Producer, SentRecord};
use tributary_tests::procs::wait_until;

const WAIT: Duration = Duration::from_secs(60);
const STOP: Duration = Duration::from_secs(20);
/// From freeing the space to the agent caught up: the agent's storage-full retry (5 s by
/// default) plus the reconnect and the drain, with room for a loaded machine. A backoff that
/// kept growing while the disk was full would wait up to its 30 s cap instead.
const CATCH_UP_BOUND: Duration = Duration::from_secs(20);
/// The agent's count of sessions the hub ended or refused with `STORAGE_FULL`.
const STORAGE_FULL_METRIC: &str = "tributary_edge_link_storage_full_total";

/// A tmpfs mounted for one test, unmounted when dropped.
struct TmpfsMount {
    path: PathBuf,
}

impl TmpfsMount {
    fn new(path: &Path, size: &str) -> Result<TmpfsMount> {
        std::fs::create_dir_all(path)?;
        let output = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(path)
            .output()
            .context("running mount")?;
        ensure!(
            output.status.success(),
            "mount -t tmpfs failed (these tests need root, as CI runs them): {}",
            String::from_utf8_lossy(&output.stderr)
        );
        Ok(TmpfsMount {
            path: path.to_path_buf(),
        })
    }
}

impl Drop for TmpfsMount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.path).status();
    }
}

/// Writes `path` in 256 KiB chunks until the file system is full. Returns the bytes written;
/// fails unless the fill really ended with ENOSPC.
fn fill(path: &Path) -> Result<u64> {
    let mut file = std::fs::File::create(path)?;
    let chunk = vec![0xA5u8; 256 << 10];
    let mut written = 0u64;
    loop {
        match file.write(&chunk) {
            Ok(0) => bail!("write returned 0 before ENOSPC"),
            Ok(n) => written += n as u64,
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
            Err(e) => return Err(e).context("filling the tmpfs"),
        }
    }
    // Small writes too, so not even one page is left.
    loop {
        match file.write(&[0u8; 512]) {
            Ok(n) if n > 0 => written += n as u64,
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => return Ok(written),
            other => bail!("unexpected end of the fill: {other:?}"),
        }
    }
}

fn batch(tag: &str, from: u64, n: u64) -> Vec<SentRecord> {
    (from..from + n)
        .map(|i| {
            SentRecord::new(
                format!("k{}", i % 5),
                10_000 + i as i64,
                json!({ "tag": tag, "i": i, "v": (i * 13) % 97 }),
            )
        })
        .collect()
}

/// Records carrying 4 KiB of pseudo-random hex, so a few batches fill 1 MiB WAL segments.
fn blob_batch(tag: &str, from: u64, n: u64) -> Vec<SentRecord> {
    (from..from + n)
        .map(|i| {
            let mut x = (i + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
            let blob: String = (0..2048)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    format!("{:02x}", x as u8)
                })
                .collect::<Vec<_>>()
                .concat();
            SentRecord::new(
                format!("k{}", i % 5),
                10_000 + i as i64,
                json!({ "tag": tag, "i": i, "blob": blob }),
            )
        })
        .collect()
}

fn ingest(
    producer: &Producer,
    ledger: &mut Ledger,
    stream: &str,
    records: &[SentRecord],
) -> Result<()> {
    for chunk in records.chunks(200) {
        match producer.post(ledger, stream, chunk, None)? {
            PostOutcome::Acked(_) => {}
            other => bail!("ingest into {stream} was not acknowledged: {other:?}"),
        }
    }
    Ok(())
}

/// What a full-disk round needs to check the hub's recovery.
struct Round<'a> {
    pid: u32,
    hub_http: std::net::SocketAddr,
    agent_http: std::net::SocketAddr,
    producer: &'a Producer,
}

impl Round<'_> {
    /// Frees the space (removes `filler`); the same hub process must take writes again on its
    /// own, take `after`, the agent must catch up, and the ledger must match `expected` records.
    /// First the agent must have heard `STORAGE_FULL` more often than `storage_full_before`
    /// times. Returns how often it had heard it once caught up, for the next round.
    fn free_and_resume(
        &self,
        hub: &mut tributary_tests::procs::Proc,
        filler: &Path,
        ledger: &mut Ledger,
        after: &[SentRecord],
        expected: usize,
        storage_full_before: f64,
    ) -> Result<f64> {
        // The agent was told the hub's storage is full, not just that something failed.
        wait_until(WAIT, "the agent to hear STORAGE_FULL from the hub", || {
            cluster::fetch_metric(self.agent_http, STORAGE_FULL_METRIC)
                .is_ok_and(|n| n > storage_full_before)
        })?;
        std::fs::remove_file(filler)?;
        let freed = Instant::now();
        wait_until(WAIT, "the hub to take writes again (healthz 200)", || {
            http::get(self.hub_http, "/healthz").is_ok_and(|r| r.status == 200)
        })?;
        ingest(self.producer, ledger, "telemetry", after)?;
        cluster::wait_caught_up(self.agent_http, WAIT)?;
        let caught_up = freed.elapsed();
        eprintln!("agent caught up {caught_up:?} after the space was freed");
        ensure!(
            caught_up < CATCH_UP_BOUND,
            "the agent took {caught_up:?} to catch up after the space was freed (bound \
             {CATCH_UP_BOUND:?}): it waited on its backoff instead of the storage-full retry"
        );
        ensure!(
            hub.is_running() && hub.pid() == self.pid && hub.spawns() == 1,
            "the hub was restarted (pid {} -> {}, {} spawns)",
            self.pid,
            hub.pid(),
            hub.spawns()
        );
        let report = ledger.check(cluster::read_stream(self.hub_http, "telemetry")?);
        eprintln!("{}", report.summary());
        report.assert_ok();
        ensure!(report.matched == expected, "{}", report.summary());
        cluster::fetch_metric(self.agent_http, STORAGE_FULL_METRIC)
    }
}

#[test]
fn hub_disk_full_refuses_ingest_keeps_data_and_resumes_without_restart() -> Result<()> {
    let root = tempfile::Builder::new().prefix("trb-hubfull-").tempdir()?;
    let mount = TmpfsMount::new(&root.path().join("hubfs"), "24m")?;
    let pki = Pki::init(root.path().join("pki"))?;
    let cert = pki.issue("dev-full", None)?;
    let mut hub_spec = HubSpec::new(root.path());
    hub_spec.data_dir = mount.path.join("data");
    let mut hub = hub_spec.start(&pki)?;
    let pid = hub.pid();
    // The agent keeps its default backoff (cap 30 s): the hub's STORAGE_FULL answer is what
    // keeps its retries short.
    let agent_spec = AgentSpec::new(root.path(), "agent", cert, Some(hub_spec.quic));
    let _agent = agent_spec.start()?;
    let producer = Producer::new("dev-full", agent_spec.http);
    let mut ledger = Ledger::new();

    ingest(
        &producer,
        &mut ledger,
        "telemetry",
        &batch("before", 0, 2_000),
    )?;
    cluster::wait_caught_up(agent_spec.http, WAIT)?;
    let stored_before = cluster::read_stream(hub_spec.http, "telemetry")?;
    ensure!(
        stored_before.len() == 2_000,
        "{} stored",
        stored_before.len()
    );

    // The fault: no byte left on the hub's file system.
    let filler = mount.path.join("filler");
    let filled = fill(&filler)?;
    eprintln!("filled the hub's tmpfs with {filled} bytes");

    // The agent acknowledges locally (its own disk is fine) and tries to ship.
    ingest(
        &producer,
        &mut ledger,
        "telemetry",
        &batch("during", 2_000, 2_000),
    )?;
    wait_until(WAIT, "the hub to refuse ingest (healthz 503)", || {
        http::get(hub_spec.http, "/healthz").is_ok_and(|r| r.status == 503)
    })?;
    let health = http::get(hub_spec.http, "/healthz")?.text();
    ensure!(
        health.contains("disk full") && health.contains(&mount.path.display().to_string()),
        "healthz does not name the full disk and its path: {health}"
    );
    let log = hub.stderr();
    ensure!(
        log.contains("No space left on device") || log.contains("disk is full"),
        "the hub's log does not name the full disk:\n{}",
        hub.log_tail(30)
    );
    // The fault happened in the hub: a group commit failed for it and was rolled back.
    let failures =
        cluster::fetch_metric(hub_spec.http, "tributary_hub_wal_disk_full_failures_total")?;
    ensure!(
        failures >= 1.0,
        "the hub never failed a group commit for the full disk"
    );
    ensure!(
        cluster::fetch_metric(hub_spec.http, "tributary_hub_wal_disk_full")? == 1.0,
        "the tier-1 log is not reported as refusing writes for a full disk"
    );
    ensure!(
        cluster::fetch_metric(hub_spec.http, "tributary_hub_wal_poisoned")? == 0.0,
        "a full disk must not poison the tier-1 log"
    );
    let status = cluster::status(agent_spec.http)?;
    ensure!(
        cluster::unacked(&status) > 0,
        "the agent should still hold unshipped records: {status}"
    );
    // Nothing already stored is lost, and reads keep working while the disk is full.
    let stored_full = cluster::read_stream(hub_spec.http, "telemetry")?;
    ensure!(
        stored_full.len() >= 2_000 && stored_full[..2_000] == stored_before[..],
        "records stored before the disk filled changed: {} now",
        stored_full.len()
    );

    // Free the space. The same hub process resumes on its own, and the agent catches up.
    let round = Round {
        pid,
        hub_http: hub_spec.http,
        agent_http: agent_spec.http,
        producer: &producer,
    };
    let storage_full_round_one = round.free_and_resume(
        &mut hub,
        &filler,
        &mut ledger,
        &batch("after", 4_000, 1_000),
        5_000,
        0.0,
    )?;
    ensure!(
        cluster::fetch_metric(hub_spec.http, "tributary_hub_wal_disk_full_resumed_total")? >= 1.0
            && cluster::fetch_metric(hub_spec.http, "tributary_hub_wal_disk_full")? == 0.0,
        "the hub does not report having resumed"
    );

    // Round two, with large incompressible records: the WAL write itself now hits ENOSPC
    // (round one may hit it in the catalog commit first, when a small block still fits the
    // WAL file's last page). Both paths must roll back and resume.
    // One blob record first, while there is space: the stream registers its new field name
    // in the catalog before it writes a block, and that write would meet the full disk first.
    ingest(
        &producer,
        &mut ledger,
        "telemetry",
        &blob_batch("field", 9_000, 1),
    )?;
    wait_until(WAIT, "the first blob record to be acknowledged", || {
        cluster::status(agent_spec.http)
            .map(|st| cluster::unacked(&st) == 0)
            .unwrap_or(false)
    })?;
    let filled = fill(&filler)?;
    eprintln!("filled the hub's tmpfs again with {filled} bytes");
    ingest(
        &producer,
        &mut ledger,
        "telemetry",
        &blob_batch("during2", 5_000, 100),
    )?;
    wait_until(WAIT, "the hub to refuse ingest again (healthz 503)", || {
        http::get(hub_spec.http, "/healthz").is_ok_and(|r| r.status == 503)
    })
    .with_context(|| {
        let health = http::get(hub_spec.http, "/healthz")
            .map(|r| r.text())
            .unwrap_or_default();
        format!("healthz: {health}\nhub: {}", hub.log_tail(30))
    })?;
    let health = http::get(hub_spec.http, "/healthz")?.text();
    ensure!(
        health.contains("No space left on device") && health.contains(".wal"),
        "round two did not fail a WAL write for the full disk: {health}"
    );
    ensure!(
        cluster::fetch_metric(hub_spec.http, "tributary_hub_wal_disk_full_failures_total")?
            > failures,
        "round two failed no group commit"
    );
    round.free_and_resume(
        &mut hub,
        &filler,
        &mut ledger,
        &batch("after2", 5_100, 500),
        5_601,
        storage_full_round_one,
    )?;

    for line in hub
        .stderr()
        .lines()
        .filter(|l| l.contains("disk full") || l.contains("resume"))
    {
        eprintln!("hub: {line}");
    }
    // And the resumed log is sound: a restart re-verifies it and serves the same records.
    let stored = cluster::read_stream(hub_spec.http, "telemetry")?;
    hub.terminate(STOP)?;
    hub.restart()?;
    hub.wait_http_ok(hub_spec.http, "/healthz", cluster::START_TIMEOUT)?;
    ensure!(
        cluster::read_stream(hub_spec.http, "telemetry")? == stored,
        "the records changed across a restart after the resume"
    );
    Ok(())
}

/// The documented WAL layout (`core_hub::wal`): a 16-byte file header, then frames of
/// `len u32 | crc32c u32 | payload`, the payload starting with a 56-byte entry header.
const WAL_HEADER_LEN: usize = 16;
const ENTRY_HEADER_LEN: usize = 56;

/// One frame of a WAL file, as parsed by the test.
#[derive(Debug, Clone, Copy)]
struct Frame {
    pos: usize,
    len: usize,
    stream: u32,
    count: u32,
    first_seq: u64,
}

fn frames(bytes: &[u8]) -> Result<Vec<Frame>> {
    let mut out = Vec::new();
    let mut pos = WAL_HEADER_LEN;
    let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
    while pos + 8 <= bytes.len() {
        let len = u32_at(pos) as usize;
        ensure!(
            len >= ENTRY_HEADER_LEN && pos + 8 + len <= bytes.len(),
            "bad frame at {pos}"
        );
        let payload = &bytes[pos + 8..pos + 8 + len];
        ensure!(
            crc32c::crc32c(payload) == u32_at(pos + 4),
            "frame at {pos} already damaged"
        );
        out.push(Frame {
            pos,
            len,
            stream: u32::from_le_bytes(payload[8..12].try_into()?),
            count: u32::from_le_bytes(payload[12..16].try_into()?),
            first_seq: u64::from_le_bytes(payload[24..32].try_into()?),
        });
        pos += 8 + len;
    }
    Ok(out)
}

fn wal_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "wal"))
        .collect();
    files.sort();
    Ok(files)
}

#[test]
fn hub_wal_bit_flip_is_detected_and_the_rest_served() -> Result<()> {
    let root = tempfile::Builder::new().prefix("trb-hubflip-").tempdir()?;
    let pki = Pki::init(root.path().join("pki"))?;
    let cert = pki.issue("dev-flip", None)?;
    let mut hub_spec = HubSpec::new(root.path());
    // Small segments, so the log rolls and the oldest files are sealed.
    hub_spec.extra_toml = "[wal]\nsegment_bytes_max = \"1 MiB\"\n".into();
    let mut hub = hub_spec.start(&pki)?;
    let mut agent_spec = AgentSpec::new(root.path(), "agent", cert, Some(hub_spec.quic));
    agent_spec.streams = vec!["telemetry".into(), "other".into()];
    let _agent = agent_spec.start()?;
    let producer = Producer::new("dev-flip", agent_spec.http);
    let mut ledger = Ledger::new();
    for round in 0..10u64 {
        ingest(
            &producer,
            &mut ledger,
            "telemetry",
            &blob_batch("t", round * 100, 100),
        )?;
        ingest(
            &producer,
            &mut ledger,
            "other",
            &blob_batch("o", round * 100, 100),
        )?;
        // One block per batch: wait for each round, so blocks stay small and files roll.
        cluster::wait_caught_up(agent_spec.http, WAIT)?;
    }
    hub.terminate(STOP)?;

    // The fault: one byte of the second block of the oldest, sealed WAL file.
    let wal_dir = hub_spec.data_dir.join("wal");
    let files = wal_files(&wal_dir)?;
    ensure!(files.len() >= 3, "the WAL did not roll: {files:?}");
    let mut bytes = std::fs::read(&files[0])?;
    let parsed = frames(&bytes)?;
    ensure!(parsed.len() >= 2, "{parsed:?}");
    let victim = parsed[1];
    let at = victim.pos + 8 + ENTRY_HEADER_LEN + (victim.len - ENTRY_HEADER_LEN) / 2;
    bytes[at] ^= 0x04;
    std::fs::write(&files[0], &bytes)?;
    let payload = &bytes[victim.pos + 8..victim.pos + 8 + victim.len];
    let stored_crc = u32::from_le_bytes(bytes[victim.pos + 4..victim.pos + 8].try_into()?);
    ensure!(
        crc32c::crc32c(payload) != stored_crc,
        "the flip did not damage the frame"
    );
    // Other frames of every file are intact: the damage is exactly one block.
    for file in &files[1..] {
        frames(&std::fs::read(file)?)?;
    }

    hub.restart()?;
    hub.wait_http_ok(hub_spec.http, "/healthz", cluster::START_TIMEOUT)?;
    let metrics = http::get(hub_spec.http, "/metrics")?.text();
    let scrubbed = metrics.contains("tributary_hub_quarantined_blocks");
    let (mut damaged_stream, mut intact_stream) = (None, Vec::new());
    if scrubbed {
        wait_until(WAIT, "the scrubber to quarantine the damaged block", || {
            cluster::fetch_metric(hub_spec.http, "tributary_hub_quarantined_blocks")
                .is_ok_and(|n| n >= 1.0)
        })?;
        ensure!(
            cluster::fetch_metric(hub_spec.http, "tributary_hub_quarantined_blocks")? == 1.0,
            "more than the one damaged block was quarantined"
        );
        let list = std::fs::read_to_string(hub_spec.data_dir.join("quarantine.json"))?;
        ensure!(
            list.contains(&format!("\"first_seq\": {}", victim.first_seq)),
            "quarantine.json does not list seq {}: {list}",
            victim.first_seq
        );
    }
    for stream in ["telemetry", "other"] {
        match cluster::read_stream(hub_spec.http, stream) {
            Ok(records) => {
                let report = ledger.check_streams(&[stream], records);
                eprintln!("{stream}: {}", report.summary());
                if report.is_ok() {
                    intact_stream.push(stream);
                    continue;
                }
                // Only the quarantined block's records may be missing, nothing else wrong.
                ensure!(
                    scrubbed
                        && report.missing == victim.count as usize
                        && report.duplicates + report.mismatched + report.unexpected == 0,
                    "{stream}: more than the damaged block went wrong: {}",
                    report.summary()
                );
                damaged_stream = Some(stream);
            }
            Err(error) => {
                let text = format!("{error:#}");
                ensure!(
                    !scrubbed && (text.contains("damaged") || text.contains("checksum")),
                    "{stream}: the read failed without naming the damage: {text}"
                );
                damaged_stream = Some(stream);
            }
        }
    }
    ensure!(
        damaged_stream.is_some() && intact_stream.len() == 1,
        "expected one damaged and one intact stream (victim: {victim:?}), intact: {intact_stream:?}"
    );
    eprintln!(
        "damaged block: stream id {} seqs {}..={} in {}; scrubber hooked: {scrubbed}",
        victim.stream,
        victim.first_seq,
        victim.first_seq + u64::from(victim.count) - 1,
        files[0].display()
    );
    Ok(())
}
