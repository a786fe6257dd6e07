//! `core-hub status [--watch SECS] [--json]`: health, streams and devices in one view.

use super::output;
use super::target::{self, Target};
use anyhow::Result;
use core_hub::client::ApiTarget;
use std::io::IsTerminal as _;
use std::time::Duration;

#[derive(clap::Args, Debug)]
pub struct StatusArgs {
    /// Re-render every SECS seconds until interrupted (default 2 when given bare).
    #[arg(long, value_name = "SECS", num_args = 0..=1, default_missing_value = "2")]
    pub watch: Option<u64>,
    /// Print one JSON object (`health`, `streams`, `devices`) instead of tables.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub target: Target,
}

pub fn status(a: &StatusArgs) -> Result<()> {
    super::runtime()?.block_on(async {
        let target = target::api_target(&a.target)?;
        let Some(secs) = a.watch else {
            return once(&target, a.json, false).await;
        };
        let every = Duration::from_secs(secs.max(1));
        loop {
            once(&target, a.json, true).await?;
            tokio::select! {
                () = tokio::time::sleep(every) => {}
                _ = tokio::signal::ctrl_c() => return Ok(()),
            }
        }
    })
}

/// One rendering; `watching` clears a terminal first (and separates renderings otherwise).
async fn once(target: &ApiTarget, json: bool, watching: bool) -> Result<()> {
    let health = match core_hub::client::get(target, "/healthz").await {
        Ok(r) => String::from_utf8_lossy(&r.body).trim().to_string(),
        Err(e) => return Err(target::unreachable(target, &e)),
    };
    let streams = target::get_json(target, "/v1/streams").await?;
    let devices = target::get_json(target, "/v1/devices").await?;
    if json {
        let v = serde_json::json!({"health": health, "streams": streams, "devices": devices});
        let mut s = serde_json::to_string(&v)?;
        s.push('\n');
        return Ok(output::print(&s)?);
    }
    let mut text = String::new();
    if watching && std::io::stdout().is_terminal() {
        text.push_str("\x1b[2J\x1b[H");
    } else if watching {
        text.push('\n');
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i64);
    text.push_str(&format!(
        "hub http://{}  at {}\nhealth: {}\n\n",
        target.authority,
        output::time(Some(now)),
        health.replace('\n', "; ")
    ));
    text.push_str(&super::streams::render_list(&streams));
    text.push('\n');
    text.push_str(&super::devices::render(&devices));
    Ok(output::print(&text)?)
}
