//! The `core-hub` binary: `run`, `pki init|issue|revoke`, `read`, `devices` and `demo`.
//!
//! `run` opens the hub (catalog + tier-1 WAL), serves the HTTP API, and waits for Ctrl-C or
//! SIGTERM. The QUIC server is started in [`serve`], at the marked place, once
//! `core-hub/src/server.rs` exists. `read` and `devices` go through the HTTP API, so they work
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
    /// Print a stream's committed records as NDJSON.
    Read {
        stream: String,
        /// `start` or a hub offset.
        #[arg(long, default_value = "start")]
        from: String,
        /// Output format (only `ndjson`).
        #[arg(long, default_value = "ndjson")]
        format: String,
        /// Stop after this many records.
        #[arg(long)]
        limit: Option<u64>,
        #[command(flatten)]
        target: Target,
    },
    /// List devices with their marks, fences and backlog (JSON).
    Devices {
        #[command(flatten)]
        target: Target,
    },
    /// Run a hub and simulated edges with flaky links, then verify the merged stream.
    Demo(core_hub::demo::DemoArgs),
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
    },
    /// Revoke a device; a running hub reloads the list.
    Revoke {
        #[arg(long)]
        dir: PathBuf,
        #[arg(long)]
        device: String,
        /// Revoke only the certificate with this serial (hex), not every certificate of the device.
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
            format,
            limit,
            target,
        } => {
            if format != "ndjson" {
                bail!("--format {format} is not supported; use ndjson");
            }
            runtime()?.block_on(read(&stream, &from, limit, &target))
        }
        Cmd::Devices { target } => runtime()?.block_on(devices(&target)),
        Cmd::Demo(args) => core_hub::demo::run(&args),
    }
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
    runtime()?.block_on(serve(hub.clone(), &cfg))?;
    hub.shutdown();
    Ok(())
}

/// Starts every listener and waits for a shutdown signal.
async fn serve(hub: Arc<Hub>, cfg: &HubConfig) -> Result<()> {
    let listener = tokio::net::TcpListener::bind(cfg.listen.http)
        .await
        .with_context(|| format!("binding the HTTP API on {}", cfg.listen.http))?;
    tracing::info!(addr = %listener.local_addr()?, "HTTP API listening");
    let router = api::router(hub.clone(), cfg.http.reader_tokens.clone());
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let http = tokio::spawn(api::serve(listener, router, {
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
    shutdown_signal().await;
    let _ = stop_tx.send(true);
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
        } => {
            let o = pki::issue_with_years(&dir, &device, &out, years)?;
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
            let path = pki::revoke(&dir, &device, serial.as_deref())?;
            println!("revoked {device} in {}", path.display());
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
            let token = t
                .token
                .clone()
                .or_else(|| cfg.http.reader_tokens.first().cloned());
            Ok(ApiTarget::from_listen(cfg.listen.http, token))
        }
    }
}

async fn read(stream: &str, from: &str, limit: Option<u64>, t: &Target) -> Result<()> {
    let target = api_target(t)?;
    let mut from = if from == "start" {
        0
    } else {
        from.parse::<u64>()
            .with_context(|| format!("--from {from}: use `start` or a hub offset"))?
    };
    let mut left = limit.unwrap_or(u64::MAX);
    let stdout = std::io::stdout();
    while left > 0 {
        let page = left.min(api::RECORDS_LIMIT_MAX as u64);
        let path = format!("/v1/streams/{stream}/records?from={from}&limit={page}");
        let resp = client::get(&target, &path).await?;
        if resp.status != 200 {
            bail!(
                "{} {}",
                resp.status,
                String::from_utf8_lossy(&resp.body).trim()
            );
        }
        if resp.body.is_empty() {
            break;
        }
        let next: u64 = resp
            .header(api::NEXT_OFFSET_HEADER)
            .and_then(|v| v.parse().ok())
            .context("response lacks the next-offset header")?;
        let lines = resp.body.iter().filter(|&&b| b == b'\n').count() as u64;
        let mut out = stdout.lock();
        out.write_all(&resp.body)?;
        out.flush()?;
        left = left.saturating_sub(lines);
        from = next;
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
