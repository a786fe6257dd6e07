//! A hub with its QUIC server in a temp dir with a fresh PKI, and devices that connect to it
//! with certificates issued there: for the tests that speak the sync protocol over real QUIC.

use anyhow::Result;
use core_hub::config::TlsPaths;
use core_hub::server::Mutation;
use core_hub::{Hub, HubConfig};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::sync::watch;

/// A running hub; its server stops and its directory goes when dropped.
pub struct Running {
    _dir: tempfile::TempDir,
    pub pki: PathBuf,
    pub hub: Arc<Hub>,
    pub quic: SocketAddr,
    _stop: watch::Sender<bool>,
}

/// Starts a hub on loopback with `edit` applied to its config, and `mutation` in its server.
pub async fn start(mutation: Mutation, edit: impl FnOnce(&mut HubConfig)) -> Result<Running> {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_test_writer()
        .try_init();
    let dir = tempfile::tempdir()?;
    let pki = dir.path().join("pki");
    core_hub::pki::init(&pki, &[], false)?;
    let cfg = super::config(&dir.path().join("hub"), |c: &mut HubConfig| {
        c.listen.quic = "127.0.0.1:0".parse().unwrap();
        c.tls = Some(TlsPaths::new(
            pki.join("ca.pem"),
            pki.join("hub.pem"),
            pki.join("hub.key"),
        ));
        edit(c);
    });
    let hub = Hub::open(&cfg)?;
    let (stop, stop_rx) = watch::channel(false);
    let (server, _task) = match mutation {
        Mutation::None => core_hub::server::start(&cfg, hub.clone(), stop_rx).await?,
        m => core_hub::server::start_with_mutation(&cfg, hub.clone(), stop_rx, m).await?,
    };
    Ok(Running {
        _dir: dir,
        pki,
        hub,
        quic: server.local_addr,
        _stop: stop,
    })
}

/// Issues a certificate for `device`; returns its directory and serial.
pub fn issue(pki: &Path, device: &str) -> Result<(PathBuf, String)> {
    let out = pki.with_file_name(format!("cert-{device}"));
    let issued = core_hub::pki::issue(pki, device, &out)?;
    Ok((out, issued.serial))
}

/// Connects to the hub at `quic` with the certificate in `cert` (from [`issue`]).
pub async fn connect(quic: SocketAddr, cert: &Path) -> Result<quinn::Connection> {
    let tls = edge_agent::link::TlsPaths {
        ca: cert.join("ca.pem"),
        cert: cert.join("device.pem"),
        key: cert.join("device.key"),
    };
    let mut endpoint = edge_agent::link::client_endpoint("127.0.0.1:0".parse()?)?;
    endpoint.set_default_client_config(edge_agent::link::client_config(&tls)?);
    Ok(endpoint.connect(quic, "localhost")?.await?)
}
