//! The `core-hub` binary: `run`, `pki init|issue|revoke`, `read`, `devices [retire]`,
//! `streams` and `demo`.
//!
//! `run` opens the hub (catalog + tier-1 WAL), serves the HTTP API, and waits for Ctrl-C or
//! SIGTERM. The QUIC server is started in [`serve`], at the marked place, once
//! `core-hub/src/server.rs` exists. `read`, `devices` and `streams` go through the HTTP API, so they work
//! against a running hub, locally (`--config`) or remotely (`--url`).

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use core_hub::client::{self, ApiTarget};
use core_hub::{Hub, HubConfig, api, pki};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Parser, Debug)]
#[command(
    name = "core-hub",
    version,
    about = "Tributary hub: tier-1 log, reader API and PKI"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Run the hub.
    Run {
        #[arg(long, default_value = "hub.toml")]
        config: PathBuf,
    },
    /// Manage the fleet PKI.
    Pki {
        #[command(subcommand)]
        cmd: PkiCmd,
    },
    /// Print a stream's committed records as NDJSON (each line with its segment and offset).
    Read {
        stream: String,
        /// `start`, a hub offset, an RFC 3339 time (hub ingest time) or a stream cut.
        #[arg(long, default_value = "start")]
        from: String,
        /// Keep running and print records as they commit.
        #[arg(long)]
        follow: bool,
        /// Only this routing key.
        #[arg(long)]
        key: Option<String>,
        /// Read as a member of this reader group (created from `--from` if new); the hub
        /// stores the checkpoints, and each batch is checkpointed once printed.
        #[arg(long, requires = "reader")]
        group: Option<String>,
        /// This reader's name in the group.
        #[arg(long, requires = "group")]
        reader: Option<String>,
        /// Output format (only `ndjson`).
        #[arg(long, default_value = "ndjson")]
        format: String,
        /// Stop after this many records.
        #[arg(long)]
        limit: Option<u64>,
        #[command(flatten)]
        target: Target,
    },
    /// List devices with their marks, fences and backlog (JSON), or retire one.
    #[command(args_conflicts_with_subcommands = true)]
    Devices {
        #[command(subcommand)]
        cmd: Option<DevicesCmd>,
        #[command(flatten)]
        target: Target,
    },
    /// List streams, or show one: segments, rates and completeness (JSON).
    Streams {
        /// Show only this stream, in detail.
        stream: Option<String>,
        #[command(flatten)]
        target: Target,
    },
    /// Run a hub and simulated edges with flaky links, then verify the merged stream.
    Demo(core_hub::demo::DemoArgs),
    /// Rebuild a lost data directory's catalog from tier 2 (`--from-tier2`).
    Recover {
        #[arg(long, default_value = "hub.toml")]
        config: PathBuf,
        /// Rebuild from the manifests and chunk files in tier 2 (the only source supported).
        #[arg(long)]
        from_tier2: bool,
    },
    /// Export a stream's tiered records with event time in [--from, --to) to one Parquet file.
    Export {
        stream: String,
        /// RFC 3339 time (`2026-11-29T00:00:00Z`) or nanoseconds since the Unix epoch.
        #[arg(long)]
        from: String,
        /// RFC 3339 time or nanoseconds since the Unix epoch (exclusive).
        #[arg(long)]
        to: String,
        #[arg(long)]
        out: PathBuf,
        /// Leave out chunks whose tier-2 object is damaged or missing (each is named and
        /// counted) instead of failing the export.
        #[arg(long)]
        skip_damaged: bool,
        #[arg(long, default_value = "hub.toml")]
        config: PathBuf,
    },
}

#[derive(Subcommand, Debug)]
enum DevicesCmd {
    /// List devices (the default).
    List {
        #[command(flatten)]
        target: Target,
    },
    /// Take a scrapped device out of every completeness answer and watermark.
    Retire {
        /// The device id (its certificate CN).
        id: String,
        /// Put a retired device back instead.
        #[arg(long)]
        undo: bool,
        #[command(flatten)]
        target: Target,
    },
}

#[derive(clap::Args, Debug)]
struct Target {
    /// The hub's config; the API address and first reader token come from it.
    #[arg(long, conflicts_with = "url")]
    config: Option<PathBuf>,
    /// The hub's API, e.g. http://127.0.0.1:7480.
    #[arg(long)]
    url: Option<String>,
    /// A reader bearer token.
    #[arg(long, env = "TRIBUTARY_HUB_TOKEN")]
    token: Option<String>,
}

