//! Revocation against a live session, over real QUIC: the hub and its QUIC server run in this
//! process, a device built on the protocol's `Sender` keeps shipping blocks, and the operator
//! revokes with the real `core-hub pki revoke`.
//!
//! - Revoking the device's certificate by serial, written the way `openssl x509 -text` prints
//!   it (`42:BB:57:…`), drops the live session; no record of it is committed after the device
//!   saw the drop; the certificate cannot reconnect; `/metrics` counts the closed session.
//! - A line edited by hand whose serial cannot be read revokes that device whole (fail closed)
//!   and is counted as invalid; a serial that matches no issued certificate is counted as
//!   unmatched.
//! - A device refused for a revocation by serial (its live session dropped, then its
//!   certificate refused at the handshake, and a device refused at its very first handshake)
//!   is shown revoked on the status page, in `GET /v1/devices` and by `core-hub devices`, with
//!   the line of the list and when; re-issued, it is accepted and shown revoked no more.
//! - Mutation checks (`core_hub::server::Mutation`, feature `fault-injection`): with live
//!   sessions checked by device only, the session revoked by serial keeps committing; with the
//!   close sent before the session's commits settled, records land after the device saw the
//!   drop. Each proves the test above fails without its guard.

mod common;

use common::quic::{Running, connect, issue};

use anyhow::{Context, Result, bail, ensure};
use core_hub::Hub;
use core_hub::server::Mutation;
use serde_json::Value;
use std::path::Path;
use std::time::{Duration, Instant as StdInstant};
use sync::block::{VERSION_ROWS, encode_block};
use sync::protocol::{
    Backlog, ErrorCode, FrameBuffer, Instant, LaneAnnounce, Sender, SenderConfig, SenderEvent,
    TransmitKind,
};
use tokio::sync::watch;

const STREAM: &str = "telemetry";
const EPOCH: u64 = 1;
const RECORDS_PER_BLOCK: u64 = 20;
/// Blocks the device keeps unacknowledged, so commits are in flight when it is revoked.
const IN_FLIGHT_BLOCKS: u64 = 4;
/// Generous: the hub polls the list every 250 ms; this only bounds a broken build's wait.
const WAIT: Duration = Duration::from_secs(20);

async fn start() -> Result<Running> {
    start_with(Mutation::None).await
}

async fn start_with(mutation: Mutation) -> Result<Running> {
    common::quic::start(mutation, |_| {}).await
}

/// `openssl x509 -text` style: uppercase pairs between colons.
fn colon_form(serial: &str) -> String {
    let even = if serial.len() % 2 == 1 {
        format!("0{serial}")
    } else {
        serial.to_string()
    };
    let pairs: Vec<String> = even
        .as_bytes()
        .chunks(2)
        .map(|p| String::from_utf8_lossy(p).to_uppercase())
        .collect();
    pairs.join(":")
}

fn core_hub_cli(args: &[&str]) -> Result<std::process::Output> {
    Ok(std::process::Command::new(env!("CARGO_BIN_EXE_core-hub"))
        .args(args)
        .env("NO_COLOR", "1")
        .output()?)
}

/// How a device's session ended, as the device saw it.
#[derive(Debug)]
struct Ended {
    code: Option<u64>,
    /// The highest seq the hub acknowledged.
    acked: u64,
}

/// The device's log: block `n` holds seqs `n * RECORDS_PER_BLOCK + 1 ..`.
fn device_block(device: &str, n: u64) -> Vec<u8> {
    let first = n * RECORDS_PER_BLOCK + 1;
    let records = common::records(device, first, first + RECORDS_PER_BLOCK - 1);
    encode_block(VERSION_ROWS, EPOCH, first, &records).unwrap()
}

