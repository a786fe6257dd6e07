//! The hub's security boundary, against the real binaries.
//!
//! - A certificate from another CA is rejected: the agent never gets a session and the hub
//!   never records the device.
//! - A revoked device is disconnected while connected, and rejected when it reconnects.
//! - A device cannot write a stream outside its allow-list (`[devices.<id>] streams`), and the
//!   refusal does not starve its allowed streams: they are acknowledged in full, also for
//!   records written after the refusal.
//! - A replayed old block (sent again by a hand-made client holding the device's certificate)
//!   gets an idempotent ack and nothing is stored twice.
//! - A zstd bomb and an oversized frame from a hand-made client close only that connection:
//!   a real agent replicating at the same time carries on, and the hub's memory stays bounded.
//!
//! (A conflicting block fencing the device is in `replication_restore.rs`, with a cloned
//! data directory.)
//!
//! The hand-made client uses the agent's own TLS setup (`edge_agent::link`) and the protocol's
//! frame codec (`sync::protocol`), then misbehaves on purpose.

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use serde_json::{Value, json};
use sync::block::{self, BlockHeader};
use sync::protocol::frame::Hello;
use sync::protocol::{Backlog, Frame, FrameBuffer, LaneAnnounce, PROTOCOL_VERSION};
use tributary_tests::cluster::{self, AgentSpec, DeviceCert, HubSpec, Pki};
use tributary_tests::http;
use tributary_tests::ledger::{Ledger, PostOutcome, Producer, SentRecord};
use tributary_tests::procs::{Proc, wait_until};

const STREAM: &str = "telemetry";
const WAIT: Duration = Duration::from_secs(60);

fn batch(tag: &str, from: u64, n: u64) -> Vec<SentRecord> {
    (from..from + n)
        .map(|i| {
            SentRecord::new(
                format!("k{}", i % 3),
                9_000 + i as i64,
                json!({ "tag": tag, "i": i }),
            )
        })
        .collect()
}

fn ingest(
    producer: &Producer,
    ledger: &mut Ledger,
    stream: &str,
    records: &[SentRecord],
) -> Result<()> {
    for chunk in records.chunks(250) {
        match producer.post(ledger, stream, chunk, None)? {
            PostOutcome::Acked(_) => {}
            other => bail!("ingest into {stream} not acknowledged: {other:?}"),
        }
    }
    Ok(())
}

fn devices(hub: SocketAddr) -> Result<Vec<Value>> {
    let list = http::get(hub, "/v1/devices")?.json()?;
    Ok(list.as_array().cloned().unwrap_or_default())
}

fn hub_log(hub: &Proc) -> String {
    format!("{}{}", hub.stdout(), hub.stderr())
}

/// A hub with a fresh PKI under `root`.
fn hub(root: &Path, extra_toml: &str) -> Result<(Pki, HubSpec, Proc)> {
    let pki = Pki::init(root.join("pki"))?;
    let mut spec = HubSpec::new(root);
    spec.extra_toml = extra_toml.to_string();
    let proc = spec.start(&pki)?;
    Ok((pki, spec, proc))
}

/// Waits until the agent reports `stream` acknowledged up to `seq`; the logs on a timeout.
fn wait_acked(
    spec: &AgentSpec,
    hub: &Proc,
    agent: &Proc,
    stream: &str,
    seq: u64,
    what: &str,
) -> Result<()> {
    wait_until(WAIT, what, || {
        cluster::status(spec.http)
            .map(|st| cluster::stream_u64(&st, stream, "acked_seq") >= seq)
            .unwrap_or(false)
    })
    .with_context(|| format!("{}\n{}", hub.log_tail(20), agent.log_tail(20)))
}