#[derive(Subcommand, Debug)]
enum PkiCmd {
    /// Create the fleet CA and the hub certificate.
    Init {
        #[arg(long)]
        dir: PathBuf,
        /// Extra DNS name or IP for the hub certificate (repeatable).
        #[arg(long = "san")]
        sans: Vec<String>,
        /// Replace an existing CA.
        #[arg(long)]
        force: bool,
    },
    /// Issue a device certificate (CN = device id).
    Issue {
        #[arg(long)]
        dir: PathBuf,
        #[arg(long)]
        device: String,
        #[arg(long)]
        out: PathBuf,
        /// Validity in years.
        #[arg(long, default_value_t = pki::DEVICE_CERT_YEARS)]
        years: i32,
        /// Replace an existing device.key / device.pem in --out.
        #[arg(long)]
        force: bool,
    },
    /// Revoke a device; a running hub reloads the list.
    Revoke {
        #[arg(long)]
        dir: PathBuf,
        #[arg(long)]
        device: String,
        /// Revoke only the certificate with this serial, not every certificate of the device.
        /// Hex in any form `openssl x509` prints (`42:bb:57`, `serial=42BB57`); it must be one
        /// `pki issue` recorded for the device in DIR/issued.txt.
        #[arg(long)]
        serial: Option<String>,
    },
}

fn main() -> Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Run { config } => run(&config),
        Cmd::Pki { cmd } => pki_cmd(cmd),
        Cmd::Read {
            stream,
            from,
            follow,
            key,
            group,
            reader,
            format,
            limit,
            target,
        } => {
            if format != "ndjson" {
                bail!("--format {format} is not supported; use ndjson");
            }
            let opts = ReadOpts {
                from,
                follow,
                key,
                limit,
            };
            match (group, reader) {
                (Some(g), Some(r)) => {
                    runtime()?.block_on(read_group(&stream, &g, &r, &opts, &target))
                }
                _ => runtime()?.block_on(read(&stream, &opts, &target)),
            }
        }
        Cmd::Devices { cmd, target } => match cmd {
            None => runtime()?.block_on(devices(&target)),
            Some(DevicesCmd::List { target }) => runtime()?.block_on(devices(&target)),
            Some(DevicesCmd::Retire { id, undo, target }) => {
                runtime()?.block_on(retire(&id, undo, &target))
            }
        },
        Cmd::Streams { stream, target } => runtime()?.block_on(streams(stream.as_deref(), &target)),
        Cmd::Demo(args) => core_hub::demo::run(&args),
        Cmd::Recover { config, from_tier2 } => {
            if !from_tier2 {
                bail!("only `core-hub recover --from-tier2` is supported");
            }
            runtime()?.block_on(recover(&config))
        }
        Cmd::Export {
            stream,
            from,
            to,
            out,
            skip_damaged,
            config,
        } => runtime()?.block_on(export(&config, &stream, &from, &to, &out, skip_damaged)),
    }
}

/// `core-hub recover --from-tier2`.
async fn recover(config: &Path) -> Result<()> {
    let cfg = HubConfig::load(config).with_context(|| format!("loading {}", config.display()))?;
    let bar = indicatif::ProgressBar::new(0);
    let report = core_hub::tiering::recover::from_tier2(&cfg, |stream, done, total| {
        bar.set_length(total);
        bar.set_position(done);
        bar.set_message(stream.to_string());
    })
    .await?;
    bar.finish_and_clear();
    println!(
        "recovered {} streams, {} chunks, {} records, {} device lanes ({} uncommitted chunk files adopted)",
        report.streams, report.chunks, report.records, report.lanes, report.adopted
    );
    Ok(())
}

fn parse_time(s: &str) -> Result<i64> {
    if let Ok(ns) = s.parse::<i64>() {
        return Ok(ns);
    }
    let t = humantime::parse_rfc3339_weak(s)
        .with_context(|| format!("`{s}` is neither RFC 3339 nor nanoseconds"))?;
    let d = t
        .duration_since(std::time::UNIX_EPOCH)
        .with_context(|| format!("`{s}` is before 1970"))?;
    Ok(i64::try_from(d.as_nanos())?)
}

/// Drives an indicatif bar from the export's progress.
struct Bar(indicatif::ProgressBar);

