//! `edge-agent run`: lock the data directory, recover the local log, serve the HTTP API, and
//! shut down cleanly on SIGTERM or ctrl-c (in-flight batches finish, the log is flushed and
//! fsynced).

use std::path::Path;
use std::sync::Arc;

use anyhow::Context as _;
use edge_agent::config::{EdgeConfig, fsync_name};
use edge_agent::http::status::LinkState;
use edge_agent::http::{self, AppState};
use edge_agent::link::TlsPaths;
use edge_agent::log::{Log, LogHandle};
use edge_agent::replicator::{self, LinkStatus, ReplicatorConfig};
use edge_agent::storage::RealStorage;
use tracing::info;

use super::lock::DataDirLock;

pub fn run(config_path: &Path) -> anyhow::Result<()> {
    let cfg = super::load_config(config_path)?;
    edge_agent::logging::apply(cfg.log_format);
    let _lock = DataDirLock::acquire(&cfg.data_dir)?;
    // Recovery logs what it found and did ("local log recovered ...").
    let (log, _report) = Log::open(cfg.log_config(), Arc::new(RealStorage))
        .with_context(|| format!("opening the local log in {}", cfg.data_dir.display()))?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("edge-agent")
        .build()
        .context("starting the async runtime")?;
    let served = runtime.block_on(serve(&cfg, log.clone()));
    // Flush and fsync whatever the writer still holds, even when serving failed.
    log.shutdown();
    served?;
    info!("stopped");
    Ok(())
}

async fn serve(cfg: &EdgeConfig, log: LogHandle) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(cfg.http.listen)
        .await
        .with_context(|| {
            format!(
                "could not listen on {} (http.listen): is another process using it?",
                cfg.http.listen
            )
        })?;
    let addr = listener.local_addr()?;
    let app = AppState::new(cfg, log.clone());
    // MQTT and other sources: `/healthz` stays 503 until their subscriptions are granted.
    edge_agent::sources::spawn_all(cfg, app.ingest.clone(), app.sources.clone())?;
    // Derived streams: each resolves its pending batch before it appends anything.
    edge_agent::filters::derive::spawn_all(cfg, app.ingest.clone()).await;
    if let (Some(hub), Some(tls)) = (&cfg.hub, &cfg.tls) {
        let paths = TlsPaths {
            ca: tls.ca.clone(),
            cert: tls.cert.clone(),
            key: tls.key.clone(),
        };
        let mut rcfg = ReplicatorConfig::new(hub.addr.clone(), hub.server_name.clone(), paths);
        rcfg.backoff_max = hub.backoff_max;
        rcfg.storage_full_retry = hub.storage_full_retry;
        rcfg.bandwidth_bytes_per_s = hub.bandwidth_bytes_per_s;
        rcfg.priorities = cfg
            .streams
            .iter()
            .map(|s| (s.name.clone(), s.priority))
            .collect();
        rcfg.local_only = cfg
            .streams
            .iter()
            .filter(|s| !s.replicate)
            .map(|s| s.name.clone())
            .collect();
        let status = Arc::new(LinkStatus::default());
        let _ = app.replication.set(status.clone());
        let mut up = status.subscribe_up();
        let app_link = app.clone();
        tokio::spawn(async move {
            while up.changed().await.is_ok() {
                let state = if *up.borrow() {
                    LinkState::Up
                } else {
                    LinkState::Down
                };
                *app_link.link.write().unwrap_or_else(|e| e.into_inner()) = state;
            }
        });
        info!(hub = %hub.addr, "replicating to the hub");
        tokio::spawn(replicator::run(rcfg, log.clone(), status));
    }
    edge_agent::notify::ready();
    tokio::spawn(edge_agent::notify::watchdog(log));
    info!(
        http = %format!("http://{addr}"),
        fsync = fsync_name(&cfg.storage.fsync),
        streams = cfg.streams.len(),
        "edge-agent ready"
    );
    http::serve(listener, app, shutdown_signal())
        .await
        .context("serving the HTTP API")
}

/// Resolves on SIGTERM or ctrl-c (SIGINT).
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        () = ctrl_c => info!("ctrl-c: shutting down"),
        () = terminate => info!("SIGTERM: shutting down"),
    }
}