#[test]
fn a_certificate_from_another_ca_is_rejected() -> Result<()> {
    let root = tempfile::Builder::new().prefix("trb-sec-ca-").tempdir()?;
    let (_pki, hub_spec, hub) = hub(root.path(), "")?;
    let rogue_pki = Pki::init(root.path().join("rogue-pki"))?;
    let rogue = rogue_pki.issue("dev-rogue", Some(&root.path().join("rogue-cert")))?;
    // The rogue device trusts the real hub (it has the right CA file) but its own certificate
    // is signed by another CA, so only the hub's client-certificate check stands in the way.
    std::fs::copy(root.path().join("pki/ca.pem"), rogue.dir.join("ca.pem"))?;
    let spec = AgentSpec::new(root.path(), "rogue", rogue, Some(hub_spec.quic));
    let mut agent = spec.start()?;
    ingest(
        &Producer::new("dev-rogue", spec.http),
        &mut Ledger::new(),
        STREAM,
        &batch("r", 0, 500),
    )?;

    // Several connection attempts must have been made and refused; the link is never up.
    let started = Instant::now();
    let mut ever_up = false;
    wait_until(WAIT, "the hub to refuse three handshakes", || {
        ever_up |= cluster::status(spec.http).is_ok_and(|s| cluster::link(&s) == "up");
        hub_log(&hub).matches("handshake").count() >= 3
            && started.elapsed() > Duration::from_secs(2)
    })
    .with_context(|| format!("{}\n{}", hub.log_tail(20), agent.log_tail(20)))?;
    assert!(
        !ever_up,
        "a device with a foreign certificate got a session"
    );
    let status = cluster::status(spec.http)?;
    assert_ne!(cluster::link(&status), "up");
    assert_eq!(cluster::stream_u64(&status, STREAM, "acked_seq"), 0);
    let known = devices(hub_spec.http)?;
    assert!(
        known.iter().all(|d| d["id"] != "dev-rogue"),
        "the hub recorded the rogue device: {known:?}"
    );
    assert!(cluster::read_stream(hub_spec.http, STREAM)?.is_empty());
    agent.kill9()?;
    Ok(())
}

#[test]
fn a_revoked_device_is_disconnected_and_then_rejected() -> Result<()> {
    let root = tempfile::Builder::new().prefix("trb-sec-rev-").tempdir()?;
    let (pki, hub_spec, hub) = hub(root.path(), "")?;
    let cert = pki.issue("dev-1", None)?;
    let spec = AgentSpec::new(root.path(), "dev-1", cert, Some(hub_spec.quic));
    let mut agent = spec.start()?;
    let producer = Producer::new("dev-1", spec.http);
    let mut ledger = Ledger::new();
    ingest(&producer, &mut ledger, STREAM, &batch("before", 0, 1_000))?;
    cluster::wait_caught_up(spec.http, WAIT)?;
    let before = cluster::read_stream(hub_spec.http, STREAM)?.len();
    assert_eq!(before, 1_000);

    pki.revoke("dev-1")?;
    wait_until(WAIT, "the connected device to be disconnected", || {
        cluster::status(spec.http).is_ok_and(|s| cluster::link(&s) != "up")
    })
    .with_context(|| hub.log_tail(20))?;
    assert!(
        hub_log(&hub).contains("revoked"),
        "no revocation in the hub log\n{}",
        hub.log_tail(20)
    );

    // Reconnects are refused: data taken after the revocation never reaches the hub.
    ingest(&producer, &mut ledger, STREAM, &batch("after", 1_000, 500))?;
    let refusals_at_revoke = hub_log(&hub).matches("device connection ended").count();
    let mut ever_up = false;
    wait_until(WAIT, "two reconnect attempts to be refused", || {
        ever_up |= cluster::status(spec.http).is_ok_and(|s| cluster::link(&s) == "up");
        hub_log(&hub).matches("device connection ended").count() >= refusals_at_revoke + 2
    })
    .with_context(|| format!("{}\n{}", hub.log_tail(20), agent.log_tail(20)))?;
    assert!(!ever_up, "the revoked device got a session again");
    assert_eq!(cluster::read_stream(hub_spec.http, STREAM)?.len(), before);
    agent.kill9()?;
    Ok(())
}