impl core_hub::tiering::export::ExportProgress for Bar {
    fn start(&mut self, total: u64) {
        self.0.set_length(total);
    }
    fn chunk(&mut self, records: u64) {
        self.0.inc(1);
        self.0.set_message(format!("{records} records"));
    }
}

/// `core-hub export STREAM --from T --to T --out FILE.parquet`.
async fn export(
    config: &Path,
    stream: &str,
    from: &str,
    to: &str,
    out: &Path,
    skip_damaged: bool,
) -> Result<()> {
    use core_hub::tiering::export::{ExportOptions, export_with};
    let cfg = HubConfig::load(config).with_context(|| format!("loading {}", config.display()))?;
    let (from, to) = (parse_time(from)?, parse_time(to)?);
    let style = indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} chunks {msg}")?;
    let mut bar = Bar(indicatif::ProgressBar::new(0).with_style(style));
    let opts = ExportOptions {
        skip_damaged,
        ..ExportOptions::default()
    };
    let report = export_with(&cfg, stream, from, to, out, &mut bar, &opts).await?;
    bar.0.finish_and_clear();
    println!(
        "wrote {} records ({} bytes) from {} chunks to {}",
        report.records,
        report.bytes,
        report.chunks_read,
        out.display()
    );
    if report.skipped_chunks > 0 {
        println!(
            "left out {} damaged or missing chunks ({} records); the log names each",
            report.skipped_chunks, report.skipped_records
        );
    }
    Ok(())
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
}

fn run(config: &Path) -> Result<()> {
    let cfg = HubConfig::load(config).with_context(|| format!("loading {}", config.display()))?;
    let hub = Hub::open(&cfg).context("opening the hub")?;
    tracing::info!(data_dir = %cfg.data_dir.display(), "hub open");
    // Checks sealed WAL files against the block index at start and then periodically; damaged
    // blocks are quarantined so readers skip them and the rest stays served.
    let scrubber = core_hub::scrub::Scrubber::start(
        hub.clone(),
        &cfg.data_dir,
        core_hub::scrub::DEFAULT_INTERVAL,
    );
    runtime()?.block_on(serve(hub.clone(), &cfg))?;
    drop(scrubber);
    hub.shutdown();
    Ok(())
}

/// Starts every listener and waits for a shutdown signal.
async fn serve(hub: Arc<Hub>, cfg: &HubConfig) -> Result<()> {
    let listener = tokio::net::TcpListener::bind(cfg.listen.http)
        .await
        .with_context(|| format!("binding the HTTP API on {}", cfg.listen.http))?;
    tracing::info!(addr = %listener.local_addr()?, "HTTP API listening");
    let guard = api::guard(&cfg.http);
    let router = api::router_for(
        hub.clone(),
        &cfg.http,
        cfg.completeness.clone(),
        guard.clone(),
    );
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let http = tokio::spawn(api::serve_with(listener, router, guard, {
        let mut stop = stop_rx.clone();
        async move {
            let _ = stop.wait_for(|s| *s).await;
        }
    }));
    let quic = match cfg.tls {
        Some(_) => {
            let (server, task) = core_hub::server::start(cfg, hub.clone(), stop_rx.clone()).await?;
            tracing::info!(addr = %server.local_addr, "accepting devices over QUIC");
            Some(task)
        }
        None => {
            tracing::warn!("no [tls] section: devices cannot connect; serving the HTTP API only");
            None
        }
    };
    let republish = match &cfg.republish {
        Some(r) => {
            tracing::info!(broker = %format!("{}:{}", r.host, r.port), streams = ?r.streams, "republishing to MQTT");
            core_hub::republish::start(hub.clone(), r.clone(), stop_rx.clone())
        }
        None => Vec::new(),
    };
    // Tier 2: the uploader, eviction and the tier-1 budget (pushback). `/healthz` says not
    // ready until it is open; a transient failure is retried, a misconfiguration ends here.
    let tiering = tokio::select! {
        t = core_hub::status::open_tiering(&hub, cfg) => t.context("opening tier 2 (a configuration error: fix [tier2] and restart)")?,
        () = shutdown_signal() => {
            tracing::info!("shut down while opening tier 2");
            let _ = stop_tx.send(true);
            return Ok(());
        }
    };
    // Agents learn new tiered_seq marks even when idle (issue 7): connections push them.
    let _tier_follow = hub.follow_tiering(tiering.subscribe_tiered());
    hub.set_tier_stats(tiering.stats().clone());
    let tier_task = tiering.spawn(stop_rx.clone());
    // Tier-2 scrub: chunk objects against their crc32c; quarantine and repair (issue 9).
    let tier2_scrub = core_hub::scrub::start_tier2(
        tiering.clone(),
        core_hub::scrub::Tier2ScrubConfig::from(&cfg.tier2),
        stop_rx.clone(),
    );
    shutdown_signal().await;
    let _ = stop_tx.send(true);
    let _ = tier_task.await;
    let _ = tier2_scrub.await;
    for task in republish {
        let _ = task.await;
    }
    if let Some(task) = quic {
        task.await.context("QUIC task")?;
    }
    http.await.context("HTTP task")?.context("HTTP server")?;
    tracing::info!("shutting down");
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}