/// Runs one device session: it ships blocks for ever, keeping [`IN_FLIGHT_BLOCKS`]
/// unacknowledged, and reports every ack on `acked`. Returns when the session ends.
async fn device(
    device: String,
    conn: quinn::Connection,
    acked: watch::Sender<u64>,
) -> Result<Ended> {
    let clock = StdInstant::now();
    let now = || Instant::from_nanos(clock.elapsed().as_nanos() as u64);
    let (mut ctl_tx, mut ctl_rx) = conn.open_bi().await?;
    let lane = LaneAnnounce {
        stream: STREAM.into(),
        epoch: EPOCH,
        first_seq: 1,
        last_seq: 0,
        acked_seq: 0,
        backlog: Backlog::default(),
        gaps: Vec::new(),
    };
    let mut sender = Sender::new(SenderConfig::default(), EPOCH, vec![lane], now())?;
    let mut frames = FrameBuffer::new(SenderConfig::default().frame_bytes_max);
    let mut written = 0u64;
    let mut durable = 0u64;
    let mut buf = vec![0u8; 64 << 10];
    let ended = |code, durable| {
        Ok(Ended {
            code,
            acked: durable,
        })
    };
    loop {
        // Keep the log ahead of the acks, so blocks are always in flight.
        while written < durable / RECORDS_PER_BLOCK + IN_FLIGHT_BLOCKS {
            sender.offer_block(now(), STREAM, device_block(&device, written))?;
            written += 1;
        }
        while let Some(t) = sender.poll_transmit() {
            let sent = match t.kind {
                TransmitKind::Control => ctl_tx.write_all(&t.frame).await.map_err(|_| ()),
                TransmitKind::Data => send_uni(&conn, &t.frame).await,
            };
            if sent.is_err() {
                return ended(close_code(&conn).await, durable);
            }
        }
        let mut progressed = false;
        while let Some(ev) = sender.poll_event() {
            progressed = true;
            match ev {
                SenderEvent::WantBlocks { after_seq, .. } => {
                    let blocks = (after_seq / RECORDS_PER_BLOCK..written)
                        .map(|n| device_block(&device, n))
                        .collect();
                    sender.supply_blocks(now(), STREAM, EPOCH, blocks)?;
                }
                SenderEvent::Acked { durable_seq, .. } => {
                    durable = durable.max(durable_seq);
                    acked.send_replace(durable);
                }
                SenderEvent::Closed(r) => {
                    return ended(Some(u64::from(r.code.to_u16())), durable);
                }
                SenderEvent::Established { .. } => {}
                SenderEvent::MintEpoch { .. } => bail!("unexpected MintEpoch"),
                SenderEvent::StreamRefused { stream, .. } => {
                    bail!("unexpected refusal of {stream}")
                }
                SenderEvent::StreamRetrying { .. } => {}
            }
        }
        if progressed {
            continue;
        }
        tokio::select! {
            read = ctl_rx.read(&mut buf) => match read {
                Ok(Some(n)) => {
                    frames.push(&buf[..n]);
                    while let Some(f) = frames.next_frame()? {
                        sender.handle_frame(now(), &f);
                    }
                }
                Ok(None) | Err(_) => return ended(close_code(&conn).await, durable),
            },
            _ = conn.closed() => return ended(close_code(&conn).await, durable),
        }
    }
}

async fn send_uni(conn: &quinn::Connection, frame: &[u8]) -> Result<(), ()> {
    let mut s = conn.open_uni().await.map_err(|_| ())?;
    s.write_all(frame).await.map_err(|_| ())?;
    s.finish().map_err(|_| ())
}

/// The application close code, once the connection is closed.
async fn close_code(conn: &quinn::Connection) -> Option<u64> {
    match conn.closed().await {
        quinn::ConnectionError::ApplicationClosed(c) => Some(c.error_code.into_inner()),
        _ => None,
    }
}

