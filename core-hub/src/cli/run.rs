//! `core-hub run` (open the hub, serve until SIGTERM or Ctrl-C) and `core-hub recover`.

use anyhow::{Context, Result, bail};
use core_hub::{Hub, HubConfig, api};
use std::path::Path;
use std::sync::Arc;

pub fn run(config: &Path) -> Result<()> {
    let cfg = super::target::load_config(config)?;
    core_hub::logging::apply(cfg.log);
    let hub = Hub::open(&cfg).context("opening the hub")?;
    tracing::info!(data_dir = %cfg.data_dir.display(), "hub open");
    warn_tier2_placement(&cfg);
    // Checks sealed WAL files against the block index at start and then periodically; damaged
    // blocks are quarantined so readers skip them and the rest stays served.
    let scrubber = core_hub::scrub::Scrubber::start(
        hub.clone(),
        &cfg.data_dir,
        core_hub::scrub::DEFAULT_INTERVAL,
    );
    super::runtime()?.block_on(serve(hub.clone(), &cfg))?;
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
            tracing::info!(broker = %format!("{}:{}", r.host, r.port), streams = %core_hub::logging::List(&r.streams), "republishing to MQTT");
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
    // Ends follow responses at once, so no reader holds the hub; bounded by a grace period.
    api::shut_down(&hub, http).await.context("HTTP server")?;
    let _ = tier_task.await;
    let _ = tier2_scrub.await;
    for task in republish {
        let _ = task.await;
    }
    if let Some(task) = quic {
        task.await.context("QUIC task")?;
    }
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

/// A local tier 2 on the data directory's disk is no backup of it: say so at every start.
fn warn_tier2_placement(cfg: &HubConfig) {
    let place = match cfg.tier2_placement() {
        Some(core_hub::config::Tier2Placement::InsideDataDir) => "inside data_dir",
        Some(core_hub::config::Tier2Placement::SameFilesystem) => "on the filesystem of data_dir",
        None => return,
    };
    tracing::warn!(
        tier2 = %cfg.tier2.url,
        data_dir = %cfg.data_dir.display(),
        "tier 2 is {place}: losing that disk loses tier 1 and tier 2 together; \
         set tier2.url to an S3 bucket or a directory on another disk (docs/operations.md)"
    );
}

/// `core-hub recover --from-tier2`.
pub fn recover(config: &Path, from_tier2: bool) -> Result<()> {
    if !from_tier2 {
        bail!("only `core-hub recover --from-tier2` is supported: add --from-tier2");
    }
    super::runtime()?.block_on(recover_from_tier2(config))
}

async fn recover_from_tier2(config: &Path) -> Result<()> {
    let cfg = super::target::load_config(config)?;
    let bar = indicatif::ProgressBar::new(0);
    let report = core_hub::tiering::recover::from_tier2(&cfg, |stream, done, total| {
        bar.set_length(total);
        bar.set_position(done);
        bar.set_message(stream.to_string());
    })
    .await?;
    bar.finish_and_clear();
    super::output::print(&format!(
        "recovered {} streams, {} chunks, {} records, {} device lanes ({} uncommitted chunk files adopted)",
        report.streams, report.chunks, report.records, report.lanes, report.adopted
    ))?;
    Ok(())
}
