//! The binary's subcommands. Each is a plain function returning `anyhow::Result`; `main` prints
//! the error chain as one line and exits non-zero.

pub mod doctor;
pub mod ingest;
pub mod inspect;
pub mod lock;
pub mod run;
pub mod status;

use std::path::Path;

use anyhow::Context as _;
use edge_agent::config::EdgeConfig;
use edge_agent::http::client::Client;

/// The agent's API when neither `--config` nor `--url` is given.
pub const DEFAULT_URL: &str = "http://127.0.0.1:7401";

/// Loads the config, with the file name in the error.
pub fn load_config(path: &Path) -> anyhow::Result<EdgeConfig> {
    EdgeConfig::load(path).with_context(|| format!("invalid config {}", path.display()))
}

/// A client for the running agent: from `--url`, else from the config's `http.listen` and
/// `http.token`, else the default address.
pub fn agent_client(
    config: Option<&Path>,
    url: Option<String>,
    token: Option<String>,
) -> anyhow::Result<Client> {
    let (url, config_token) = match (url, config) {
        (Some(url), _) => (url, None),
        (None, Some(path)) => {
            let cfg = load_config(path)?;
            (
                format!("http://{}", loopback_for(cfg.http.listen)),
                cfg.http.token,
            )
        }
        (None, None) => (DEFAULT_URL.to_owned(), None),
    };
    let client = Client::new(&url).with_context(|| format!("--url {url:?}"))?;
    Ok(client.with_token(token.or(config_token)))
}

/// An agent listening on every interface is reached on loopback.
fn loopback_for(listen: std::net::SocketAddr) -> std::net::SocketAddr {
    let mut addr = listen;
    if addr.ip().is_unspecified() {
        let ip = match addr {
            std::net::SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
            std::net::SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
        };
        addr.set_ip(ip);
    }
    addr
}

/// The message for an agent that does not answer.
pub fn unreachable(client: &Client, e: &dyn std::fmt::Display) -> anyhow::Error {
    anyhow::anyhow!(
        "could not reach the agent at {}: is `edge-agent run` running? ({e})",
        client.url()
    )
}

/// A current-thread runtime for the client commands.
pub fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
}
