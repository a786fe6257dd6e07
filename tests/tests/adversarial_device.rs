//! An adversarial device against the real hub binary, one attack at a time, while two honest
//! agents (real `edge-agent` processes fed over HTTP) ingest alongside.
//!
//! Every scenario asserts, for the hub:
//! - it stays up: the process is alive and `/healthz` answers;
//! - its memory stays within `ingest.memory_bytes_max` plus [`OVERHEAD_BYTES`]: VmRSS is sampled
//!   every 5 ms during the attack, and VmHWM (the kernel's peak) is checked at the end. The
//!   overhead is measured in the same run, on the idle hub with both honest devices connected,
//!   and must itself fit the stated constant;
//! - the honest devices keep their exactly-once ledger (`tributary_tests::ledger`) and their
//!   throughput: a round of records ingested during the attack takes at most twice as long as
//!   the baseline round measured just before it (a ratio within one run, not an absolute time);
//! - the attacker gets a documented protocol error code (`docs/protocol/sync.md`) and a hub
//!   `/metrics` counter counts it.
//!
//! All scenarios share one hub, in sequence; each attacker uses a device identity of its own,
//! so no scenario inherits another's per-device state. The test reports every scenario and
//! fails naming those that failed. `TRIBUTARY_ADVERSARY_ONLY=<substring>` runs only the
//! scenarios whose name contains it; `TRIBUTARY_SOAK=1` makes every attack larger.
//!
//! Run: `cargo test -p tributary-tests --test adversarial_device -- --nocapture`.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use serde_json::json;
use sync::protocol::frame::{Hello, LANES_MAX};
use sync::protocol::{Backlog, BacklogEntry, ErrorCode, Frame, GapMarker, GapReason};
use sync::record::{Record, Value};
use tributary_tests::adversary::{
    self, Adversary, Ending, RssSampler, block_frame, bombs, hello, lane,
};
use tributary_tests::cluster::{self, AgentSpec, HubSpec, Pki};
use tributary_tests::http;
use tributary_tests::ledger::{Ledger, ObservedRecord, PostOutcome, Producer, SentRecord};
use tributary_tests::procs::{self, Proc};

/// The honest devices' stream.
const STREAM: &str = "telemetry";
/// The hub's ingest budget in this test (`ingest.memory_bytes_max`).
const MEMORY_BYTES_MAX: u64 = 48 << 20;
/// What the hub may hold beyond its ingest budget: the runtime and its threads, SQLite, the
/// WAL writer, the HTTP server, the readers' block cache (`read.cache_bytes_max`, 8 MiB here)
/// and a page, and two honest sessions. Measured on the idle hub in every run
/// (and asserted below this); docs/security.md gives the figure.
const OVERHEAD_BYTES: u64 = 64 << 20;
/// The hub's limits here: small, so that the bombs trip them quickly.
/// `control_idle_timeout` is the hub's minimum (15 s), still above the agent's 10 s keep-alive
/// ping, so the scenarios that end in `IDLE_TIMEOUT` take no longer than they must.
const HUB_TOML: &str = "[ingest]\nmemory_bytes_max = \"48MiB\"\nblock_bytes_max = \"2MiB\"\n\
    block_raw_bytes_max = \"8MiB\"\nblock_decoded_bytes_max = \"16MiB\"\n\
    hello_timeout = \"2s\"\ncontrol_idle_timeout = \"15s\"\n\n[read]\ncache_bytes_max = \"8MiB\"\n\n[tier2]\nchunk_age_max = \"2s\"\n";
/// Records each honest device ingests per round.
const ROUND_RECORDS: u64 = 10_000;
/// Records per ingest request.
const BATCH: usize = 250;
/// Deadline of every wait.
const WAIT: Duration = Duration::from_secs(60);
/// The hub's default `ingest.blocks_in_flight_max`: data streams one connection may have open.
const BLOCKS_IN_FLIGHT_MAX: usize = 32;
/// How much slower an honest round may be under attack than its baseline.
const SLOWDOWN_MAX: f64 = 2.0;

fn soak() -> bool {
    std::env::var_os("TRIBUTARY_SOAK").is_some_and(|v| v == "1")
}

/// `small` normally, `big` under `TRIBUTARY_SOAK=1`.
fn scale(small: usize, big: usize) -> usize {
    if soak() { big } else { small }
}

/// One honest device: a real agent and the producer that feeds it.
struct Honest {
    spec: AgentSpec,
    proc: Proc,
    producer: Producer,
    ledger: Ledger,
}

/// The hub, the honest devices, and the runtime the attackers run on.
struct Suite {
    /// Holds the hub's and the agents' directories for as long as the suite runs.
    _root: tempfile::TempDir,
    pki: Pki,
    hub_spec: HubSpec,
    hub: Proc,
    honest: Vec<Honest>,
    /// Records each honest device has ingested so far (their next index).
    ingested: u64,
    runtime: tokio::runtime::Runtime,
    attackers: u32,
    /// What the hub holds of the honest stream, read so far, and the offset to read on from.
    observed: Vec<ObservedRecord>,
    next_offset: u64,
}

/// What an attack reports: how the hub ended each of its connections, and a line for the log.
struct Outcome {
    endings: Vec<Ending>,
    note: String,
}

