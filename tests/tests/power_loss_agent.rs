//! Power loss under the real `edge-agent`: its data directory is on the fault filesystem
//! (`tributary_tests::faultfs`), producers post keyed batches over HTTP and retry, and the power
//! is cut at random moments: unsynced writes dropped, the last write torn, zeros for unsynced
//! appends, or a random subset of later writes kept without earlier ones. After each cut the
//! agent is killed, the filesystem comes back with only what survived, and the agent restarts.
//!
//! At the end, after one more cut, the agent's log (read with `edge-agent inspect`) must hold:
//! - every acknowledged record exactly once, at the seq it was acknowledged with, with its
//!   content (the ledger checker);
//! - every batch whose answer was lost and that was retried with its `Idempotency-Key`: once,
//!   and the retry's answer names the seqs it was stored at (a retry that stored it again, or
//!   answered other seqs, shows as a duplicate or a content mismatch);
//! - every batch whose answer was lost and that was abandoned: whole or absent.
//!
//! Then every acknowledged key is sent again: each must be answered as a replay with the
//! original seqs, after all those power cuts.
//!
//! 20 cuts by default, 500 with `TRIBUTARY_SOAK=1`. The seed is printed; `TRIBUTARY_SEED=<n>`
//! replays the same cut moments and modes (the processes' own timing still varies), and
//! `TRIBUTARY_KEEP=1` keeps the directory with the agent's log. The faults must have happened:
//! the filesystem counts what each cut dropped, tore or reordered, and the producers count the
//! requests a cut left without an answer; both must be above zero.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use tributary_tests::chaos::{seed, soak};
use tributary_tests::cluster::{self, AgentSpec, DeviceCert};
use tributary_tests::faultfs::{CutMode, FaultFs};
use tributary_tests::http;
use tributary_tests::ledger::{IngestAck, Ledger, ObservedRecord, SentRecord};
use tributary_tests::procs::{Proc, bin_path, wait_until};
use tributary_tests::tier2;

const STREAM: &str = "telemetry";
const DEVICE: &str = "dev-0";
const PRODUCERS: u64 = 2;
/// How long a batch whose answer was lost is retried before the test gives up on the agent.
const RETRY_FOR: Duration = Duration::from_secs(120);
/// The longest pause of a producer between two batches under `TRIBUTARY_SOAK=1`: it bounds how
/// much the ledger and the in-memory filesystem hold after 500 cuts (unpaced, they outgrew
/// 24 GiB). CI runs unpaced.
const SOAK_PAUSE_MAX: Duration = Duration::from_millis(80);

/// A keyed batch as a producer built it.
#[derive(Debug, Clone)]
struct Batch {
    id: u64,
    key: String,
    records: Vec<SentRecord>,
    body: Vec<u8>,
}

/// What one post came to.
#[derive(Debug)]
enum Answer {
    Stored {
        ack: IngestAck,
        replayed: bool,
    },
    /// No answer, a 5xx, or a 503: the batch may or may not be stored.
    Lost(String),
    /// 409: the same key is still being served; try again.
    Busy,
}

/// What the producers saw, shared between them (one ledger: they share one stream's seqs).
#[derive(Debug, Default)]
struct Seen {
    ledger: Ledger,
    /// Each acknowledged batch (its body, not its records), its answer, and whether a retry gave
    /// that answer.
    acked: Vec<(Batch, IngestAck, bool)>,
    abandoned: Vec<Batch>,
    /// Requests a cut left without an answer.
    lost: u64,
    /// Lost answers that a keyed retry later answered.
    retried: u64,
    /// Immediate resends of an acknowledged key, each checked against the first answer.
    resent: u64,
    errors: Vec<String>,
}

#[test]
fn agent_survives_power_cuts() -> Result<()> {
    let seed = seed();
    println!("power_loss_agent seed {seed} (replay with TRIBUTARY_SEED={seed})");
    let cuts = if soak() { 500 } else { 20 };
    run(seed, cuts).with_context(|| {
        format!(
            "seed {seed}: replay with TRIBUTARY_SEED={seed} cargo test -p tributary-tests \
             --test power_loss_agent"
        )
    })
}

