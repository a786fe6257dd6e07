//! Temporary probe (deleted after use): lossy drain diagnostics.
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use anyhow::Result;
use serde_json::json;
use tributary_tests::cluster::{self, AgentSpec, HubSpec, Pki};
use tributary_tests::ledger::{Ledger, Producer, SentRecord};
use tributary_tests::netem::{Impairment, ProxyConfig, UdpImpairProxy};
use tributary_tests::procs::wait_until;

fn records(n: u64) -> Vec<SentRecord> {
    (0..n).map(|i| {
        let mut x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
        let pad: String = (0..100).map(|_| { x ^= x << 13; x ^= x >> 7; x ^= x << 17; char::from(b'a' + (x % 26) as u8) }).collect();
        SentRecord::new(format!("k{}", i % 7), 5_000 + i as i64, json!({ "i": i, "pad": pad }))
    }).collect()
}

fn drain(root: &std::path::Path, pki: &Pki, dev: &str, via: SocketAddr) -> Result<(Duration, String)> {
    let cert = pki.issue(dev, None)?;
    let mut spec = AgentSpec::new(root, dev, cert, None);
    let mut a = spec.start()?;
    let p = Producer::new(dev, spec.http);
    let mut l = Ledger::new();
    for c in records(40_000).chunks(500) { p.post(&mut l, "telemetry", c, None)?; }
    a.terminate(Duration::from_secs(20))?;
    spec.hub = Some(via);
    let a = spec.spawn()?;
    let mut up = None;
    wait_until(Duration::from_secs(120), "drain", || {
        let Ok(s) = cluster::status(spec.http) else { return false };
        if up.is_none() && cluster::link(&s) == "up" { up = Some(Instant::now()); }
        up.is_some() && cluster::caught_up(&s)
    })?;
    let log = a.stderr();
    Ok((up.unwrap().elapsed(), format!("sessions ended: {}, established: {}", log.matches("session ended").count(), log.matches("session established").count())))
}

#[test]
fn probe() -> Result<()> {
    let root = tempfile::tempdir()?;
    let pki = Pki::init(root.path().join("pki"))?;
    let hs = HubSpec::new(root.path());
    let _h = hs.start(&pki)?;
    for (name, loss, delay) in [("clean50", 0.0, 50), ("loss5-50", 0.05, 50), ("loss5-0", 0.05, 0), ("loss1-50", 0.01, 50)] {
        let imp = Impairment { delay: Duration::from_millis(delay), loss, ..Impairment::none() };
        let mut cfg = ProxyConfig::new(hs.quic);
        cfg.client_to_upstream = imp.clone();
        cfg.upstream_to_client = imp;
        let px = UdpImpairProxy::start(cfg)?;
        let (t, info) = drain(root.path(), &pki, name, px.local_addr())?;
        let st = px.stats();
        println!("PROBE {name}: {t:.2?}; {info}; c2u fwd {} bytes, dropped {}; u2c dropped {}", st.client_to_upstream.forwarded_bytes, st.client_to_upstream.dropped(), st.upstream_to_client.dropped());
    }
    Ok(())
}