/// Waits for `cond` to hold, checking every few milliseconds, up to [`WAIT`].
async fn wait_for(what: &str, mut cond: impl FnMut() -> bool) -> Result<()> {
    let deadline = StdInstant::now() + WAIT;
    while !cond() {
        ensure!(StdInstant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(())
}

fn metric(hub: &Hub, name: &str) -> u64 {
    let text = core_hub::metrics::render(hub);
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in\n{text}"))
}

/// The hub's durable mark of the device's lane.
fn durable_seq(hub: &Hub, device: &str) -> u64 {
    hub.marks(device)
        .iter()
        .find(|m| m.stream == STREAM && m.epoch == EPOCH)
        .map_or(0, |m| m.durable_seq)
}

/// A device session running on its own task, and the acks it got.
type Session = (tokio::task::JoinHandle<Result<Ended>>, watch::Receiver<u64>);

/// Starts `name`'s device and waits until the hub acknowledged a few blocks.
async fn ingesting(run: &Running, name: &str, cert: &Path) -> Result<Session> {
    let conn = connect(run.quic, cert).await?;
    let (acked_tx, mut acked_rx) = watch::channel(0u64);
    let task = tokio::spawn(device(name.to_string(), conn, acked_tx));
    let target = 10 * RECORDS_PER_BLOCK;
    tokio::time::timeout(WAIT, acked_rx.wait_for(|&a| a >= target))
        .await
        .context("the device was not acknowledged in time")??;
    Ok((task, acked_rx))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoking_by_serial_in_colon_form_drops_the_live_session() -> Result<()> {
    let run = start().await?;
    let (cert, serial) = issue(&run.pki, "dev-1")?;
    let (mut session, _) = ingesting(&run, "dev-1", &cert).await?;
    assert_eq!(
        metric(&run.hub, "tributary_hub_revoked_sessions_closed_total"),
        0
    );

    let colon = colon_form(&serial);
    let pki = run.pki.display().to_string();
    let revoked_at = StdInstant::now();
    let out = core_hub_cli(&[
        "pki", "revoke", "--dir", &pki, "--device", "dev-1", "--serial", &colon,
    ])?;
    ensure!(
        out.status.success(),
        "pki revoke: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    let ended = tokio::time::timeout(WAIT, &mut session)
        .await
        .context("the revoked session was not dropped")???;
    let latency = revoked_at.elapsed();
    // What the hub holds the moment the device saw its session end.
    let held = durable_seq(&run.hub, "dev-1");
    let committed = metric(&run.hub, "tributary_hub_records_committed_total");
    println!(
        "revoked serial {colon}: session dropped after {latency:?} with code {:?}; \
         acked {} and durable {held} at the drop",
        ended.code, ended.acked
    );
    assert_eq!(ended.code, Some(u64::from(ErrorCode::Revoked.to_u16())));
    assert!(held >= ended.acked && ended.acked >= 10 * RECORDS_PER_BLOCK);

    // The certificate cannot come back: a new session ends without a single ack.
    let again = tokio::time::timeout(WAIT, async {
        let conn = connect(run.quic, &cert).await?;
        let (acked_tx, _acked_rx) = watch::channel(0u64);
        device("dev-1".into(), conn, acked_tx).await
    })
    .await
    .context("the revoked certificate kept a session")?;
    match again {
        Err(e) => println!("reconnect refused at the handshake: {e}"),
        Ok(again) => {
            println!("reconnect refused: {again:?}");
            assert_eq!(again.acked, 0, "the revoked certificate shipped data");
        }
    }
    // The hub counts the closed session.
    let hub = run.hub.clone();
    wait_for("the closed session on /metrics", || {
        metric(&hub, "tributary_hub_revoked_sessions_closed_total") == 1
    })
    .await?;
    assert_eq!(metric(&run.hub, "tributary_hub_revocation_entries"), 1);
    assert_eq!(
        metric(&run.hub, "tributary_hub_revocation_entries_invalid"),
        0
    );
    assert_eq!(
        metric(&run.hub, "tributary_hub_revocation_entries_unmatched"),
        0
    );
    // Nothing of the session became durable after the device saw it end.
    assert_eq!(durable_seq(&run.hub, "dev-1"), held);
    assert_eq!(
        metric(&run.hub, "tributary_hub_records_committed_total"),
        committed
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_line_revokes_its_device_whole_and_is_counted() -> Result<()> {
    let run = start().await?;
    let (cert, _) = issue(&run.pki, "dev-2")?;
    let (mut session, _) = ingesting(&run, "dev-2", &cert).await?;

    // Edited by hand: a serial with a one-digit group (dev-2), and a well-formed serial nobody
    // was issued (dev-3). The hub takes neither as written and says so.
    let list = run.pki.join(core_hub::pki::REVOKED_FILE);
    std::fs::write(&list, "dev-2 42:b:57\ndev-3 abcdef\n")?;
    let ended = tokio::time::timeout(WAIT, &mut session)
        .await
        .context("the session of the unreadable line's device was not dropped")???;
    assert_eq!(ended.code, Some(u64::from(ErrorCode::Revoked.to_u16())));
    let hub = run.hub.clone();
    wait_for("the invalid and unmatched lines on /metrics", || {
        metric(&hub, "tributary_hub_revocation_entries_invalid") == 1
            && metric(&hub, "tributary_hub_revocation_entries_unmatched") == 1
    })
    .await?;
    println!(
        "hand-edited list: dev-2 dropped with code {:?}, invalid 1, unmatched 1",
        ended.code
    );
    Ok(())
}

/// Revokes `device`'s certificate `serial` in colon form through the CLI.
fn revoke_serial(run: &Running, device: &str, serial: &str) -> Result<()> {
    let pki = run.pki.display().to_string();
    let colon = colon_form(serial);
    let out = core_hub_cli(&[
        "pki", "revoke", "--dir", &pki, "--device", device, "--serial", &colon,
    ])?;
    ensure!(
        out.status.success(),
        "pki revoke: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutation_with_serials_unchecked_the_revoked_session_keeps_committing() -> Result<()> {
    let run = start_with(Mutation::RevokeByDeviceOnly).await?;
    let (cert, serial) = issue(&run.pki, "dev-1")?;
    let (session, mut acked) = ingesting(&run, "dev-1", &cert).await?;
    revoke_serial(&run, "dev-1", &serial)?;
    let hub = run.hub.clone();
    wait_for("the hub to load the revocation", || {
        metric(&hub, "tributary_hub_revocation_entries") == 1
    })
    .await?;
    // Far more than the blocks in flight: only a session that was not dropped gets there.
    let at_reload = *acked.borrow();
    let target = at_reload + 10 * IN_FLIGHT_BLOCKS * RECORDS_PER_BLOCK;
    tokio::time::timeout(WAIT, acked.wait_for(|&a| a >= target))
        .await
        .context("the mutation did not take: the session was dropped")??;
    println!("serials unchecked: acked {at_reload} at the reload, {target}+ after it");
    assert!(!session.is_finished());
    assert_eq!(
        metric(&run.hub, "tributary_hub_revoked_sessions_closed_total"),
        0
    );
    session.abort();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutation_closing_before_commits_settle_lands_records_after_the_drop() -> Result<()> {
    // Whether a commit is in flight at the revocation is timing: rounds until one is.
    let rounds = 30;
    for round in 1..=rounds {
        let run = start_with(Mutation::CloseBeforeSettle).await?;
        let (cert, serial) = issue(&run.pki, "dev-1")?;
        let (session, _) = ingesting(&run, "dev-1", &cert).await?;
        revoke_serial(&run, "dev-1", &serial)?;
        tokio::time::timeout(WAIT, session)
            .await
            .context("the revoked session was not dropped")???;
        let held = durable_seq(&run.hub, "dev-1");
        let hub = run.hub.clone();
        // The hub counts the close once the session's commits settled.
        wait_for("the closed session on /metrics", || {
            metric(&hub, "tributary_hub_revoked_sessions_closed_total") == 1
        })
        .await?;
        let later = durable_seq(&run.hub, "dev-1");
        if later > held {
            println!(
                "close before settle: round {round}: durable {held} at the drop, {later} after it"
            );
            return Ok(());
        }
    }
    bail!("in {rounds} rounds no record landed after the drop: the mutation proves nothing")
}

/// Serves the hub's HTTP API (no tokens) on loopback.
async fn serve_api(run: &Running) -> Result<core_hub::client::ApiTarget> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let router = core_hub::api::router_with(
        run.hub.clone(),
        Vec::new(),
        core_hub::completeness::CompletenessConfig::default(),
    );
    tokio::spawn(core_hub::api::serve(
        listener,
        router,
        std::future::pending(),
    ));
    Ok(core_hub::client::ApiTarget::from_listen(addr, None))
}

/// `device` in `GET /v1/devices`, if listed.
async fn api_device(api: &core_hub::client::ApiTarget, device: &str) -> Result<Option<Value>> {
    let resp = core_hub::client::get(api, "/v1/devices").await?;
    ensure!(resp.status == 200, "GET /v1/devices: {}", resp.status);
    let list: Value = serde_json::from_slice(&resp.body)?;
    let found = list
        .as_array()
        .into_iter()
        .flatten()
        .find(|d| d["id"] == device);
    Ok(found.cloned())
}

/// Polls `GET /v1/devices` until `device`'s revocation says it was refused `at`.
async fn refused_at(api: &core_hub::client::ApiTarget, device: &str, at: &str) -> Result<Value> {
    let deadline = StdInstant::now() + WAIT;
    loop {
        let d = api_device(api, device).await?;
        if let Some(r) = d.as_ref().map(|d| &d["revoked"])
            && r["refused_at"] == at
        {
            return Ok(r.clone());
        }
        ensure!(
            StdInstant::now() < deadline,
            "{device} never shown refused at {at}: {d:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `device`'s row of the status page.
async fn page_row(api: &core_hub::client::ApiTarget, device: &str) -> Result<String> {
    let page = core_hub::client::get(api, "/").await?;
    ensure!(page.status == 200, "GET /: {}", page.status);
    let html = String::from_utf8_lossy(&page.body).into_owned();
    let start = html
        .find(&format!("id=\"device-{device}\""))
        .with_context(|| format!("no row for {device} on the page:\n{html}"))?;
    let end = html[start..].find("</tr>").context("an unclosed row")? + start;
    Ok(html[start..end].to_string())
}

/// A connection attempt the hub must refuse: at the handshake, or with a session that never
/// gets an ack.
async fn refused_attempt(run: &Running, device: &str, cert: &Path) -> Result<()> {
    let attempt = tokio::time::timeout(WAIT, async {
        let conn = connect(run.quic, cert).await?;
        let (acked_tx, _acked_rx) = watch::channel(0u64);
        self::device(device.into(), conn, acked_tx).await
    })
    .await
    .context("the revoked certificate kept a session")?;
    if let Ok(ended) = attempt {
        ensure!(ended.acked == 0, "the revoked certificate shipped data");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_refused_by_serial_is_shown_revoked_with_its_rule_and_when() -> Result<()> {
    let run = start().await?;
    let api = serve_api(&run).await?;
    let (cert, serial) = issue(&run.pki, "dev-1")?;
    let (session, _) = ingesting(&run, "dev-1", &cert).await?;
    let before = api_device(&api, "dev-1").await?.context("dev-1 listed")?;
    ensure!(before["revoked"].is_null(), "revoked too early: {before}");

    // A new revocation by serial drops the live session: shown with its line, serial and when.
    revoke_serial(&run, "dev-1", &serial)?;
    tokio::time::timeout(WAIT, session)
        .await
        .context("the revoked session was not dropped")???;
    let live = refused_at(&api, "dev-1", "live_session").await?;
    println!("live session dropped: {live}");
    assert_eq!(live["line"], 1);
    assert_eq!(live["serial"], serial.as_str());
    let reason = live["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains(&format!("serial {serial}")) && reason.contains("line 1"),
        "{reason}"
    );
    let first = live["first_refused_ns"].as_i64().context("when")?;
    let row = page_row(&api, "dev-1").await?;
    assert!(row.contains(">revoked<"), "{row}");
    assert!(
        row.contains("live session closed") && row.contains(&format!("serial {serial}")),
        "{row}"
    );
    assert!(row.contains("revocation list line 1"), "{row}");

    // Coming back with that certificate: refused at the handshake, first refusal kept.
    refused_attempt(&run, "dev-1", &cert).await?;
    let again = refused_at(&api, "dev-1", "handshake").await?;
    assert_eq!(again["first_refused_ns"].as_i64(), Some(first));
    assert!(again["last_refused_ns"].as_i64() > Some(first), "{again}");
    let url = format!("http://{}", api.authority);
    let out = core_hub_cli(&["devices", "--url", &url])?;
    let table = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = table
        .lines()
        .find(|l| l.starts_with("dev-1 "))
        .with_context(|| format!("no dev-1 in\n{table}"))?;
    assert!(
        line.contains("revoked: refused at the TLS handshake for certificate serial"),
        "{line}"
    );

    // A device refused at its very first handshake has no catalog row, and is listed all the
    // same.
    let (cert9, serial9) = issue(&run.pki, "dev-9")?;
    revoke_serial(&run, "dev-9", &serial9)?;
    let hub = run.hub.clone();
    wait_for("the hub to load the second revocation", || {
        metric(&hub, "tributary_hub_revocation_entries") == 2
    })
    .await?;
    refused_attempt(&run, "dev-9", &cert9).await?;
    let stranger = refused_at(&api, "dev-9", "handshake").await?;
    assert_eq!(stranger["line"], 2, "{stranger}");
    let row = page_row(&api, "dev-9").await?;
    assert!(row.contains(">revoked<") && row.contains("line 2"), "{row}");

    // Re-issued, dev-1 starts a session again and is no longer shown revoked.
    let renewed = run.pki.with_file_name("cert-dev-1-renewed");
    core_hub::pki::issue(&run.pki, "dev-1", &renewed)?;
    let conn = connect(run.quic, &renewed).await?;
    let (acked_tx, _acked_rx) = watch::channel(0u64);
    let session = tokio::spawn(device("dev-1".into(), conn, acked_tx));
    let deadline = StdInstant::now() + WAIT;
    loop {
        let back = api_device(&api, "dev-1").await?.context("dev-1 listed")?;
        if back["revoked"].is_null() {
            break;
        }
        ensure!(StdInstant::now() < deadline, "still shown revoked: {back}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let row = page_row(&api, "dev-1").await?;
    assert!(!row.contains("revoked"), "{row}");
    session.abort();
    Ok(())
}
