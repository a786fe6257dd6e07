//! `core-hub demo`: a hub and several simulated edges on this machine, links that drop and come
//! back, and an end-to-end check that the hub holds exactly what the edges acknowledged.
//!
//! This is the product's first run: one command shows replication surviving outages and proves
//! it. The demo is a tool, so it uses `anyhow` like `main.rs` does. It
//!
//! 1. writes a fleet PKI (in-process [`crate::pki`] calls), `hub.toml` and one `edge.toml` per
//!    edge with free loopback ports, under a temporary directory (or `--dir`);
//! 2. starts the hub (this very binary, `run --config`) and the sibling `edge-agent` binary once
//!    per edge, as real child processes with their own data directories;
//! 3. puts a [`relay::Relay`] between each edge and the hub and switches it off and on following
//!    that device's simulated dead zones ([`firmware::sim::Simulator::link_up`]), time-compressed;
//! 4. feeds each edge from a seeded [`firmware::sim::Simulator`] through the edge's ingest API,
//!    keeping a ledger of every acknowledged seq range;
//! 5. stops producing, restores every link, waits until every edge has drained, then reads the
//!    whole merged stream from the hub and compares it with the ledger, device by device.
//!
//! It exits 0 only if that comparison passes. Children are killed on every exit path by their
//! [`procs::ChildProc`] guards (ctrl-c included: it cancels the demo, which drops them).

pub mod http;
pub mod procs;
pub mod relay;

use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, anyhow, bail};
use firmware::sim::{LinkSchedule, SimConfig, SimKind, Simulator};

use self::http::EdgeStatus;
use self::procs::{ChildProc, WorkDir};
use self::relay::Relay;

/// The stream every simulated device writes.
pub const STREAM: &str = "telemetry";
/// Simulated seconds per wall-clock second.
const TIME_COMPRESSION: f64 = 10.0;
/// Samples per second per simulated truck or machine.
const SIM_HZ: f64 = 10.0;
/// How often each producer posts a batch and re-reads its link schedule (wall time).
const PRODUCE_TICK: Duration = Duration::from_millis(100);
/// How long the children get to answer `/healthz`.
const STARTUP_DEADLINE: Duration = Duration::from_secs(30);
/// How long the edges get to drain their backlog once production stops.
const DRAIN_DEADLINE: Duration = Duration::from_secs(60);

/// `core-hub demo` flags.
#[derive(clap::Args, Debug, Clone)]
pub struct DemoArgs {
    /// Simulated edges (each one a real edge-agent process).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(3..=16))]
    pub edges: u32,
    /// Seconds of data production (wall time; simulated time runs 10x faster).
    /// Default 60, or 20 with --short.
    #[arg(long, value_parser = clap::value_parser!(u64).range(5..=600))]
    pub seconds: Option<u64>,
    /// The CI mode: 20 s of production, a dead zone in every link window (about 22 s in all).
    #[arg(long)]
    pub short: bool,
    /// Work in this directory (empty or new) and keep it, instead of a temporary one.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Keep the temporary directory (the hub's data, configs, logs) after the demo.
    #[arg(long)]
    pub keep: bool,
}

/// What one run does, derived from the flags.
#[derive(Debug, Clone)]
struct Plan {
    edges: usize,
    production: Duration,
    link: LinkSchedule,
}

impl Plan {
    fn from_args(args: &DemoArgs) -> Plan {
        let seconds = args.seconds.unwrap_or(if args.short { 20 } else { 60 });
        // Link windows in simulated seconds. The short mode puts a dead zone in every window
        // after the first (5 s of wall time each), so each edge loses its link at least 3
        // times in 20 s; the default mode is more like real roads.
        let link = if args.short {
            LinkSchedule {
                window_s: 50.0,
                dead_zone_probability: 1.0,
                dead_zone_min_s: 10.0,
                dead_zone_max_s: 30.0,
            }
        } else {
            LinkSchedule {
                window_s: 100.0,
                dead_zone_probability: 0.7,
                dead_zone_min_s: 20.0,
                dead_zone_max_s: 60.0,
            }
        };
        Plan {
            edges: args.edges as usize,
            production: Duration::from_secs(seconds),
            link,
        }
    }
}