fn run(seed: u64, cuts: usize) -> Result<()> {
    let (_scratch, root) = tier2::scratch_dir("trb-powerloss-agent-")?;
    let mut fs = FaultFs::mount(root.join("mnt"))?;
    let data_dir = fs.path().join("agent-data");
    std::fs::create_dir(&data_dir)?;
    std::fs::File::open(fs.path())?.sync_all()?;
    let cert = DeviceCert {
        id: DEVICE.into(),
        dir: root.join("no-certs"),
    };
    let mut spec = AgentSpec::new(&root, DEVICE, cert, None);
    spec.data_dir = data_dir;
    // Small segments and blocks: rolls, seals and multi-block batches all the time.
    spec.extra_toml =
        "[storage]\nsegment_bytes_max = \"256KiB\"\nblock_records_max = \"64\"\n".into();
    let mut agent = spec.start()?;

    let seen = Arc::new(Mutex::new(Seen::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let producers: Vec<_> = (0..PRODUCERS)
        .map(|p| {
            let (seen, stop, addr) = (Arc::clone(&seen), Arc::clone(&stop), spec.http);
            std::thread::spawn(move || produce(p, addr, seed ^ (p + 1), &seen, &stop))
        })
        .collect();

    let mut rng = StdRng::seed_from_u64(seed);
    let mut landed = 0u64;
    for _ in 0..cuts {
        std::thread::sleep(Duration::from_millis(rng.random_range(100..1200)));
        landed += u64::from(power_cycle(&mut fs, &mut agent, &spec, &mut rng)? > 0);
    }
    stop.store(true, Ordering::SeqCst);
    power_cycle(&mut fs, &mut agent, &spec, &mut rng)?;
    for producer in producers {
        producer
            .join()
            .map_err(|_| anyhow::anyhow!("a producer panicked"))??;
    }
    let mut seen = std::mem::take(&mut *seen.lock().unwrap());
    check_replays(&spec, &mut seen)?;
    // The replays must not have changed anything, and what was acknowledged must survive
    // one more cut.
    power_cycle(&mut fs, &mut agent, &spec, &mut rng)?;
    agent.kill9()?;
    let observed = inspect(&spec)?;
    report(seed, &fs, landed, cuts, &seen, &observed, &agent)
}

/// Cuts the power in a random mode, kills the agent, brings the filesystem back and restarts
/// the agent. Returns the faults the cut applied.
fn power_cycle(
    fs: &mut FaultFs,
    agent: &mut Proc,
    spec: &AgentSpec,
    rng: &mut StdRng,
) -> Result<u64> {
    let mode = CutMode::ALL[rng.random_range(0..CutMode::ALL.len())];
    let counts = fs.power_cut(mode, rng);
    agent.kill9()?;
    fs.restart()?;
    agent.restart()?;
    agent
        .wait_http_ok(spec.http, "/healthz", cluster::START_TIMEOUT)
        .with_context(|| format!("the agent did not come back after a {mode:?} cut"))?;
    Ok(counts.faults())
}

/// One producer: keyed batches until `stop`; a lost answer is retried with the same key until
/// answered (three times in four) or abandoned; one ack in eight is resent at once.
fn produce(
    producer: u64,
    addr: SocketAddr,
    seed: u64,
    seen: &Mutex<Seen>,
    stop: &AtomicBool,
) -> Result<()> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut n = 0u64;
    while !stop.load(Ordering::SeqCst) {
        if soak() {
            std::thread::sleep(rng.random_range(Duration::ZERO..SOAK_PAUSE_MAX));
        }
        let batch = make_batch(producer, n, &mut rng);
        n += 1;
        match post(addr, &batch) {
            Answer::Stored { ack, replayed } => {
                ensure!(!replayed, "batch {} replayed on its first post", batch.key);
                acked(seen, &batch, ack.clone(), false)?;
                if rng.random_ratio(1, 8) {
                    resend(addr, &batch, &ack, seen);
                }
            }
            Answer::Busy => bail!("a fresh key {} answered 409", batch.key),
            Answer::Lost(_) => {
                seen.lock().unwrap().lost += 1;
                if rng.random_ratio(1, 4) {
                    abandon(seen, batch);
                } else {
                    let ack = retry_until_answered(addr, &batch)?;
                    acked(seen, &batch, ack, true)?;
                }
            }
        }
    }
    Ok(())
}

fn make_batch(producer: u64, n: u64, rng: &mut StdRng) -> Batch {
    let id = (producer << 32) | n;
    // Mostly small batches, some far larger than a block (64 records).
    let count = if rng.random_ratio(1, 6) {
        rng.random_range(200..1500)
    } else {
        rng.random_range(1..60)
    };
    let records: Vec<SentRecord> = (0..count)
        .map(|i| {
            SentRecord::new(
                format!("k{}", i % 8),
                1_700_000_000_000_000_000 + (id as i64 % 1_000_000) * 10_000 + i as i64,
                json!({ "batch": id, "i": i, "pad": "x".repeat(16) }),
            )
        })
        .collect();
    let body = SentRecord::ndjson(&records);
    Batch {
        id,
        key: format!("p{producer}-b{n}"),
        records,
        body,
    }
}

fn post(addr: SocketAddr, batch: &Batch) -> Answer {
    let path = format!("/v1/streams/{STREAM}/records");
    let headers = [
        ("Content-Type", "application/x-ndjson"),
        ("Idempotency-Key", batch.key.as_str()),
    ];
    let response = match http::request_timeout(
        addr,
        "POST",
        &path,
        &headers,
        Some(&batch.body),
        http::TIMEOUT,
    ) {
        Ok(response) => response,
        Err(error) => return Answer::Lost(format!("{error:#}")),
    };
    match response.status {
        200..=299 => match serde_json::from_slice::<IngestAck>(&response.body) {
            Ok(ack) => Answer::Stored {
                ack,
                replayed: response.header("idempotency-replayed") == Some("true"),
            },
            Err(error) => Answer::Lost(format!("an ack that does not parse: {error}")),
        },
        409 => Answer::Busy,
        status => Answer::Lost(format!("status {status}: {}", response.text())),
    }
}

/// Retries a keyed batch whose answer was lost until the agent answers it.
fn retry_until_answered(addr: SocketAddr, batch: &Batch) -> Result<IngestAck> {
    let mut last = String::new();
    let mut answer = None;
    wait_until(
        RETRY_FOR,
        &format!("an answer for batch {}", batch.key),
        || {
            match post(addr, batch) {
                Answer::Stored { ack, .. } => answer = Some(ack),
                Answer::Busy => last = "409".into(),
                Answer::Lost(reason) => last = reason,
            }
            answer.is_some()
        },
    )
    .with_context(|| format!("last answer: {last}"))?;
    answer.context("answered")
}

fn acked(seen: &Mutex<Seen>, batch: &Batch, ack: IngestAck, retried: bool) -> Result<()> {
    let mut seen = seen.lock().unwrap();
    seen.ledger.record_ack(DEVICE, &ack, &batch.records)?;
    seen.retried += u64::from(retried);
    // The records are in the ledger already; the body is kept for the resends after the cuts.
    let kept = Batch {
        id: batch.id,
        key: batch.key.clone(),
        records: Vec::new(),
        body: batch.body.clone(),
    };
    seen.acked.push((kept, ack, retried));
    Ok(())
}

fn abandon(seen: &Mutex<Seen>, batch: Batch) {
    let mut seen = seen.lock().unwrap();
    seen.ledger.record_maybe(DEVICE, STREAM, &batch.records);
    seen.abandoned.push(batch);
}

/// Sends an acknowledged batch again with its key: it must be a replay of the first answer
/// (unless a cut takes this answer too).
fn resend(addr: SocketAddr, batch: &Batch, first: &IngestAck, seen: &Mutex<Seen>) {
    let answer = post(addr, batch);
    let mut seen = seen.lock().unwrap();
    match answer {
        Answer::Stored { ack, replayed } => {
            seen.resent += 1;
            if ack != *first || !replayed {
                let error = format!(
                    "batch {}: resent at once, answered {ack:?} (replayed: {replayed}), first \
                     answer {first:?}",
                    batch.key
                );
                seen.errors.push(error);
            }
        }
        Answer::Busy | Answer::Lost(_) => {}
    }
}

/// Every acknowledged key once more, after all the cuts: each a replay with the original seqs.
fn check_replays(spec: &AgentSpec, seen: &mut Seen) -> Result<()> {
    for (batch, first, _) in &seen.acked {
        match post(spec.http, batch) {
            Answer::Stored { ack, replayed } if ack == *first && replayed => {}
            Answer::Stored { ack, replayed } => seen.errors.push(format!(
                "batch {} resent after the cuts: answered {ack:?} (replayed: {replayed}), \
                 acknowledged as {first:?}",
                batch.key
            )),
            other => bail!("batch {} resent after the cuts: {other:?}", batch.key),
        }
    }
    Ok(())
}

/// The agent's log as `edge-agent inspect` prints it, without the key field the agent adds to
/// the last record of each keyed batch.
fn inspect(spec: &AgentSpec) -> Result<Vec<ObservedRecord>> {
    let output = std::process::Command::new(bin_path("edge-agent"))
        .args(["inspect", "--stream", STREAM, "--config"])
        .arg(&spec.config)
        .output()
        .context("running edge-agent inspect")?;
    ensure!(
        output.status.success(),
        "edge-agent inspect failed with {}: {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    // Gap markers (ranges recovery dropped or quarantined) go to stderr.
    for gap in String::from_utf8_lossy(&output.stderr)
        .lines()
        .filter(|l| l.contains("gap:"))
    {
        println!("power_loss_agent: inspect reports {gap}");
    }
    let mut observed = Vec::new();
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let mut value: Value =
            serde_json::from_str(line).with_context(|| format!("inspect line {line:?}"))?;
        if let Some(fields) = value.get_mut("fields").and_then(Value::as_object_mut) {
            fields.remove("_idempotency");
        }
        value["device"] = DEVICE.into();
        observed.push(ObservedRecord::from_json(STREAM, &value)?);
    }
    Ok(observed)
}

/// Abandoned batches that landed in part.
fn torn_batches(seen: &Seen, observed: &[ObservedRecord]) -> Vec<String> {
    let mut landed: std::collections::HashMap<u64, usize> = std::collections::HashMap::new();
    for record in observed {
        if let Some(id) = record.fields.get("batch").and_then(Value::as_u64) {
            *landed.entry(id).or_default() += 1;
        }
    }
    seen.abandoned
        .iter()
        .filter_map(|batch| {
            let n = landed.get(&batch.id).copied().unwrap_or(0);
            (n != 0 && n != batch.records.len()).then(|| {
                format!(
                    "abandoned batch {} landed {n} of its {} records",
                    batch.key,
                    batch.records.len()
                )
            })
        })
        .collect()
}

/// Acknowledged batches with records missing, and whether their answer came from a retry
/// (the first post's answer lost to a cut): says which path lost them.
fn incomplete_acked(seen: &Seen, observed: &[ObservedRecord]) -> Vec<String> {
    let held: std::collections::HashSet<(u64, u64)> =
        observed.iter().map(|r| (r.epoch, r.seq)).collect();
    seen.acked
        .iter()
        .filter_map(|(batch, ack, retried)| {
            let missing = (ack.first_seq..=ack.last_seq)
                .filter(|seq| !held.contains(&(ack.epoch, *seq)))
                .count();
            let how = if *retried {
                "answered to a retry after a cut took the first answer"
            } else {
                "answered to its first post"
            };
            (missing > 0).then(|| {
                format!(
                    "acknowledged batch {} ({} records, seqs {}..={}, {how}): {missing} missing",
                    batch.key, ack.count, ack.first_seq, ack.last_seq
                )
            })
        })
        .collect()
}

fn report(
    seed: u64,
    fs: &FaultFs,
    landed: u64,
    cuts: usize,
    seen: &Seen,
    observed: &[ObservedRecord],
    agent: &Proc,
) -> Result<()> {
    let counts = fs.counts();
    println!(
        "power_loss_agent: seed {seed}; {cuts} cuts (+2 at the end), {landed} with unsynced \
         state; faults {counts:?}; {} batches acknowledged, {} answers lost ({} retried, {} \
         abandoned), {} immediate resends; {} records in the log",
        seen.acked.len(),
        seen.lost,
        seen.retried,
        seen.abandoned.len(),
        seen.resent,
        observed.len()
    );
    let mut failures = seen.errors.clone();
    let check = seen.ledger.check(observed.iter().cloned());
    if !check.is_ok() {
        failures.push(check.summary());
    }
    failures.extend(torn_batches(seen, observed));
    failures.extend(incomplete_acked(seen, observed));
    if counts.faults() == 0 || landed == 0 {
        failures.push("no power cut found unsynced state to lose".into());
    }
    if seen.lost == 0 {
        failures.push("no power cut left a request without an answer".into());
    }
    if seen.acked.is_empty() {
        failures.push("nothing was acknowledged".into());
    }
    if !failures.is_empty() {
        bail!("{}\n{}", failures.join("\n"), agent.log_tail(30));
    }
    Ok(())
}