#[test]
fn a_device_cannot_write_a_stream_outside_its_allow_list() -> Result<()> {
    let root = tempfile::Builder::new().prefix("trb-sec-acl-").tempdir()?;
    let (pki, hub_spec, hub) = hub(root.path(), "[devices.dev-1]\nstreams = [\"other\"]\n")?;
    let cert = pki.issue("dev-1", None)?;
    let mut spec = AgentSpec::new(root.path(), "dev-1", cert, Some(hub_spec.quic));
    spec.streams = vec![STREAM.into(), "other".into()];
    let mut agent = spec.start()?;
    let producer = Producer::new("dev-1", spec.http);
    let mut ledger = Ledger::new();
    ingest(&producer, &mut ledger, STREAM, &batch("forbidden", 0, 300))?;
    ingest(&producer, &mut ledger, "other", &batch("allowed", 0, 300))?;

    wait_until(WAIT, "the hub to refuse the forbidden stream", || {
        cluster::fetch_metric(hub_spec.http, "tributary_hub_streams_refused_total").unwrap_or(0.0)
            >= 1.0
    })
    .with_context(|| format!("{}\n{}", hub.log_tail(20), agent.log_tail(20)))?;
    // The allowed stream keeps flowing: what was written before the refusal and what is
    // written after it are both acknowledged and stored.
    ingest(&producer, &mut ledger, "other", &batch("allowed", 300, 300))?;
    ingest(&producer, &mut ledger, STREAM, &batch("forbidden", 300, 50))?;
    wait_acked(
        &spec,
        &hub,
        &agent,
        "other",
        600,
        "the allowed stream to be acknowledged in full",
    )?;
    let status = cluster::status(spec.http)?;
    assert_eq!(
        cluster::stream_u64(&status, STREAM, "acked_seq"),
        0,
        "the forbidden stream was acknowledged"
    );
    assert!(
        cluster::read_stream(hub_spec.http, STREAM)?.is_empty(),
        "the forbidden stream reached the hub"
    );
    assert_eq!(
        cluster::read_stream(hub_spec.http, "other")?.len(),
        600,
        "the allowed stream holds every record once"
    );
    let refused = cluster::fetch_metric(spec.http, "tributary_edge_link_streams_refused_total")?;
    assert!(refused >= 1.0, "the agent did not record the refusal");
    println!(
        "allow-list: allowed stream acked {} of 600 across the refusal; agent refusals {refused}",
        cluster::stream_u64(&status, "other", "acked_seq")
    );
    agent.kill9()?;
    Ok(())
}

#[test]
fn a_stream_past_the_device_quota_is_left_out_and_the_admitted_one_flows() -> Result<()> {
    let root = tempfile::Builder::new()
        .prefix("trb-sec-quota-")
        .tempdir()?;
    let (pki, hub_spec, hub) = hub(root.path(), "[ingest]\nstreams_per_device_max = 1\n")?;
    let cert = pki.issue("dev-1", None)?;
    let mut spec = AgentSpec::new(root.path(), "dev-1", cert, Some(hub_spec.quic));
    spec.streams = vec![STREAM.into(), "other".into()];
    let mut agent = spec.start()?;
    let producer = Producer::new("dev-1", spec.http);
    let mut ledger = Ledger::new();
    // `other` takes the device's one stream first.
    ingest(&producer, &mut ledger, "other", &batch("admitted", 0, 300))?;
    wait_acked(
        &spec,
        &hub,
        &agent,
        "other",
        300,
        "the admitted stream to be acknowledged",
    )?;
    ingest(&producer, &mut ledger, STREAM, &batch("over-quota", 0, 300))?;
    wait_until(WAIT, "the agent to leave the over-quota stream out", || {
        cluster::fetch_metric(spec.http, "tributary_edge_link_streams_refused_total").unwrap_or(0.0)
            >= 1.0
    })
    .with_context(|| format!("{}\n{}", hub.log_tail(20), agent.log_tail(20)))?;
    // The admitted stream keeps flowing after the refusal.
    ingest(
        &producer,
        &mut ledger,
        "other",
        &batch("admitted", 300, 300),
    )?;
    wait_acked(
        &spec,
        &hub,
        &agent,
        "other",
        600,
        "the admitted stream to be acknowledged in full",
    )?;
    let quota = cluster::fetch_metric(hub_spec.http, "tributary_hub_quota_refused_total")?;
    assert!(quota >= 1.0, "the hub did not count a quota refusal");
    assert!(
        cluster::read_stream(hub_spec.http, STREAM)?.is_empty(),
        "the over-quota stream reached the hub"
    );
    assert_eq!(
        cluster::read_stream(hub_spec.http, "other")?.len(),
        600,
        "the admitted stream holds every record once"
    );
    agent.kill9()?;
    Ok(())
}

// ---- the hand-made client ----

/// A session opened with `cert`, announcing one lane; returns after the hub's Welcome.
struct RawSession {
    _endpoint: quinn::Endpoint,
    conn: quinn::Connection,
    _control: quinn::SendStream,
    answers: quinn::RecvStream,
    frames: FrameBuffer,
    /// The hub's `resume_from` for the announced lane.
    welcome_resume_from: u64,
}