/// Runs the demo; `Err` when anything fails, verification included.
pub fn run(args: &DemoArgs) -> Result<()> {
    let started = Instant::now();
    let plan = Plan::from_args(args);
    // Before anything is created: the most likely first-run mistake.
    let edge_agent = procs::sibling_edge_agent()?;
    let workdir = WorkDir::new(args.dir.as_deref(), args.keep)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let outcome = runtime.block_on(async {
        tokio::select! {
            r = demo(&plan, &workdir, &edge_agent) => r,
            _ = tokio::signal::ctrl_c() => Err(anyhow!("interrupted: every child process was stopped")),
        }
    });
    // Cancels producers and relays before the work directory goes.
    drop(runtime);
    println!("demo took {:.1} s", started.elapsed().as_secs_f64());
    if workdir.removed_at_exit() {
        println!(
            "(the work directory {} is removed now; rerun with --keep or --dir DIR to query the data afterwards)",
            workdir.path().display()
        );
    }
    outcome
}

/// One simulated edge as the demo sees it.
#[derive(Debug)]
struct Edge {
    id: String,
    kind: SimKind,
    http: SocketAddr,
    relay: Relay,
    ledger: Mutex<Ledger>,
    /// Times the relay switched this link off.
    drops: AtomicU64,
    /// Latest `/v1/status`, for the display.
    status: Mutex<Option<EdgeStatus>>,
}

/// What one edge acknowledged: per epoch, merged seq ranges, and the bytes posted.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Ledger {
    ranges: Vec<(u64, u64, u64)>,
    count: u64,
    ndjson_bytes: u64,
}

impl Ledger {
    fn add(&mut self, epoch: u64, first: u64, last: u64, count: u64, bytes: u64) {
        self.count += count;
        self.ndjson_bytes += bytes;
        push_range(&mut self.ranges, epoch, first, last);
    }

    /// The highest acknowledged seq in the latest epoch.
    fn last_seq(&self) -> Option<(u64, u64)> {
        self.ranges.last().map(|&(e, _, l)| (e, l))
    }
}

/// Appends `[first, last]` in `epoch`, merging with the previous range when contiguous.
fn push_range(ranges: &mut Vec<(u64, u64, u64)>, epoch: u64, first: u64, last: u64) {
    if let Some(prev) = ranges.last_mut()
        && prev.0 == epoch
        && prev.2 + 1 == first
    {
        prev.2 = last;
        return;
    }
    ranges.push((epoch, first, last));
}

fn ranges_text(ranges: &[(u64, u64, u64)]) -> String {
    if ranges.is_empty() {
        return "none".to_owned();
    }
    let parts: Vec<String> = ranges
        .iter()
        .map(|(e, f, l)| format!("epoch {e:016x} seq {f}..={l}"))
        .collect();
    parts.join(", ")
}

/// Shared state the producers, the display and the drain wait look at.
#[derive(Debug)]
struct Fleet {
    edges: Vec<Arc<Edge>>,
    hub_http: SocketAddr,
    phase: Mutex<String>,
    hub_records: AtomicU64,
    hub_block_bytes: AtomicU64,
}