fn pki_cmd(cmd: PkiCmd) -> Result<()> {
    match cmd {
        PkiCmd::Init { dir, sans, force } => {
            let out = pki::init(&dir, &sans, force)?;
            println!(
                "wrote {}, {}, {}, {}",
                out.ca_pem.display(),
                out.ca_key.display(),
                out.hub_pem.display(),
                out.hub_key.display()
            );
        }
        PkiCmd::Issue {
            dir,
            device,
            out,
            years,
            force,
        } => {
            let o = pki::issue_with_years(&dir, &device, &out, years, force)?;
            println!(
                "wrote {}, {}, {} (serial {})",
                o.ca_pem.display(),
                o.device_pem.display(),
                o.device_key.display(),
                o.serial
            );
        }
        PkiCmd::Revoke {
            dir,
            device,
            serial,
        } => {
            let out = pki::revoke(&dir, &device, serial.as_deref())?;
            if let Some(warning) = &out.warning {
                eprintln!("warning: {warning}");
            }
            match &out.serial {
                Some(s) => println!("revoked {device} serial {s} in {}", out.path.display()),
                None => println!("revoked {device} in {}", out.path.display()),
            }
        }
    }
    Ok(())
}

fn api_target(t: &Target) -> Result<ApiTarget> {
    match (&t.url, &t.config) {
        (Some(url), _) => Ok(ApiTarget::parse(url, t.token.clone())?),
        (None, config) => {
            let path = config.clone().unwrap_or_else(|| PathBuf::from("hub.toml"));
            let cfg =
                HubConfig::load(&path).with_context(|| format!("loading {}", path.display()))?;
            // An admin token also reads, and `devices retire` needs one.
            let token = t
                .token
                .clone()
                .or_else(|| cfg.http.admin_tokens.first().cloned())
                .or_else(|| cfg.http.reader_tokens.first().cloned());
            Ok(ApiTarget::from_listen(cfg.listen.http, token))
        }
    }
}

/// What `core-hub read` reads.
struct ReadOpts {
    from: String,
    follow: bool,
    key: Option<String>,
    limit: Option<u64>,
}

fn check_status(resp: &client::HttpResponse) -> Result<()> {
    if resp.status != 200 {
        bail!(
            "{} {}",
            resp.status,
            String::from_utf8_lossy(&resp.body).trim()
        );
    }
    Ok(())
}

