//! Which hub the API commands talk to (`--url`, `--config`, `hub.toml`), and their requests:
//! an answer other than 200, or a hub that does not answer, becomes one line saying so and
//! what to do.

use super::error::{Exit, coded};
use anyhow::{Context as _, Result};
use core_hub::HubConfig;
use core_hub::client::{self, ApiTarget, ClientError, HttpResponse};
use std::path::{Path, PathBuf};

/// The config read when neither `--url` nor `--config` is given.
pub const DEFAULT_CONFIG: &str = "hub.toml";

#[derive(clap::Args, Debug, Clone)]
pub struct Target {
    /// The hub's config; the API address and first admin or reader token come from it
    /// (default: ./hub.toml).
    #[arg(long, conflicts_with = "url")]
    pub config: Option<PathBuf>,
    /// The hub's API, e.g. http://127.0.0.1:7480.
    #[arg(long)]
    pub url: Option<String>,
    /// A reader (or admin) bearer token.
    #[arg(long, env = "TRIBUTARY_HUB_TOKEN")]
    pub token: Option<String>,
}

/// Where to send requests.
pub fn api_target(t: &Target) -> Result<ApiTarget> {
    if let Some(url) = &t.url {
        return ApiTarget::parse(url, t.token.clone())
            .with_context(|| "--url: use the hub's API address, e.g. http://127.0.0.1:7480");
    }
    let path = t
        .config
        .clone()
        .unwrap_or_else(|| PathBuf::from(DEFAULT_CONFIG));
    if t.config.is_none() && !path.exists() {
        return Err(coded(
            Exit::Failed,
            format!(
                "no hub to talk to: there is no {DEFAULT_CONFIG} here; point at a hub with \
                 --url http://HOST:7480 or --config /path/to/hub.toml"
            ),
        ));
    }
    let cfg = load_config(&path)?;
    // An admin token also reads, and `devices retire` needs one.
    let token = t
        .token
        .clone()
        .or_else(|| cfg.http.admin_tokens.first().cloned())
        .or_else(|| cfg.http.reader_tokens.first().cloned());
    Ok(ApiTarget::from_listen(cfg.listen.http, token))
}

/// Loads a hub config, naming the file.
pub fn load_config(path: &Path) -> Result<HubConfig> {
    HubConfig::load(path).with_context(|| format!("invalid config {}", path.display()))
}

/// The error for a hub that does not answer.
pub fn unreachable(target: &ApiTarget, e: &ClientError) -> anyhow::Error {
    coded(
        Exit::Unreachable,
        format!(
            "cannot reach the hub API at http://{} ({e}): is `core-hub run` running there? \
             Point at another hub with --url or --config",
            target.authority
        ),
    )
}

/// The error for an answer other than 200: its status and the API's message.
pub fn api_error(resp: &HttpResponse) -> anyhow::Error {
    let body = String::from_utf8_lossy(&resp.body);
    let msg = serde_json::from_str::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v.get("error").and_then(|e| e.as_str()).map(str::to_string))
        .unwrap_or_else(|| body.trim().to_string());
    let what = match resp.status {
        401 => "; pass a token with --token or TRIBUTARY_HUB_TOKEN (an admin token for changes)",
        403 => "; this needs an admin token (http.admin_tokens)",
        _ => "",
    };
    coded(
        Exit::Failed,
        format!("the hub answered {}: {msg}{what}", resp.status),
    )
}

/// `GET path`, which must answer 200.
pub async fn get_ok(target: &ApiTarget, path: &str) -> Result<HttpResponse> {
    let resp = client::get(target, path)
        .await
        .map_err(|e| unreachable(target, &e))?;
    if resp.status != 200 {
        return Err(api_error(&resp));
    }
    Ok(resp)
}

/// `POST path`, which must answer 200.
pub async fn post_ok(target: &ApiTarget, path: &str) -> Result<HttpResponse> {
    let resp = client::post(target, path)
        .await
        .map_err(|e| unreachable(target, &e))?;
    if resp.status != 200 {
        return Err(api_error(&resp));
    }
    Ok(resp)
}

/// `GET path` as JSON.
pub async fn get_json(target: &ApiTarget, path: &str) -> Result<serde_json::Value> {
    let resp = get_ok(target, path).await?;
    serde_json::from_slice(&resp.body)
        .with_context(|| format!("the hub's answer to {path} is not JSON"))
}