async fn demo(plan: &Plan, workdir: &WorkDir, edge_agent: &Path) -> Result<()> {
    let root = workdir.path();
    let me = std::env::current_exe().context("locating the core-hub binary")?;
    println!(
        "Tributary demo: 1 hub, {} edges, {} s of production, in {}",
        plan.edges,
        plan.production.as_secs(),
        root.display()
    );

    // PKI: the fleet CA and the hub certificate, then one certificate per device.
    let pki_dir = root.join("pki");
    crate::pki::init(&pki_dir, &[], false).context("pki init")?;
    let ids: Vec<(String, SimKind)> = (0..plan.edges)
        .map(|i| {
            if i % 3 == 2 {
                (format!("plant-{:02}", i / 3 + 1), SimKind::Industrial)
            } else {
                (format!("fleet-{:02}", i - i / 3 + 1), SimKind::Fleet)
            }
        })
        .collect();

    // The hub.
    let hub_quic = procs::free_udp_port()?;
    let hub_http = procs::free_tcp_port()?;
    let hub_dir = root.join("hub");
    let logs = root.join("logs");
    std::fs::create_dir_all(&hub_dir)?;
    std::fs::create_dir_all(&logs)?;
    let hub_toml = root.join("hub.toml");
    std::fs::write(
        &hub_toml,
        procs::hub_toml(&hub_dir.join("data"), hub_quic, hub_http, &pki_dir),
    )?;
    let hub_toml_s = hub_toml.display().to_string();
    let mut hub = ChildProc::spawn(
        "hub",
        &me,
        &["run", "--config", &hub_toml_s],
        &logs.join("hub.log"),
    )?;
    wait_healthy(&mut hub, hub_http).await?;

    // The edges, each behind its own relay.
    let mut children = Vec::new();
    let mut edges = Vec::new();
    for (id, kind) in &ids {
        let edge_dir = root.join("edges").join(id);
        let cert_dir = edge_dir.join("certs");
        crate::pki::issue(&pki_dir, id, &cert_dir).with_context(|| format!("pki issue {id}"))?;
        let relay = Relay::start(hub_quic)
            .await
            .context("starting a link relay")?;
        let http = procs::free_tcp_port()?;
        let toml = edge_dir.join("edge.toml");
        std::fs::write(
            &toml,
            procs::edge_toml(
                &edge_dir.join("data"),
                relay.addr(),
                http,
                &cert_dir,
                STREAM,
            ),
        )?;
        let toml_s = toml.display().to_string();
        let child = ChildProc::spawn(
            id,
            edge_agent,
            &["run", "--config", &toml_s],
            &logs.join(format!("{id}.log")),
        )?;
        children.push(child);
        edges.push(Arc::new(Edge {
            id: id.clone(),
            kind: *kind,
            http,
            relay,
            ledger: Mutex::new(Ledger::default()),
            drops: AtomicU64::new(0),
            status: Mutex::new(None),
        }));
    }
    for (child, edge) in children.iter_mut().zip(&edges) {
        wait_healthy(child, edge.http).await?;
    }
    println!(
        "started: hub (HTTP {hub_http}, QUIC {hub_quic}) and {} edge agents; logs in {}",
        edges.len(),
        logs.display()
    );
    let described: Vec<String> = edges
        .iter()
        .map(|e| match e.kind {
            SimKind::Fleet => format!("{} ({} trucks)", e.id, units(e.kind)),
            SimKind::Industrial => format!("{} ({} machines)", e.id, units(e.kind)),
        })
        .collect();
    println!(
        "devices: {}, sampled at {SIM_HZ} Hz, simulated time {TIME_COMPRESSION}x faster than real time",
        described.join(", ")
    );
    println!(
        "legend: link = the demo's relay to the hub; posted = records the edge acknowledged; acked = seq the hub made durable / seq durable on the edge; backlog = not yet shipped"
    );

    let fleet = Arc::new(Fleet {
        edges,
        hub_http,
        phase: Mutex::new("producing".to_owned()),
        hub_records: AtomicU64::new(0),
        hub_block_bytes: AtomicU64::new(0),
    });
    let display_stop = Arc::new(AtomicBool::new(false));
    let display = tokio::spawn(display_loop(fleet.clone(), display_stop.clone()));

    // Production, one task per edge, while watching the children.
    let production_started = Instant::now();
    let now_ns = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0);
    let span_ns = (plan.production.as_secs_f64() * TIME_COMPRESSION * 1e9) as i64;
    let mut producers = tokio::task::JoinSet::new();
    for (i, edge) in fleet.edges.iter().enumerate() {
        let sim = Simulator::new(SimConfig {
            kind: edge.kind,
            device_id: edge.id.clone(),
            units: units(edge.kind),
            hz: SIM_HZ,
            seed: 0x7269_6275 + i as u64,
            // The data ends about now, so its timestamps look like a recent drive.
            start_ns: now_ns - span_ns,
            fault_probability: 0.001,
            link: plan.link,
        })?;
        producers.spawn(produce(edge.clone(), sim, plan.production));
    }
    let produced = watch_children(&mut hub, &mut children, async {
        while let Some(r) = producers.join_next().await {
            r.context("a producer task panicked")??;
        }
        Ok(())
    })
    .await;
    if let Err(e) = produced {
        stop_display(&display_stop, display).await;
        return Err(e);
    }
    let produced_for = production_started.elapsed();

    // Restore every link and wait until the edges have shipped everything.
    for edge in &fleet.edges {
        edge.relay.set_up(true);
    }
    *fleet.phase.lock().expect("phase lock") =
        "draining: production stopped, every link restored".to_owned();
    let drain_started = Instant::now();
    let drained = watch_children(&mut hub, &mut children, wait_drained(&fleet)).await;
    let drain_took = drain_started.elapsed();
    *fleet.phase.lock().expect("phase lock") = "verifying".to_owned();
    refresh(&fleet).await;
    stop_display(&display_stop, display).await;
    drained?;
    println!(
        "production ran {:.1} s; the edges drained in {:.1} s",
        produced_for.as_secs_f64(),
        drain_took.as_secs_f64()
    );

    // Verification: the merged stream against the ledger.
    let verdict = verify(&fleet).await?;
    print_where(root, &hub_toml, hub_http);
    if verdict {
        Ok(())
    } else {
        bail!("verification FAILED: the merged stream differs from what the edges acknowledged")
    }
}