impl RawSession {
    async fn open(hub: SocketAddr, cert: &DeviceCert, lane: LaneAnnounce) -> Result<RawSession> {
        let tls = edge_agent::link::TlsPaths {
            ca: cert.dir.join("ca.pem"),
            cert: cert.dir.join("device.pem"),
            key: cert.dir.join("device.key"),
        };
        let mut endpoint = edge_agent::link::client_endpoint("127.0.0.1:0".parse()?)?;
        endpoint.set_default_client_config(edge_agent::link::client_config(&tls)?);
        let conn = endpoint
            .connect(hub, "localhost")?
            .await
            .context("QUIC handshake")?;
        let (mut control, answers) = conn.open_bi().await?;
        let hello = Frame::Hello(Hello {
            version_min: PROTOCOL_VERSION,
            version_max: PROTOCOL_VERSION,
            current_epoch: lane.epoch,
            lanes: vec![lane],
            capabilities: 0,
        });
        control.write_all(&hello.encode()).await?;
        let mut session = RawSession {
            _endpoint: endpoint,
            conn,
            _control: control,
            answers,
            frames: FrameBuffer::new(64 << 20),
            welcome_resume_from: 0,
        };
        match session.next_frame().await? {
            Frame::Welcome(w) => {
                session.welcome_resume_from = w.lanes.first().map_or(1, |(_, _, l)| l.resume_from);
                Ok(session)
            }
            other => bail!("expected a Welcome, got {other:?}"),
        }
    }

    async fn next_frame(&mut self) -> Result<Frame> {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            if let Some(bytes) = self.frames.next_frame()? {
                return Ok(Frame::decode(&bytes, 64 << 20)?);
            }
            let n = self
                .answers
                .read(&mut buf)
                .await?
                .context("the hub closed the control stream")?;
            self.frames.push(&buf[..n]);
        }
    }

    /// Sends one frame on its own unidirectional stream, as the agent sends blocks.
    async fn send_data(&self, frame: &[u8]) -> Result<()> {
        let mut stream = self.conn.open_uni().await?;
        stream.write_all(frame).await?;
        stream.finish()?;
        Ok(())
    }

    /// Waits for the hub to close the connection; returns the close reason.
    async fn closed(&self, within: Duration) -> Result<quinn::ConnectionError> {
        tokio::time::timeout(within, self.conn.closed())
            .await
            .context("the hub did not close the connection")
    }
}

fn lane(epoch: u64, first_seq: u64, last_seq: u64) -> LaneAnnounce {
    LaneAnnounce {
        stream: STREAM.into(),
        epoch,
        first_seq,
        last_seq,
        acked_seq: 0,
        backlog: Backlog {
            blocks: 1,
            bytes: 1,
            oldest_unsent_ts: Some(1),
        },
        gaps: Vec::new(),
    }
}

fn block_frame(block: Vec<u8>) -> Vec<u8> {
    Frame::Block {
        stream: STREAM.into(),
        block,
    }
    .encode()
}

