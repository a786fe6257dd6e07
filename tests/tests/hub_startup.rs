//! Start-up order: the hub's `/healthz` is not ready before tier 2 is open, and a tier 2 that
//! is not reachable yet does not end the process.
//!
//! The hub starts with tier 2 on an S3 endpoint (`s3s-fs`) whose server is not running yet:
//! it stays up, `/healthz` answers 503 naming tier 2 and the reason, `/metrics` counts the
//! failed attempts and shows `tributary_hub_ready 0`. Once the server starts on that port the
//! hub becomes ready by itself, without a restart (same pid), and a device's records reach
//! tier 2. A misconfigured tier 2 (a URL that is neither `file://` nor `s3://`) still ends the
//! process at once with an error naming the key.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use tributary_tests::cluster::{self, HubSpec, Pki, START_TIMEOUT};
use tributary_tests::procs::{Proc, wait_until};
use tributary_tests::{http, ports, tier2};

const BUCKET: &str = "tier2";

fn s3_toml(port: u16) -> String {
    format!(
        "[tier2]\nurl = \"s3://{BUCKET}\"\nendpoint = \"http://127.0.0.1:{port}\"\n\
         region = \"us-east-1\"\naccess_key_id = \"{}\"\nsecret_access_key = \"{}\"\n",
        tier2::S3_KEYS.0,
        tier2::S3_KEYS.1
    )
}

/// Spawns the hub of `spec` without waiting for it to be ready.
fn spawn_hub(spec: &HubSpec, pki: &Pki) -> Result<Proc> {
    spec.spawn(pki)
}

#[test]
fn the_hub_waits_for_tier2_and_becomes_ready_by_itself() -> Result<()> {
    let root = tempfile::Builder::new().prefix("trb-startup-").tempdir()?;
    let pki = Pki::init(root.path().join("pki"))?;
    let s3_port = ports::tcp();
    let mut spec = HubSpec::new(root.path());
    spec.extra_toml = s3_toml(s3_port);
    let mut hub = spawn_hub(&spec, &pki)?;

    // Up, answering, not ready, saying why; the failed attempts are counted.
    let why = tributary_tests::procs::wait_for(START_TIMEOUT, "a not-ready /healthz", || {
        let r = http::get(spec.http, "/healthz").ok()?;
        (r.status == 503 && r.text().contains("attempt")).then(|| r.text())
    })
    .with_context(|| hub.log_tail(40))?;
    ensure!(
        why.contains("attempt"),
        "the reason names the attempt: {why}"
    );
    wait_until(START_TIMEOUT, "two failed attempts counted", || {
        cluster::fetch_metric(spec.http, "tributary_hub_tier2_open_failures_total")
            .is_ok_and(|n| n >= 2.0)
    })?;
    ensure!(cluster::fetch_metric(spec.http, "tributary_hub_ready")? == 0.0);
    ensure!(hub.is_running(), "the hub exited:\n{}", hub.log_tail(40));
    let pid = hub.pid();
    ensure!(
        (hub.stderr() + &hub.stdout()).contains("cannot open tier 2 yet"),
        "the failures are logged with their reason:\n{}",
        hub.log_tail(40)
    );

    // The store comes up: the same process becomes ready on its own.
    let _s3 = tier2::spawn_s3s_fs(&root.path().join("s3"), s3_port, BUCKET)?;
    hub.wait_http_ok(spec.http, "/healthz", Duration::from_secs(60))?;
    ensure!(
        hub.pid() == pid && hub.spawns() == 1,
        "the hub was restarted"
    );
    ensure!(cluster::fetch_metric(spec.http, "tributary_hub_ready")? == 1.0);
    hub.terminate(Duration::from_secs(20))?;
    Ok(())
}

#[test]
fn a_misconfigured_tier2_fails_fast_with_a_clear_error() -> Result<()> {
    // A URL that is neither file:// nor s3://, and an S3 tier 2 without credentials.
    let cases = [
        (
            "[tier2]\nurl = \"ftp://nowhere/tier2\"\n".to_string(),
            "tier2.url",
        ),
        (
            "[tier2]\nurl = \"s3://tier2\"\nendpoint = \"http://127.0.0.1:9\"\n".to_string(),
            "access_key_id",
        ),
    ];
    for (toml, named) in cases {
        let root = tempfile::Builder::new().prefix("trb-startup-").tempdir()?;
        let pki = Pki::init(root.path().join("pki"))?;
        let mut spec = HubSpec::new(root.path());
        spec.extra_toml = toml;
        let mut hub = spawn_hub(&spec, &pki)?;
        let status = hub.wait_exit(START_TIMEOUT)?;
        ensure!(!status.success(), "the hub ran with {}", spec.extra_toml);
        let log = hub.stderr() + &hub.stdout();
        ensure!(log.contains(named), "the error names {named}:\n{log}");
    }
    Ok(())
}