/// What a scenario expects of the hub.
struct Expect {
    /// Every ending must carry one of these codes (and there is at least one ending).
    codes: &'static [ErrorCode],
    /// The `/metrics` counter that must rise by at least one per refused connection.
    metric: &'static str,
}

impl Suite {
    fn start() -> Result<Suite> {
        let root = tempfile::Builder::new()
            .prefix("trb-adversary-")
            .tempdir()?;
        let pki = Pki::init(root.path().join("pki"))?;
        let mut hub_spec = HubSpec::new(root.path());
        hub_spec.extra_toml = HUB_TOML.into();
        let hub = hub_spec.start(&pki)?;
        let mut honest = Vec::new();
        for name in ["honest-a", "honest-b"] {
            let cert = pki.issue(name, None)?;
            let spec = AgentSpec::new(root.path(), name, cert, Some(hub_spec.quic));
            let proc = spec.start()?;
            let producer = Producer::new(name, spec.http);
            honest.push(Honest {
                spec,
                proc,
                producer,
                ledger: Ledger::new(),
            });
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        Ok(Suite {
            _root: root,
            pki,
            hub_spec,
            hub,
            honest,
            ingested: 0,
            runtime,
            attackers: 0,
            observed: Vec::new(),
            next_offset: 0,
        })
    }

    /// A fresh hub and honest devices after one round, and the idle hub's VmRSS: the fixed
    /// overhead, measured, which must fit [`OVERHEAD_BYTES`]. Each scenario gets its own hub,
    /// so none is judged on memory an earlier one left with the allocator.
    fn idle() -> Result<(Suite, u64)> {
        let mut suite = Suite::start()?;
        suite.honest_round()?;
        let idle = adversary::vm_rss(suite.hub.pid())?;
        ensure!(
            idle <= OVERHEAD_BYTES,
            "the idle hub takes {} MiB, more than the stated overhead of {} MiB",
            idle >> 20,
            OVERHEAD_BYTES >> 20
        );
        Ok((suite, idle))
    }

    fn hub_http(&self) -> SocketAddr {
        self.hub_spec.http
    }

    /// A fresh attacker identity, issued by the fleet CA like any device.
    fn attacker(&mut self, role: &str) -> Result<Arc<Adversary>> {
        self.attackers += 1;
        let id = format!("evil-{role}-{}", self.attackers);
        let cert = self.pki.issue(&id, None)?;
        let quic = self.hub_spec.quic;
        let _guard = self.runtime.enter();
        Ok(Arc::new(Adversary::new(quic, &cert)?))
    }

    /// Both honest devices ingest [`ROUND_RECORDS`] each, at once, until the hub acknowledged
    /// everything; returns how long that took.
    fn honest_round(&mut self) -> Result<Duration> {
        let from = self.ingested;
        let started = Instant::now();
        std::thread::scope(|scope| {
            let workers: Vec<_> = self
                .honest
                .iter_mut()
                .map(|h| scope.spawn(move || ingest_round(h, from)))
                .collect();
            for w in workers {
                w.join()
                    .map_err(|_| anyhow::anyhow!("a producer panicked"))??;
            }
            Ok::<_, anyhow::Error>(())
        })?;
        for h in &self.honest {
            cluster::wait_caught_up(h.spec.http, WAIT).with_context(|| {
                format!("{} did not catch up\n{}", h.spec.name, h.proc.log_tail(20))
            })?;
        }
        self.ingested += ROUND_RECORDS;
        Ok(started.elapsed())
    }

    /// The hub is alive, answers `/healthz`, and every honest ledger holds exactly once.
    fn check_hub_and_ledgers(&mut self) -> Result<()> {
        ensure!(
            self.hub.is_running(),
            "the hub died\n{}",
            self.hub.log_tail(40)
        );
        let health = http::get(self.hub_http(), "/healthz")?;
        ensure!(health.status == 200, "/healthz answered {}", health.status);
        self.read_on()?;
        let observed = &self.observed;
        for h in &self.honest {
            let mine: Vec<_> = observed
                .iter()
                .filter(|r| r.device == h.spec.name)
                .cloned()
                .collect();
            let report = h.ledger.check(mine);
            ensure!(report.is_ok(), "{}: {}", h.spec.name, report.summary());
        }
        ensure!(
            observed.iter().all(|r| r.device.starts_with("honest-")),
            "an attacker's record is in the honest stream"
        );
        Ok(())
    }

    /// Reads the honest stream on from where the last read stopped, a page at a time, so a
    /// check costs the hub one page of memory, not the whole stream.
    fn read_on(&mut self) -> Result<()> {
        loop {
            let path = format!(
                "/v1/streams/{STREAM}/records?from={}&limit=5000",
                self.next_offset
            );
            let response = http::request_timeout(self.hub_http(), "GET", &path, &[], None, WAIT)?;
            ensure!(
                response.status == 200,
                "{path}: {} {}",
                response.status,
                response.text()
            );
            let page = ObservedRecord::parse_ndjson(STREAM, &response.text())?;
            if page.is_empty() {
                return Ok(());
            }
            let next = response
                .header("x-tributary-next-offset")
                .and_then(|v| v.parse::<u64>().ok())
                .context("a page without x-tributary-next-offset")?;
            ensure!(
                next > self.next_offset,
                "next offset {next} does not advance"
            );
            self.next_offset = next;
            self.observed.extend(page);
        }
    }

    fn metric(&self, name: &str) -> Result<f64> {
        cluster::fetch_metric(self.hub_http(), name)
    }

    /// Runs `attack` alongside an honest round and checks everything the module doc lists.
    /// `attack` gets a stop flag that is set once the honest round is over; an attack that
    /// repeats itself stops then.
    fn run<F, Fut>(&mut self, name: &str, expect: Expect, attack: F) -> Result<String>
    where
        F: FnOnce(Arc<AtomicBool>) -> Fut,
        Fut: Future<Output = Result<Outcome>> + Send + 'static,
    {
        let baseline = self.honest_round()?;
        let metric_before = self.metric(expect.metric)?;
        let sampler = RssSampler::start(self.hub.pid());
        let windows = WindowSampler::start(self.hub_http());
        let stop = Arc::new(AtomicBool::new(false));
        let task = self.runtime.spawn(attack(stop.clone()));
        let during = self.honest_round();
        stop.store(true, Ordering::Relaxed);
        let outcome = self
            .runtime
            .block_on(async { tokio::time::timeout(Duration::from_secs(120), task).await })
            .context("the attack did not finish within 120 s")?
            .context("the attack task panicked")?;
        let (rss_peak, samples) = sampler.finish();
        let windows_peak = windows.finish();
        let during = during?;
        let outcome = outcome?;
        // Every check runs, so a failing scenario reports all it got wrong at once.
        let mut failures = Vec::new();
        if let Err(e) = self.check_hub_and_ledgers() {
            failures.push(format!("{e:#}"));
        }
        let bound = MEMORY_BYTES_MAX + OVERHEAD_BYTES;
        if rss_peak > bound {
            failures.push(format!(
                "hub VmRSS peaked at {} MiB during the attack, above {} MiB",
                rss_peak >> 20,
                bound >> 20
            ));
        }
        if windows_peak > MEMORY_BYTES_MAX {
            failures.push(format!(
                "the hub reserved {} MiB of QUIC receive windows, above its {} MiB budget",
                windows_peak >> 20,
                MEMORY_BYTES_MAX >> 20
            ));
        }
        let hwm = adversary::vm_hwm(self.hub.pid()).unwrap_or(u64::MAX);
        if hwm > bound {
            failures.push(format!(
                "hub VmHWM {} MiB above {} MiB",
                hwm >> 20,
                bound >> 20
            ));
        }
        let ratio = during.as_secs_f64() / baseline.as_secs_f64();
        if ratio > SLOWDOWN_MAX {
            failures.push(format!(
                "the honest round took {during:.2?} under attack, {ratio:.2}x its baseline \
                 {baseline:.2?}"
            ));
        }
        if let Err(e) = check_endings(&outcome.endings, expect.codes) {
            failures.push(format!("{e:#}"));
        }
        let metric_after = self.metric(expect.metric).unwrap_or(f64::NAN);
        let refused = outcome.endings.len() as f64;
        let counted = metric_after >= metric_before + refused.min(1.0);
        if !counted {
            failures.push(format!(
                "{} went {metric_before} -> {metric_after} for {refused} refused connections",
                expect.metric
            ));
        }
        let report = format!(
            "{name}: {}; codes {:?}; {} {metric_before} -> {metric_after}; honest round \
             {baseline:.2?} -> {during:.2?} ({ratio:.2}x); hub VmRSS peak {} MiB ({samples} \
             samples), VmHWM {} MiB; receive windows reserved at most {} KiB",
            outcome.note,
            codes_seen(&outcome.endings),
            expect.metric,
            rss_peak >> 20,
            hwm >> 20,
            windows_peak >> 10,
        );
        if failures.is_empty() {
            Ok(report)
        } else {
            bail!("{}\n    ({report})", failures.join("\n    "))
        }
    }
}

/// The hub's `tributary_hub_ingest_window_reserved_bytes`, polled on a thread while an
/// attack runs (every 50 ms: `/metrics` is not free for the hub), and its peak.
struct WindowSampler {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<u64>,
}

impl WindowSampler {
    fn start(hub: SocketAddr) -> WindowSampler {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut peak = 0u64;
            while !flag.load(Ordering::Relaxed) {
                let name = "tributary_hub_ingest_window_reserved_bytes";
                if let Ok(v) = cluster::fetch_metric(hub, name) {
                    peak = peak.max(v as u64);
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            peak
        });
        WindowSampler { stop, thread }
    }