/// Every sealed block in the agent's segment files for `stream`, in file order.
fn blocks_on_disk(data_dir: &Path, stream: &str) -> Result<Vec<Vec<u8>>> {
    let dir = data_dir.join("streams").join(stream);
    let mut segments: Vec<_> = std::fs::read_dir(&dir)
        .with_context(|| format!("listing {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "seg"))
        .collect();
    segments.sort();
    let mut blocks = Vec::new();
    for path in segments {
        let bytes = std::fs::read(&path)?;
        let mut at = 0;
        while let Some(pos) = bytes[at..].windows(4).position(|w| w == block::BLOCK_MAGIC) {
            let start = at + pos;
            match block::decode_header(&bytes[start..]) {
                Ok(header) if start + header.encoded_len() <= bytes.len() => {
                    let end = start + header.encoded_len();
                    blocks.push(bytes[start..end].to_vec());
                    at = end;
                }
                _ => at = start + 1,
            }
        }
    }
    ensure!(!blocks.is_empty(), "no block found under {}", dir.display());
    Ok(blocks)
}

/// VmRSS of a process in bytes.
fn rss(pid: u32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let line = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .context("no VmRSS")?;
    let kb: u64 = line
        .split_whitespace()
        .nth(1)
        .context("VmRSS value")?
        .parse()?;
    Ok(kb * 1024)
}

#[test]
fn a_replayed_old_block_gets_an_idempotent_ack() -> Result<()> {
    let root = tempfile::Builder::new()
        .prefix("trb-sec-replay-")
        .tempdir()?;
    let (pki, hub_spec, _hub) = hub(root.path(), "")?;
    let cert = pki.issue("dev-1", None)?;
    let spec = AgentSpec::new(root.path(), "dev-1", cert.clone(), Some(hub_spec.quic));
    let mut agent = spec.start()?;
    let mut ledger = Ledger::new();
    ingest(
        &Producer::new("dev-1", spec.http),
        &mut ledger,
        STREAM,
        &batch("once", 0, 2_000),
    )?;
    cluster::wait_caught_up(spec.http, WAIT)?;
    agent.terminate(Duration::from_secs(20))?;
    let stored = cluster::read_stream(hub_spec.http, STREAM)?;
    let blocks = blocks_on_disk(&spec.data_dir, STREAM)?;
    let headers: Vec<BlockHeader> = blocks
        .iter()
        .map(|b| block::decode_header(b))
        .collect::<Result<_, _>>()?;
    let epoch = headers[0].epoch;
    let duplicates_before =
        cluster::fetch_metric(hub_spec.http, "tributary_hub_duplicate_blocks_total")?;

    // The hand-made client announces everything as unacknowledged, as an agent that lost its
    // acked marks would, and replays old blocks: first the one the hub asks for (it compares
    // the block ending at its mark), then the very first block of the stream.
    let runtime = tokio::runtime::Runtime::new()?;
    let acks = runtime.block_on(async {
        let mut session = RawSession::open(hub_spec.quic, &cert, lane(epoch, 1, 2_000)).await?;
        let resume_from = session.welcome_resume_from;
        let junction = headers
            .iter()
            .position(|h| h.first_seq <= resume_from && resume_from <= h.last_seq())
            .context("no block on disk holds the hub's resume point")?;
        let mut acks = Vec::new();
        for k in [junction, 0] {
            session.send_data(&block_frame(blocks[k].clone())).await?;
            let acked = loop {
                match tokio::time::timeout(Duration::from_secs(20), session.next_frame()).await {
                    Err(_) => bail!(
                        "no ack within 20 s for the replayed block {}..={} (resume_from {resume_from})",
                        headers[k].first_seq,
                        headers[k].last_seq()
                    ),
                    Ok(frame) => match frame? {
                        Frame::Ack { stream, epoch: e, durable_seq, .. } if stream == STREAM && e == epoch => {
                            break durable_seq;
                        }
                        Frame::Error(e) => bail!("the replay was answered with an error: {e:?}"),
                        _ => {}
                    },
                }
            };
            acks.push((headers[k].first_seq, headers[k].last_seq(), acked));
        }
        Ok::<_, anyhow::Error>(acks)
    })?;
    for &(first, last, acked) in &acks {
        assert!(
            acked >= last,
            "ack {acked} does not cover the replayed block {first}..={last}"
        );
        assert_eq!(acked, 2_000, "the ack must be the hub's unchanged mark");
    }
    let after = cluster::read_stream(hub_spec.http, STREAM)?;
    assert_eq!(after, stored, "the replay changed what the hub holds");
    let report = ledger.check(after);
    assert!(report.is_ok(), "{}", report.summary());
    let duplicates = cluster::fetch_metric(hub_spec.http, "tributary_hub_duplicate_blocks_total")?;
    assert!(
        duplicates >= duplicates_before + acks.len() as f64,
        "replayed blocks are counted: {duplicates_before} -> {duplicates}"
    );
    println!(
        "replay: (first, last, acked) {acks:?}; duplicate blocks {duplicates_before} -> {duplicates}"
    );
    Ok(())
}

/// Runs `attack` from a hand-made client while a real agent replicates; asserts the attack's
/// connection is closed, the agent keeps its session and catches up, and the hub's RSS
/// grows by less than 256 MiB.
fn only_the_bad_connection_closes(
    name: &str,
    attack: impl AsyncFnOnce(&RawSession) -> Result<()>,
) -> Result<()> {
    let root = tempfile::Builder::new().prefix("trb-sec-bad-").tempdir()?;
    let (pki, hub_spec, mut hub) = hub(root.path(), "")?;
    let good_cert = pki.issue("dev-good", None)?;
    let bad_cert = pki.issue("dev-bad", None)?;
    let spec = AgentSpec::new(root.path(), "dev-good", good_cert, Some(hub_spec.quic));
    let mut agent = spec.start()?;
    let producer = Producer::new("dev-good", spec.http);
    let mut ledger = Ledger::new();
    ingest(&producer, &mut ledger, STREAM, &batch("pre", 0, 1_000))?;
    cluster::wait_caught_up(spec.http, WAIT)?;
    let rss_before = rss(hub.pid())?;

    let runtime = tokio::runtime::Runtime::new()?;
    let reason = runtime.block_on(async {
        let session = RawSession::open(hub_spec.quic, &bad_cert, lane(77, 1, 1)).await?;
        attack(&session).await?;
        session.closed(WAIT).await
    })?;
    println!("{name}: the hub closed the bad connection: {reason}");
    ensure!(
        !matches!(reason, quinn::ConnectionError::TimedOut),
        "the connection timed out instead of being closed by the hub"
    );
    assert!(hub.is_running(), "the hub died\n{}", hub.log_tail(30));
    let rss_after = rss(hub.pid())?;

    // The good agent is unaffected: more data replicates exactly once.
    ingest(&producer, &mut ledger, STREAM, &batch("post", 1_000, 1_000))?;
    let status = cluster::wait_caught_up(spec.http, WAIT).with_context(|| agent.log_tail(20))?;
    assert_eq!(cluster::link(&status), "up");
    let observed: Vec<_> = cluster::read_stream(hub_spec.http, STREAM)?;
    assert!(
        observed.iter().all(|r| r.device == "dev-good"),
        "the bad client's data was stored"
    );
    let report = ledger.check(observed);
    assert!(report.is_ok(), "{}", report.summary());
    println!(
        "{name}: hub RSS {} MiB before, {} MiB after",
        rss_before >> 20,
        rss_after >> 20
    );
    assert!(
        rss_after < rss_before + (256 << 20),
        "hub RSS grew from {rss_before} to {rss_after}"
    );
    agent.kill9()?;
    Ok(())
}

#[test]
fn a_zstd_bomb_closes_only_that_connection_with_bounded_memory() -> Result<()> {
    // 1 GiB of zeros compresses to a few tens of KiB; the header claims 4 KiB decompressed.
    let mut body = Vec::new();
    let mut zeros = std::io::Read::take(std::io::repeat(0), 1 << 30);
    zstd::stream::copy_encode(&mut zeros, &mut body, 19)?;
    let header = BlockHeader {
        version: block::VERSION_ROWS,
        flags: 0,
        epoch: 77,
        first_seq: 1,
        count: 1,
        raw_len: 4096,
        min_ts: 1,
        max_ts: 1,
        body_len: u32::try_from(body.len())?,
        body_crc: crc32c::crc32c(&body),
        raw_crc: 0,
    };
    let mut bomb = block::write_header(&header).to_vec();
    bomb.extend_from_slice(&body);
    let frame = block_frame(bomb);
    only_the_bad_connection_closes("zstd bomb", async |session: &RawSession| {
        session.send_data(&frame).await
    })
}

#[test]
fn an_oversized_frame_closes_only_that_connection() -> Result<()> {
    only_the_bad_connection_closes("oversized frame", async |session: &RawSession| {
        // A control frame announcing 1 GiB, above the hub's frame limit (block limit + 64 KiB),
        // followed by some of its bytes: the hub must refuse it from the length alone.
        let mut frame = (1u32 << 30).to_le_bytes().to_vec();
        frame.push(Frame::Ping.type_byte());
        frame.extend(std::iter::repeat_n(0u8, 64 << 10));
        let mut control = session.conn.open_uni().await?;
        control.write_all(&frame).await?;
        control.finish()?;
        Ok(())
    })
}

/// The decoded-size bomb as a device sent it: one 16 KiB key in a version 2 dictionary and a
/// million records that each copy it (a few hundred bytes sealed, 16 GB decoded).
fn decoded_size_bomb(epoch: u64) -> Vec<u8> {
    let n = 1_000_000usize;
    let mut raw = vec![0u8];
    sync::varint::put_u64(&mut raw, 1);
    sync::varint::put_bytes(&mut raw, &[b'k'; 16 << 10]);
    raw.extend_from_slice(&[0, 1, 0]); // no columns; one shape, empty
    for _ in 0..3 {
        raw.push(0); // key, shape and ts columns: plain, a zero per record
        sync::varint::put_bytes(&mut raw, &vec![0u8; n]);
    }
    let body = zstd::bulk::compress(&raw, 19).expect("compress");
    let header = BlockHeader {
        version: block::VERSION_COLUMNAR,
        flags: 0,
        epoch,
        first_seq: 1,
        count: n as u32,
        raw_len: raw.len() as u32,
        min_ts: 0,
        max_ts: 0,
        body_len: body.len() as u32,
        body_crc: crc32c::crc32c(&body),
        raw_crc: crc32c::crc32c(&raw),
    };
    let mut bomb = block::write_header(&header).to_vec();
    bomb.extend_from_slice(&body);
    bomb
}

#[test]
fn a_decoded_size_bomb_is_refused_with_its_own_code_and_the_rest_served() -> Result<()> {
    let root = tempfile::Builder::new().prefix("trb-sec-dsb-").tempdir()?;
    let (pki, hub_spec, mut hub) = hub(root.path(), "")?;
    let good_cert = pki.issue("dev-good", None)?;
    let bad_cert = pki.issue("dev-bad", None)?;
    let spec = AgentSpec::new(root.path(), "dev-good", good_cert, Some(hub_spec.quic));
    let mut agent = spec.start()?;
    let producer = Producer::new("dev-good", spec.http);
    let mut ledger = Ledger::new();
    ingest(&producer, &mut ledger, STREAM, &batch("pre", 0, 1_000))?;
    cluster::wait_caught_up(spec.http, WAIT)?;
    let rss_before = rss(hub.pid())?;

    let bomb = decoded_size_bomb(77);
    let sealed = bomb.len();
    let runtime = tokio::runtime::Runtime::new()?;
    let reasons = runtime.block_on(async {
        // As the agent does, it comes back and sends the block again.
        let mut reasons = Vec::new();
        for _ in 0..2 {
            let session =
                RawSession::open(hub_spec.quic, &bad_cert, lane(77, 1, 1_000_000)).await?;
            session.send_data(&block_frame(bomb.clone())).await?;
            reasons.push(session.closed(WAIT).await?);
        }
        Ok::<_, anyhow::Error>(reasons)
    })?;
    let decoded_too_large = sync::protocol::ErrorCode::DecodedTooLarge.to_u16();
    for reason in &reasons {
        match reason {
            quinn::ConnectionError::ApplicationClosed(c) => assert_eq!(
                c.error_code,
                quinn::VarInt::from_u32(u32::from(decoded_too_large)),
                "closed with {c:?}"
            ),
            other => bail!("the bomb's connection ended with {other} instead of DECODED_TOO_LARGE"),
        }
    }
    assert!(hub.is_running(), "the hub died\n{}", hub.log_tail(30));
    let rss_after = rss(hub.pid())?;
    let refused = cluster::fetch_metric(
        hub_spec.http,
        "tributary_hub_decoded_too_large_blocks_total",
    )?;
    assert_eq!(refused, 2.0, "each refusal is counted");

    ingest(&producer, &mut ledger, STREAM, &batch("post", 1_000, 1_000))?;
    let status = cluster::wait_caught_up(spec.http, WAIT).with_context(|| agent.log_tail(20))?;
    assert_eq!(cluster::link(&status), "up");
    let observed = cluster::read_stream(hub_spec.http, STREAM)?;
    assert!(
        observed.iter().all(|r| r.device == "dev-good"),
        "the bomb was stored"
    );
    let report = ledger.check(observed);
    assert!(report.is_ok(), "{}", report.summary());
    println!(
        "decoded-size bomb: {sealed} bytes sealed, refused twice with code {decoded_too_large}; \
         hub RSS {} MiB before, {} MiB after",
        rss_before >> 20,
        rss_after >> 20
    );
    assert!(
        rss_after < rss_before + (256 << 20),
        "hub RSS grew from {rss_before} to {rss_after}"
    );
    agent.kill9()?;
    Ok(())
}