/// Pages through the stream (each page starts at the previous page's cut); with `--follow`,
/// then holds one streaming response open and prints records as the hub pushes them.
async fn read(stream: &str, o: &ReadOpts, t: &Target) -> Result<()> {
    let target = api_target(t)?;
    let key = o
        .key
        .as_deref()
        .map(|k| format!("&key={}", client::query_escape(k)))
        .unwrap_or_default();
    let mut from = o.from.clone();
    let mut left = o.limit.unwrap_or(u64::MAX);
    let stdout = std::io::stdout();
    while left > 0 {
        let page = left.min(api::RECORDS_LIMIT_MAX as u64);
        let path = format!(
            "/v1/streams/{stream}/records?from={}&limit={page}{key}",
            client::query_escape(&from)
        );
        let resp = client::get(&target, &path).await?;
        check_status(&resp)?;
        from = resp
            .header(core_hub::streams::api::NEXT_CUT_HEADER)
            .context("response lacks the next-cut header")?
            .to_string();
        if resp.body.is_empty() {
            break;
        }
        let lines = resp.body.iter().filter(|&&b| b == b'\n').count() as u64;
        let mut out = stdout.lock();
        out.write_all(&resp.body)?;
        out.flush()?;
        left = left.saturating_sub(lines);
    }
    if !o.follow || left == 0 {
        return Ok(());
    }
    let limit = if left == u64::MAX {
        String::new()
    } else {
        format!("&limit={left}")
    };
    let path = format!(
        "/v1/streams/{stream}/records?from={}&follow=true{limit}{key}",
        client::query_escape(&from)
    );
    let mut failed = None;
    let resp = client::get_streaming(&target, &path, |data| {
        let mut out = stdout.lock();
        match out.write_all(data).and_then(|()| out.flush()) {
            Ok(()) => true,
            Err(e) => {
                failed = Some(e);
                false
            }
        }
    })
    .await?;
    check_status(&resp)?;
    match failed {
        // The reader of our output went away (e.g. `| head`): that ends a follow.
        Some(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        Some(e) => Err(e.into()),
        None => Ok(()),
    }
}

/// Reads as a reader-group member: poll a batch, print it, checkpoint it with the next poll.
async fn read_group(
    stream: &str,
    group: &str,
    reader: &str,
    o: &ReadOpts,
    t: &Target,
) -> Result<()> {
    if o.key.is_some() {
        bail!("--key cannot be combined with --group: a group reads whole segments");
    }
    let target = api_target(t)?;
    let base = format!("/v1/streams/{stream}/groups/{group}/readers/{reader}");
    let mut left = o.limit.unwrap_or(u64::MAX);
    let mut positions = String::new();
    let stdout = std::io::stdout();
    let wait = if o.follow { 1000 } else { 0 };
    while left > 0 {
        let max = left.min(10_000);
        let path = format!(
            "{base}/records?max={max}&wait_ms={wait}&from={}&checkpoint={}",
            client::query_escape(&o.from),
            client::query_escape(&positions)
        );
        let resp = client::get(&target, &path).await?;
        check_status(&resp)?;
        positions = resp
            .header(core_hub::streams::api::POSITIONS_HEADER)
            .unwrap_or_default()
            .to_string();
        if resp.body.is_empty() {
            if o.follow {
                continue;
            }
            break;
        }
        let lines = resp.body.iter().filter(|&&b| b == b'\n').count() as u64;
        let mut out = stdout.lock();
        out.write_all(&resp.body)?;
        out.flush()?;
        left = left.saturating_sub(lines);
    }
    if !positions.is_empty() {
        let path = format!(
            "{base}/checkpoint?positions={}",
            client::query_escape(&positions)
        );
        check_status(&client::post(&target, &path).await?)?;
    }
    Ok(())
}

async fn devices(t: &Target) -> Result<()> {
    let target = api_target(t)?;
    let resp = client::get(&target, "/v1/devices").await?;
    if resp.status != 200 {
        bail!(
            "{} {}",
            resp.status,
            String::from_utf8_lossy(&resp.body).trim()
        );
    }
    let list: serde_json::Value = serde_json::from_slice(&resp.body)?;
    println!("{}", serde_json::to_string_pretty(&list)?);
    Ok(())
}

/// Prints a JSON answer of the API, or fails with its status and message.
async fn get_json(target: &ApiTarget, path: &str) -> Result<()> {
    let resp = client::get(target, path).await?;
    if resp.status != 200 {
        bail!(
            "{} {}",
            resp.status,
            String::from_utf8_lossy(&resp.body).trim()
        );
    }
    let v: serde_json::Value = serde_json::from_slice(&resp.body)?;
    println!("{}", serde_json::to_string_pretty(&v)?);
    Ok(())
}

async fn retire(id: &str, undo: bool, t: &Target) -> Result<()> {
    let target = api_target(t)?;
    let path = format!(
        "/v1/devices/{id}/retire{}",
        if undo { "?undo=true" } else { "" }
    );
    let resp = client::post(&target, &path).await?;
    if resp.status != 200 {
        bail!(
            "{} {}",
            resp.status,
            String::from_utf8_lossy(&resp.body).trim()
        );
    }
    if undo {
        println!("{id} is active again");
    } else {
        println!("retired {id}: it is left out of completeness answers and watermarks");
    }
    Ok(())
}

async fn streams(stream: Option<&str>, t: &Target) -> Result<()> {
    let target = api_target(t)?;
    match stream {
        Some(s) => get_json(&target, &format!("/v1/streams/{s}")).await,
        None => get_json(&target, "/v1/streams").await,
    }
}