    fn finish(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap_or(u64::MAX)
    }
}

fn ingest_round(h: &mut Honest, from: u64) -> Result<()> {
    let records: Vec<SentRecord> = (from..from + ROUND_RECORDS)
        .map(|i| {
            SentRecord::new(
                format!("{}/k{}", h.spec.name, i % 4),
                1_000 + i as i64,
                json!({ "i": i, "load": (i % 97) as f64 / 8.0 }),
            )
        })
        .collect();
    for chunk in records.chunks(BATCH) {
        match h.producer.post(&mut h.ledger, STREAM, chunk, None)? {
            PostOutcome::Acked(_) => {}
            other => bail!("{}: ingest not acknowledged: {other:?}", h.spec.name),
        }
    }
    Ok(())
}

fn check_endings(endings: &[Ending], codes: &[ErrorCode]) -> Result<()> {
    ensure!(
        !endings.is_empty(),
        "the attack reported no connection the hub ended"
    );
    let wanted: Vec<u16> = codes.iter().map(|c| c.to_u16()).collect();
    for e in endings {
        ensure!(
            e.code().is_some_and(|c| wanted.contains(&c)),
            "the hub ended an attacker's connection with {:?} (frame {:?}, close {:?}: {}), \
             expected one of {codes:?}",
            e.code().map(ErrorCode::from_u16),
            e.error_frame,
            e.close_code,
            e.reason
        );
    }
    Ok(())
}

fn codes_seen(endings: &[Ending]) -> Vec<(u16, usize)> {
    let mut seen: std::collections::BTreeMap<u16, usize> = Default::default();
    for e in endings {
        *seen.entry(e.code().unwrap_or(0)).or_default() += 1;
    }
    seen.into_iter().collect()
}

/// Sends `block` on a fresh session of `adv` again and again (as an agent resends after every
/// reconnect) until `stop`; returns every ending.
async fn resend_until_stopped(
    adv: Arc<Adversary>,
    stream: &'static str,
    epoch: u64,
    block: Vec<u8>,
    stop: Arc<AtomicBool>,
) -> Result<Outcome> {
    let frame = block_frame(stream, block);
    let mut endings = Vec::new();
    while endings.is_empty() || !stop.load(Ordering::Relaxed) {
        let mut session = adv.welcomed(epoch, vec![lane(stream, epoch, 1, 1)]).await?;
        session.send_data(&frame).await?;
        endings.push(session.ending(WAIT).await?);
    }
    let note = format!("{} sends of a {}-byte block", endings.len(), frame.len());
    Ok(Outcome { endings, note })
}

type Scenario = fn(&mut Suite) -> Result<String>;

fn decode_bomb_long_key(s: &mut Suite) -> Result<String> {
    let adv = s.attacker("key")?;
    let bomb = bombs::long_key(7, 4096, scale(200_000, 1_000_000) as u32);
    s.run(
        "decode bomb: one 4 KiB dictionary key x many records",
        decoded_too_large(),
        |stop| resend_until_stopped(adv, "evil", 7, bomb, stop),
    )
}

fn decode_bomb_field_names(s: &mut Suite) -> Result<String> {
    let adv = s.attacker("names")?;
    let bomb = bombs::many_field_names(7, scale(20_000, 60_000), 100, 1_000);
    s.run(
        "decode bomb: many distinct field names",
        decoded_too_large(),
        |stop| resend_until_stopped(adv, "evil", 7, bomb, stop),
    )
}

fn decode_bomb_long_string(s: &mut Suite) -> Result<String> {
    let adv = s.attacker("string")?;
    let bomb = bombs::long_string(7, 1 << 20, scale(100_000, 1_000_000) as u32);
    s.run(
        "decode bomb: one 1 MiB string x many records",
        decoded_too_large(),
        |stop| resend_until_stopped(adv, "evil", 7, bomb, stop),
    )
}

fn epoch_flood(s: &mut Suite) -> Result<String> {
    let adv = s.attacker("epochs")?;
    let epochs = scale(3_000, 30_000) as u64;
    s.run(
        "epoch flood: one-record blocks in thousands of new epochs",
        quota_exceeded(),
        move |_stop| async move {
            let records = bombs::records(1, "ep");
            let mut session = adv.welcomed(1, vec![lane("evil", 1, 1, 1)]).await?;
            let mut sent = 0;
            for epoch in 1..=epochs {
                let frame = block_frame("evil", bombs::honest(epoch, 1, &records));
                if session.send_data(&frame).await.is_err() {
                    break;
                }
                sent += 1;
            }
            let ending = session.ending(WAIT).await?;
            Ok(Outcome {
                note: format!("{sent} epochs sent"),
                endings: vec![ending],
            })
        },
    )
}

fn field_flood_one_block(s: &mut Suite) -> Result<String> {
    let adv = s.attacker("fields")?;
    let record = bombs::wide_record("f", 20_000);
    let block = bombs::honest(7, 1, &[record]);
    s.run(
        "field flood: one record with 20,000 fields",
        Expect {
            codes: &[
                ErrorCode::QuotaExceeded,
                ErrorCode::BadBlock,
                ErrorCode::DecodedTooLarge,
            ],
            metric: "tributary_hub_quota_refused_total",
        },
        |stop| resend_until_stopped(adv, "evil-fields", 7, block, stop),
    )
}

fn connection_flood(s: &mut Suite) -> Result<String> {
    let adv = s.attacker("conns")?;
    let probe = s.attacker("probe")?;
    let n = scale(300, 2_000);
    s.run(
        "connection flood: hundreds of sessions with one certificate",
        Expect {
            codes: &[ErrorCode::Superseded],
            metric: "tributary_hub_connections_superseded_total",
        },
        move |_stop| async move {
            let hello = Frame::Hello(hello(7, vec![lane("evil", 7, 1, 1)])).encode();
            let mut conns = Vec::new();
            for _ in 0..n {
                let conn = adv.connect().await?;
                // The hub may supersede a connection before its Hello is out: that is fine.
                if let Ok((mut control, answers)) = conn.open_bi().await {
                    let _ = control.write_all(&hello).await;
                    conns.push((conn, Some((control, answers))));
                } else {
                    conns.push((conn, None));
                }
            }
            // A device that connects now is served: the flood holds one slot, not hundreds.
            let fresh = probe.welcomed(1, vec![lane("probe", 1, 0, 0)]).await?;
            fresh.conn.close(0u32.into(), b"probe done");
            let mut endings = Vec::new();
            let mut open = 0;
            for (conn, _streams) in &conns {
                match adversary::connection_ending(conn, Duration::from_secs(10)).await {
                    Ok(e) => endings.push(e),
                    Err(_) => open += 1,
                }
            }
            ensure!(
                open <= 1,
                "{open} connections of one device still open (ingest.connections_per_device_max 1)"
            );
            Ok(Outcome {
                note: format!(
                    "{n} connections, {open} left open; a fresh device was welcomed meanwhile"
                ),
                endings,
            })
        },
    )
}

fn stalled_control_stream(s: &mut Suite) -> Result<String> {
    let never = s.attacker("no-control")?;
    let silent = s.attacker("no-hello")?;
    s.run(
        "stalled control stream: never opened, or opened without a Hello",
        Expect {
            codes: &[ErrorCode::HelloTimeout],
            metric: "tributary_hub_connections_hello_timeout_total",
        },
        |_stop| async move {
            let bare = never.connect().await?;
            let conn = silent.connect().await?;
            let (mut control, _answers) = conn.open_bi().await?;
            // Three bytes of a frame length, then nothing: the stream exists, the Hello never
            // comes.
            control.write_all(&[0x10, 0, 0]).await?;
            let first = adversary::connection_ending(&bare, WAIT).await?;
            let second = adversary::connection_ending(&conn, WAIT).await?;
            Ok(Outcome {
                note: "two stalled connections".into(),
                endings: vec![first, second],
            })
        },
    )
}

fn unfinished_data_streams(s: &mut Suite) -> Result<String> {
    let adv = s.attacker("unfinished")?;
    let streams = scale(1_000, 10_000);
    s.run(
        "never-finished data streams: a frame's first bytes on each of many streams",
        Expect {
            codes: UNFINISHED_CODES,
            metric: "tributary_hub_sessions_idle_timeout_total",
        },
        move |_stop| async move {
            let mut session = adv.welcomed(7, vec![lane("evil", 7, 1, 1)]).await?;
            // Each stream carries the first 64 KiB of a 1 MiB Block frame.
            let mut prefix = block_frame("evil", vec![0u8; 1 << 20]);
            prefix.truncate(64 << 10);
            let mut open = Vec::new();
            for _ in 0..streams {
                match session.open_unfinished(&prefix).await {
                    Ok(s) => open.push(s),
                    Err(_) => break,
                }
            }
            let held = open.len();
            let ending = session.ending(WAIT).await?;
            // quinn's stream limit is the quota: the device cannot open more than that.
            ensure!(
                held <= BLOCKS_IN_FLIGHT_MAX,
                "the device held {held} data streams open, above ingest.blocks_in_flight_max"
            );
            Ok(Outcome {
                note: format!("{held} of {streams} streams could be opened and held"),
                endings: vec![ending],
            })
        },
    )
}

/// Several stolen certificates at once, each connection filling its QUIC receive window
/// with never-finished data streams: what the hub buffers must stay within its budget.
fn unfinished_data_streams_many_devices(s: &mut Suite) -> Result<String> {
    let devices = scale(12, 40);
    let advs = (0..devices)
        .map(|_| s.attacker("window"))
        .collect::<Result<Vec<_>>>()?;
    s.run(
        "never-finished data streams from many devices at once, each filling its window",
        Expect {
            codes: UNFINISHED_CODES,
            metric: "tributary_hub_sessions_idle_timeout_total",
        },
        move |_stop| async move {
            let mut prefix = block_frame("evil", vec![0u8; 1 << 20]);
            prefix.truncate(64 << 10);
            let mut tasks = Vec::new();
            for adv in advs {
                let prefix = prefix.clone();
                tasks.push(tokio::spawn(async move {
                    let mut session = adv.welcomed(7, vec![lane("evil", 7, 1, 1)]).await?;
                    let mut open = Vec::new();
                    for _ in 0..400 {
                        match session.open_unfinished(&prefix).await {
                            Ok(s) => open.push(s),
                            Err(_) => break,
                        }
                    }
                    let held = open.len();
                    let ending = session.ending(WAIT).await?;
                    Ok::<_, anyhow::Error>((held, ending))
                }));
            }
            let mut endings = Vec::new();
            let mut held = 0;
            for t in tasks {
                let (h, e) = t.await??;
                held += h;
                endings.push(e);
            }
            Ok(Outcome {
                note: format!("{devices} devices held {held} unfinished streams"),
                endings,
            })
        },
    )
}

fn duplicate_sessions(s: &mut Suite) -> Result<String> {
    let adv = s.attacker("dup")?;
    let id = adv.cert.id.clone();
    let hub = s.hub_http();
    let report = s.run(
        "duplicate sessions of one device, both sending the same lane",
        Expect {
            codes: &[ErrorCode::Superseded],
            metric: "tributary_hub_connections_superseded_total",
        },
        move |_stop| async move {
            let records = bombs::records(100, "dup");
            let block = block_frame("evil-dup", bombs::honest(7, 1, &records));
            let next = block_frame("evil-dup", bombs::honest(7, 101, &records));
            let mut first = adv.welcomed(7, vec![lane("evil-dup", 7, 1, 200)]).await?;
            first.send_data(&block).await?;
            let mut second = adv
                .session(&hello(7, vec![lane("evil-dup", 7, 1, 200)]))
                .await?;
            let welcome = second.welcome(WAIT).await?;
            let mark = welcome.lanes.first().map_or(0, |(_, _, l)| l.durable_seq);
            // The newer session resumes as an agent would: the block ending at the hub's
            // mark goes on the control stream (the junction check), the rest as data.
            match mark {
                0 => second.send_data(&block).await?,
                100 => second.send_control(&block).await?,
                other => bail!("the hub's mark after one block is {other}"),
            }
            second.send_data(&next).await?;
            let _ = first.send_data(&next).await;
            let ending = first.ending(WAIT).await?;
            let acked = tokio::time::timeout(WAIT, async {
                loop {
                    if let Frame::Ack { durable_seq, .. } = second.next_frame().await?
                        && durable_seq >= 200
                    {
                        return Ok::<_, anyhow::Error>(durable_seq);
                    }
                }
            })
            .await
            .context("the newer session got no Ack for seq 200")??;
            second.conn.close(0u32.into(), b"done");
            Ok(Outcome {
                note: format!(
                    "two sessions, blocks 1..=200 from both; mark {mark} at the \
                     second Hello, acked {acked}"
                ),
                endings: vec![ending],
            })
        },
    )?;
    let stored = cluster::read_stream(hub, "evil-dup")?;
    let mut seqs: Vec<u64> = stored
        .iter()
        .filter(|r| r.device == id)
        .map(|r| r.seq)
        .collect();
    let n = seqs.len();
    ensure!(
        n == 200,
        "{n} records of {id} stored, not the 200 acknowledged"
    );
    seqs.sort_unstable();
    seqs.dedup();
    ensure!(seqs.len() == n, "a seq of {id} is stored twice");
    ensure!(
        seqs.iter().copied().eq(1..=n as u64),
        "{id}'s stored seqs are not 1..={n}: {seqs:?}"
    );
    Ok(format!("{report}; {n} records of {id} stored once each"))
}

/// What a connection that holds data streams open without finishing them may be closed with.
const UNFINISHED_CODES: &[ErrorCode] = &[ErrorCode::IdleTimeout];

fn decoded_too_large() -> Expect {
    Expect {
        codes: &[ErrorCode::DecodedTooLarge],
        metric: "tributary_hub_decoded_too_large_blocks_total",
    }
}

fn decode_bomb_understated_raw_len(s: &mut Suite) -> Result<String> {
    let adv = s.attacker("inflate")?;
    let bomb = bombs::understated_raw_len(7, scale(256 << 20, 1 << 30) as u64);
    s.run(
        "decode bomb: header understates the inflated body (4 KiB said, 256 MiB of zstd)",
        bad_block(),
        |stop| resend_until_stopped(adv, "evil", 7, bomb, stop),
    )
}

fn decode_bomb_understated_body_len(s: &mut Suite) -> Result<String> {
    let adv = s.attacker("bodylen")?;
    let bomb = bombs::understated_body_len(7, &bombs::records(500, "lie"));
    s.run(
        "decode bomb: header understates the sealed body",
        bad_block(),
        |stop| resend_until_stopped(adv, "evil", 7, bomb, stop),
    )
}

fn gap_to_u64_max(s: &mut Suite) -> Result<String> {
    let adv = s.attacker("gap")?;
    s.run(
        "gap to u64::MAX",
        Expect {
            codes: &[ErrorCode::ProtocolViolation],
            metric: "tributary_hub_sessions_ended_total{code=\"PROTOCOL_VIOLATION\"}",
        },
        |stop| async move {
            let gap = Frame::Gap {
                stream: "evil".into(),
                epoch: 7,
                gap: GapMarker {
                    first_seq: 1,
                    last_seq: u64::MAX,
                    reason: GapReason::DiskFull,
                    count: 1,
                },
            }
            .encode();
            let mut endings = Vec::new();
            while endings.is_empty() || !stop.load(Ordering::Relaxed) {
                let mut session = adv.welcomed(7, vec![lane("evil", 7, 1, 1)]).await?;
                session.send_data(&gap).await?;
                endings.push(session.ending(WAIT).await?);
            }
            Ok(Outcome {
                note: format!("{} gap frames", endings.len()),
                endings,
            })
        },
    )
}

fn stream_flood_hello(s: &mut Suite) -> Result<String> {
    let adv = s.attacker("hello-lanes")?;
    s.run(
        "stream flood: 4096 lanes of distinct streams in one Hello",
        Expect {
            codes: &[ErrorCode::LimitExceeded],
            metric: "tributary_hub_sessions_ended_total{code=\"LIMIT_EXCEEDED\"}",
        },
        |stop| async move {
            let lanes = (0..4096)
                .map(|i| lane(&format!("flood-{i}"), 7, 1, 1))
                .collect();
            let hello: Hello = hello(7, lanes);
            let mut endings = Vec::new();
            while endings.is_empty() || !stop.load(Ordering::Relaxed) {
                let mut session = adv.session(&hello).await?;
                endings.push(session.ending(WAIT).await?);
            }
            Ok(Outcome {
                note: format!("{} Hellos", endings.len()),
                endings,
            })
        },
    )
}

fn column_flood(s: &mut Suite) -> Result<String> {
    let adv = s.attacker("columns")?;
    let id = adv.cert.id.clone();
    let hub = s.hub_http();
    let blocks = scale(100, 1_000);
    s.run(
        "column flood: every block brings 500 new field names to one stream",
        quota_exceeded(),
        move |_stop| async move {
            let mut session = adv.welcomed(7, vec![lane("evil-columns", 7, 1, 1)]).await?;
            let mut sent = 0;
            for b in 0..blocks {
                let record = bombs::wide_record(&format!("c{b}_"), 500);
                let block = bombs::honest(7, b as u64 + 1, &[record]);
                if session
                    .send_data(&block_frame("evil-columns", block))
                    .await
                    .is_err()
                {
                    break;
                }
                sent += 1;
            }
            let ending = session.ending(WAIT).await?;
            // What the quota let in is tiered while memory is still sampled: a chunk of a
            // stream this wide is the expensive part.
            let tiered = tokio::task::spawn_blocking(move || wait_tiered(hub, &id, "evil-columns"))
                .await??;
            Ok(Outcome {
                note: format!("{sent} blocks of 500 new columns; {tiered} seqs tiered"),
                endings: vec![ending],
            })
        },
    )
}

/// Backlog frames of [`LANES_MAX`] entries each, every entry a new stream with absurd
/// figures, sent as fast as the hub reads them: entries past `ingest.streams_per_device_max`
/// are dropped and counted while the session goes on (docs/security.md); it must still be up
/// when the honest round is over. Then one Backlog frame that claims 2^62 entries ends it with
/// `PROTOCOL_VIOLATION`, without the hub reserving anything for them.
fn backlog_flood(s: &mut Suite) -> Result<String> {
    let adv = s.attacker("backlog")?;
    s.run(
        "backlog flood: Backlog frames of 4,096 new streams with huge figures, nonstop",
        Expect {
            codes: &[ErrorCode::ProtocolViolation],
            metric: "tributary_hub_quota_refused_total{limit=\"streams_per_device\"}",
        },
        |stop| async move {
            let mut session = adv.welcomed(7, vec![lane("evil-backlog", 7, 1, 1)]).await?;
            let entries = (0..LANES_MAX)
                .map(|i| BacklogEntry {
                    stream: format!("backlog-{i}"),
                    epoch: u64::MAX - i as u64,
                    backlog: Backlog {
                        blocks: u64::MAX,
                        bytes: u64::MAX,
                        oldest_unsent_ts: Some(i64::MIN),
                    },
                })
                .collect();
            let frame = Frame::Backlog(entries).encode();
            let mut sent = 0u64;
            while sent == 0 || !stop.load(Ordering::Relaxed) {
                session
                    .send_control(&frame)
                    .await
                    .context("the hub ended the session during the backlog flood")?;
                sent += 1;
            }
            ensure!(
                session.conn.close_reason().is_none(),
                "the hub ended the session during the backlog flood: {:?}",
                session.conn.close_reason()
            );
            session.send_control(&huge_backlog_count()).await?;
            let ending = session.ending(WAIT).await?;
            Ok(Outcome {
                note: format!(
                    "{sent} Backlog frames of {LANES_MAX} entries ({} KiB each), the session up \
                     throughout; then one claiming 2^62 entries",
                    frame.len() >> 10
                ),
                endings: vec![ending],
            })
        },
    )
}

/// Blocks whose every record names the field `v` twice, as an integer and as a decimal: no
/// parser of the agent makes such a record, but the block format can carry it, and a chunk
/// cannot hold two values of one field in one row. The hub must still tier the stream (the
/// first value of a repeated field is kept), or that stream's tiering would stop for good and
/// tier 1 fill up. Then a Backlog frame claiming 2^62 entries ends the session.
fn repeated_field(s: &mut Suite) -> Result<String> {
    let adv = s.attacker("repeat")?;
    let id = adv.cert.id.clone();
    let hub = s.hub_http();
    const BLOCKS: u64 = 20;
    const PER_BLOCK: u64 = 100;
    s.run(
        "repeated field: every record names `v` twice, as an integer and a decimal",
        Expect {
            codes: &[ErrorCode::ProtocolViolation],
            metric: "tributary_hub_sessions_ended_total{code=\"PROTOCOL_VIOLATION\"}",
        },
        move |_stop| async move {
            let mut session = adv.welcomed(7, vec![lane("evil-repeat", 7, 1, 1)]).await?;
            for b in 0..BLOCKS {
                let records: Vec<Record> = (0..PER_BLOCK)
                    .map(|i| Record {
                        tags: Vec::new(),
                        key: format!("k{}", i % 3),
                        ts: 1_700_000_000_000_000_000 + (b * PER_BLOCK + i) as i64,
                        fields: vec![
                            ("v".into(), Value::I64(i as i64)),
                            ("v".into(), Value::F64(i as f64 + 0.5)),
                        ],
                    })
                    .collect();
                let block = bombs::honest(7, b * PER_BLOCK + 1, &records);
                session
                    .send_data(&block_frame("evil-repeat", block))
                    .await
                    .context("the hub refused a block with a repeated field")?;
            }
            let tiered =
                tokio::task::spawn_blocking(move || wait_tiered(hub, &id, "evil-repeat")).await??;
            ensure!(
                tiered == BLOCKS * PER_BLOCK,
                "{tiered} of {} records with a repeated field tiered",
                BLOCKS * PER_BLOCK
            );
            session.send_control(&huge_backlog_count()).await?;
            let ending = session.ending(WAIT).await?;
            Ok(Outcome {
                note: format!(
                    "{} records naming `v` twice, all {tiered} tiered; then a protocol violation",
                    BLOCKS * PER_BLOCK
                ),
                endings: vec![ending],
            })
        },
    )
}

/// A Backlog frame whose entry count says 2^62 (and carries none).
fn huge_backlog_count() -> Vec<u8> {
    let empty = Frame::Backlog(Vec::new()).encode();
    // The length prefix, the type byte, then the count: replace the count.
    let mut frame = empty[..5].to_vec();
    sync::varint::put_u64(&mut frame, 1 << 62);
    let len = u32::try_from(frame.len() - 4).expect("a short frame");
    frame[..4].copy_from_slice(&len.to_le_bytes());
    frame
}

fn bad_block() -> Expect {
    Expect {
        codes: &[ErrorCode::BadBlock],
        metric: "tributary_hub_sessions_ended_total{code=\"BAD_BLOCK\"}",
    }
}

/// Waits until every lane `device` has on `stream` is tiered; returns the seqs tiered.
fn wait_tiered(hub: SocketAddr, device: &str, stream: &str) -> Result<u64> {
    let mut tiered = 0;
    procs::wait_until(WAIT, "the attacker's stream to be tiered", || {
        let Ok(list) = http::get(hub, "/v1/devices").and_then(|r| r.json()) else {
            return false;
        };
        let marks = list
            .as_array()
            .into_iter()
            .flatten()
            .filter(|d| d["id"] == device)
            .flat_map(|d| d["marks"].as_array().cloned().unwrap_or_default())
            .filter(|m| m["stream"] == stream)
            .collect::<Vec<_>>();
        let done = !marks.is_empty()
            && marks
                .iter()
                .all(|m| m["durable_seq"].as_u64() == m["tiered_seq"].as_u64());
        tiered = marks.iter().filter_map(|m| m["tiered_seq"].as_u64()).sum();
        done && tiered > 0
    })?;
    Ok(tiered)
}

fn quota_exceeded() -> Expect {
    Expect {
        codes: &[ErrorCode::QuotaExceeded],
        metric: "tributary_hub_quota_refused_total",
    }
}

#[test]
fn an_adversarial_device_cannot_hurt_the_hub_or_the_honest_devices() -> Result<()> {
    let scenarios: &[(&str, Scenario)] = &[
        ("decode_bomb_long_key", decode_bomb_long_key),
        ("decode_bomb_field_names", decode_bomb_field_names),
        ("decode_bomb_long_string", decode_bomb_long_string),
        (
            "decode_bomb_understated_raw_len",
            decode_bomb_understated_raw_len,
        ),
        (
            "decode_bomb_understated_body_len",
            decode_bomb_understated_body_len,
        ),
        ("gap_to_u64_max", gap_to_u64_max),
        ("stream_flood_hello", stream_flood_hello),
        ("column_flood", column_flood),
        ("epoch_flood", epoch_flood),
        ("field_flood_one_block", field_flood_one_block),
        ("connection_flood", connection_flood),
        ("stalled_control_stream", stalled_control_stream),
        ("unfinished_data_streams", unfinished_data_streams),
        (
            "unfinished_data_streams_many_devices",
            unfinished_data_streams_many_devices,
        ),
        ("duplicate_sessions", duplicate_sessions),
        ("backlog_flood", backlog_flood),
        ("repeated_field", repeated_field),
    ];
    let only = std::env::var("TRIBUTARY_ADVERSARY_ONLY").unwrap_or_default();
    let mut failed = Vec::new();
    for (name, scenario) in scenarios.iter().filter(|(n, _)| n.contains(&only)) {
        let started = Instant::now();
        let outcome = Suite::idle().and_then(|(mut suite, idle)| {
            let report = scenario(&mut suite)?;
            Ok(format!("idle VmRSS {} MiB; {report}", idle >> 20))
        });
        match outcome {
            Ok(report) => println!("PASS {name} ({:.1?}): {report}", started.elapsed()),
            Err(e) => {
                println!("FAIL {name} ({:.1?}): {e:#}", started.elapsed());
                failed.push(*name);
            }
        }
    }
    assert!(failed.is_empty(), "scenarios failed: {failed:?}");
    Ok(())
}