/// Trucks or machines simulated on one device.
fn units(kind: SimKind) -> usize {
    match kind {
        SimKind::Fleet => 10,
        SimKind::Industrial => 8,
    }
}

/// Polls `/healthz` until it answers, failing early if the child exits.
async fn wait_healthy(child: &mut ChildProc, addr: SocketAddr) -> Result<()> {
    let deadline = Instant::now() + STARTUP_DEADLINE;
    loop {
        child.check_alive()?;
        match http::get_ok(addr, "/healthz").await {
            Ok(_) => return Ok(()),
            Err(e) if Instant::now() >= deadline => {
                bail!(
                    "{} did not answer on http://{addr}/healthz within {STARTUP_DEADLINE:?}: {e:#}; see {}",
                    child.name(),
                    child.log().display()
                )
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// Runs `work`, failing as soon as a child process dies.
async fn watch_children(
    hub: &mut ChildProc,
    children: &mut [ChildProc],
    work: impl std::future::Future<Output = Result<()>>,
) -> Result<()> {
    tokio::pin!(work);
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    loop {
        tokio::select! {
            r = &mut work => return r,
            _ = tick.tick() => {
                hub.check_alive()?;
                for c in children.iter_mut() {
                    c.check_alive()?;
                }
            }
        }
    }
}

/// Feeds one edge for `duration` of wall time and drives its link from the dead-zone schedule.
async fn produce(edge: Arc<Edge>, mut sim: Simulator, duration: Duration) -> Result<()> {
    let start_ns = sim.config().start_ns;
    let started = Instant::now();
    let mut tick = tokio::time::interval(PRODUCE_TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let elapsed = started.elapsed().min(duration);
        let sim_now = start_ns + (elapsed.as_secs_f64() * TIME_COMPRESSION * 1e9) as i64;
        let up = sim.link_up(sim_now);
        if edge.relay.is_up() && !up {
            edge.drops.fetch_add(1, Ordering::Relaxed);
        }
        edge.relay.set_up(up);
        let batch = sim.next_batch(sim_now);
        if !batch.is_empty() {
            let body = sync::parse::write_ndjson(&batch)
                .map_err(|e| anyhow!("simulated data for {}: {e}", edge.id))?;
            let ack = http::post_ndjson(edge.http, STREAM, body.as_bytes())
                .await
                .with_context(|| format!("posting to {}", edge.id))?;
            if ack.count != batch.len() as u64
                || ack.last_seq + 1 != ack.first_seq + ack.count
                || ack.stream != STREAM
            {
                bail!(
                    "{} acknowledged {ack:?} for a batch of {} records",
                    edge.id,
                    batch.len()
                );
            }
            edge.ledger.lock().expect("ledger lock").add(
                ack.epoch,
                ack.first_seq,
                ack.last_seq,
                ack.count,
                body.len() as u64,
            );
        }
        if elapsed >= duration {
            return Ok(());
        }
    }
}

/// Reads every edge's status and the hub's counters into `fleet`.
async fn refresh(fleet: &Fleet) {
    let statuses = futures_join_all(fleet.edges.iter().map(|e| http::edge_status(e.http))).await;
    for (edge, status) in fleet.edges.iter().zip(statuses) {
        *edge.status.lock().expect("status lock") = status.ok();
    }
    if let Ok(n) = http::hub_records(fleet.hub_http, STREAM).await {
        fleet.hub_records.store(n, Ordering::Relaxed);
    }
    if let Ok(body) = http::get_ok(fleet.hub_http, "/metrics").await
        && let Some(v) = http::metric(
            &String::from_utf8_lossy(&body),
            "tributary_hub_block_bytes_committed_total",
        )
    {
        fleet.hub_block_bytes.store(v as u64, Ordering::Relaxed);
    }
}

/// Awaits futures concurrently, in order (a tiny `join_all` without the futures crate).
async fn futures_join_all<F: std::future::Future + Send + 'static>(
    futs: impl Iterator<Item = F>,
) -> Vec<F::Output>
where
    F::Output: Send + 'static,
{
    let handles: Vec<_> = futs.map(tokio::spawn).collect();
    let mut out = Vec::with_capacity(handles.len());
    for h in handles {
        out.push(h.await.expect("status task panicked"));
    }
    out
}

/// Waits until every edge's backlog is empty and the hub acknowledged everything durable.
async fn wait_drained(fleet: &Fleet) -> Result<()> {
    let deadline = Instant::now() + DRAIN_DEADLINE;
    loop {
        let mut pending = Vec::new();
        for edge in &fleet.edges {
            let want = edge.ledger.lock().expect("ledger lock").last_seq();
            match http::edge_status(edge.http).await {
                Ok(status) => {
                    let s = status.streams.iter().find(|s| s.stream == STREAM);
                    let done = s.is_some_and(|s| {
                        s.backlog_blocks == 0
                            && s.backlog_bytes == 0
                            && s.acked_seq == s.durable_seq
                            && want.is_none_or(|(epoch, last)| {
                                s.epoch == epoch && s.durable_seq == last
                            })
                    });
                    if !done {
                        pending.push(format!("{}: {:?}", edge.id, s));
                    }
                }
                Err(e) => pending.push(format!("{}: {e:#}", edge.id)),
            }
        }
        if pending.is_empty() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!(
                "the edges did not drain within {DRAIN_DEADLINE:?}: {}",
                pending.join("; ")
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn stop_display(stop: &AtomicBool, display: tokio::task::JoinHandle<()>) {
    stop.store(true, Ordering::Relaxed);
    let _ = display.await;
}

/// Redraws the progress lines every 500 ms on a terminal, or prints them every 2 s otherwise.
async fn display_loop(fleet: Arc<Fleet>, stop: Arc<AtomicBool>) {
    let tty = std::io::stdout().is_terminal();
    let width = if tty { terminal_width() } else { None };
    let period = if tty {
        Duration::from_millis(500)
    } else {
        Duration::from_secs(2)
    };
    let started = Instant::now();
    let mut drawn = 0usize;
    loop {
        refresh(&fleet).await;
        draw(&render(&fleet, started.elapsed()), tty, width, &mut drawn);
        let wake = Instant::now() + period;
        while Instant::now() < wake {
            if stop.load(Ordering::Relaxed) {
                // One last frame, so the output ends with the drained state.
                refresh(&fleet).await;
                draw(&render(&fleet, started.elapsed()), tty, width, &mut drawn);
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// The terminal's width, so frame lines never wrap (a wrapped line would break the cursor
/// moves). Asks `stty` about the controlling terminal; `COLUMNS` is the fallback.
fn terminal_width() -> Option<usize> {
    let from_stty = std::fs::File::open("/dev/tty").ok().and_then(|tty| {
        let out = std::process::Command::new("stty")
            .arg("size")
            .stdin(tty)
            .stderr(std::process::Stdio::null())
            .output()
            .ok()?;
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()
    });
    from_stty
        .or_else(|| std::env::var("COLUMNS").ok()?.parse().ok())
        .filter(|&w: &usize| w >= 20)
}

/// Prints one frame; on a terminal it overwrites the previous frame of `drawn` lines, each
/// cut to `width` so that no line wraps.
fn draw(lines: &[String], tty: bool, width: Option<usize>, drawn: &mut usize) {
    let mut out = std::io::stdout().lock();
    if tty && *drawn > 0 {
        // Back to the first line of the previous frame, then overwrite line by line.
        let _ = write!(out, "\x1b[{}F", *drawn);
    }
    for line in lines {
        let _ = if tty {
            let cut: String = line
                .chars()
                .take(width.map_or(usize::MAX, |w| w - 1))
                .collect();
            writeln!(out, "\x1b[2K{cut}")
        } else {
            writeln!(out, "{line}")
        };
    }
    *drawn = lines.len();
    let _ = out.flush();
}

fn render(fleet: &Fleet, elapsed: Duration) -> Vec<String> {
    let mut lines = vec![format!(
        "[{:5.1}s] {}",
        elapsed.as_secs_f64(),
        fleet.phase.lock().expect("phase lock")
    )];
    let mut posted_records = 0u64;
    let mut posted_bytes = 0u64;
    for edge in &fleet.edges {
        let ledger = edge.ledger.lock().expect("ledger lock").clone();
        posted_records += ledger.count;
        posted_bytes += ledger.ndjson_bytes;
        let status = edge.status.lock().expect("status lock").clone();
        let relay = if edge.relay.is_up() { "up  " } else { "DOWN" };
        let stream = status
            .as_ref()
            .and_then(|s| s.streams.iter().find(|s| s.stream == STREAM).cloned());
        let detail = match stream {
            Some(s) => format!(
                "acked {:>6}/{:<6}  backlog {:>9} {:>3} blk",
                s.acked_seq,
                s.durable_seq,
                bytes_text(s.backlog_bytes),
                s.backlog_blocks,
            ),
            None => "status unavailable".to_owned(),
        };
        lines.push(format!(
            "  {:<9} link {relay} drops {:>2}  posted {:>6}  {detail}",
            edge.id,
            edge.drops.load(Ordering::Relaxed),
            ledger.count
        ));
    }
    let merged = fleet.hub_records.load(Ordering::Relaxed);
    let block_bytes = fleet.hub_block_bytes.load(Ordering::Relaxed);
    lines.push(format!(
        "  hub: {merged} of {posted_records} records merged  {}",
        compression_text(posted_bytes, posted_records, merged, block_bytes)
    ));
    lines
}

/// The compression ratio: raw NDJSON bytes of the merged records (at the average posted size)
/// over the encoded block bytes the hub committed, i.e. what crossed the link.
fn compression_text(
    posted_bytes: u64,
    posted_records: u64,
    merged: u64,
    block_bytes: u64,
) -> String {
    if posted_records == 0 || block_bytes == 0 {
        return "compression: n/a yet".to_owned();
    }
    let raw = posted_bytes as f64 / posted_records as f64 * merged as f64;
    format!(
        "compression {:.1}x ({} of NDJSON in {} of blocks shipped)",
        raw / block_bytes as f64,
        bytes_text(raw as u64),
        bytes_text(block_bytes)
    )
}

fn bytes_text(b: u64) -> String {
    match b {
        b if b >= 1 << 30 => format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64),
        b if b >= 1 << 20 => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
        b if b >= 1 << 10 => format!("{:.1} KiB", b as f64 / 1024.0),
        b => format!("{b} B"),
    }
}

/// Compares the hub's merged stream with the ledger; prints the summary; true on PASS.
async fn verify(fleet: &Fleet) -> Result<bool> {
    let records = http::hub_read_all(fleet.hub_http, STREAM).await?;
    let mut by_device: BTreeMap<String, Vec<(u64, u64)>> = BTreeMap::new();
    for r in &records {
        by_device
            .entry(r.device.clone())
            .or_default()
            .push((r.epoch, r.seq));
    }
    println!();
    println!(
        "verification: {} records read back from the hub's stream `{STREAM}`",
        records.len()
    );
    let mut pass = true;
    let mut counts = Vec::new();
    let mut posted_records = 0;
    let mut posted_bytes = 0;
    let mut drops = 0;
    for edge in &fleet.edges {
        let ledger = edge.ledger.lock().expect("ledger lock").clone();
        posted_records += ledger.count;
        posted_bytes += ledger.ndjson_bytes;
        drops += edge.drops.load(Ordering::Relaxed);
        let mut seqs = by_device.remove(&edge.id).unwrap_or_default();
        let hub_count = seqs.len() as u64;
        seqs.sort_unstable();
        let before = seqs.len();
        seqs.dedup();
        let duplicates = before - seqs.len();
        let mut hub_ranges = Vec::new();
        for (epoch, seq) in seqs {
            push_range(&mut hub_ranges, epoch, seq, seq);
        }
        let ok = duplicates == 0
            && hub_count == ledger.count
            && hub_ranges == ledger.ranges
            && ledger.count > 0;
        pass &= ok;
        println!(
            "  {:<9} {}  edge acknowledged {:>7} ({})  hub holds {:>7} ({}){}",
            edge.id,
            if ok { "ok  " } else { "FAIL" },
            ledger.count,
            ranges_text(&ledger.ranges),
            hub_count,
            ranges_text(&hub_ranges),
            if duplicates > 0 {
                format!("  {duplicates} duplicates")
            } else {
                String::new()
            }
        );
        counts.push(format!("{}={hub_count}", edge.id));
    }
    for (device, seqs) in &by_device {
        pass = false;
        println!(
            "  {device:<9} FAIL  {} records at the hub from a device the demo never ran",
            seqs.len()
        );
    }
    let block_bytes = fleet.hub_block_bytes.load(Ordering::Relaxed);
    println!("link drops: {drops}");
    println!(
        "records: {posted_records} acknowledged by the edges, {} merged at the hub",
        records.len()
    );
    println!(
        "{}",
        compression_text(
            posted_bytes,
            posted_records,
            records.len() as u64,
            block_bytes
        )
    );
    if pass {
        println!(
            "PASS: the merged stream equals what the edges recorded, exactly once ({})",
            counts.join(" ")
        );
    } else {
        println!(
            "FAIL: the merged stream differs from what the edges recorded ({})",
            counts.join(" ")
        );
    }
    Ok(pass)
}

fn print_where(root: &Path, hub_toml: &Path, hub_http: SocketAddr) {
    let data = root.join("hub").join("data");
    println!("hub data: {}", data.display());
    let parquet = data.join("tier2").join("streams").join(STREAM);
    println!(
        "tier 2 (Parquet): {}  e.g. duckdb: SELECT device, count(*) FROM read_parquet('{}/**/*.parquet') GROUP BY device",
        parquet.display(),
        parquet.display()
    );
    println!(
        "query it: core-hub run --config {} &  then  core-hub read {STREAM} --url http://{hub_http}",
        hub_toml.display()
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_merge_only_when_contiguous() {
        let mut l = Ledger::default();
        l.add(1, 1, 10, 10, 100);
        l.add(1, 11, 20, 10, 100);
        l.add(1, 22, 22, 1, 10);
        l.add(2, 1, 5, 5, 50);
        assert_eq!(l.ranges, vec![(1, 1, 20), (1, 22, 22), (2, 1, 5)]);
        assert_eq!((l.count, l.ndjson_bytes), (26, 260));
        assert_eq!(l.last_seq(), Some((2, 5)));
    }

    #[test]
    fn short_mode_drops_every_link_at_least_three_times() {
        let args = DemoArgs {
            edges: 3,
            seconds: None,
            short: true,
            dir: None,
            keep: false,
        };
        let plan = Plan::from_args(&args);
        let span_ns = (plan.production.as_secs_f64() * TIME_COMPRESSION * 1e9) as i64;
        for i in 0..3u64 {
            let sim = Simulator::new(SimConfig {
                device_id: format!("d{i}"),
                seed: i,
                link: plan.link,
                ..SimConfig::default()
            })
            .unwrap();
            let start = sim.config().start_ns;
            let zones = sim.dead_zones(start, start + span_ns);
            assert!(zones.len() >= 3, "{zones:?}");
            // Every zone lasts at least a second of wall time, far longer than a producer tick.
            assert!(
                zones
                    .iter()
                    .all(|(s, e)| (e - s) as f64 / TIME_COMPRESSION >= 1e9)
            );
        }
    }
}
