//! Per-device state quotas (`ingest.streams_per_device_max`, `ingest.epochs_per_device_max`,
//! `ingest.lanes_per_device_max`, `ingest.columns_per_stream_max`) and the `/metrics` series
//! bound (`metrics.device_series_max`).
//!
//! - Each limit refuses the block, gap or backlog report that would create state beyond it,
//!   with `quota_exceeded` naming the stream and the limit's key; nothing of it is in the
//!   catalog; the refusal is counted by limit on `/metrics`; the device's admitted lanes and
//!   an honest device keep committing; the counts come back from the catalog after a restart.
//! - Over real QUIC, a device whose second stream is beyond its quota gets `QUOTA_EXCEEDED`
//!   (18) naming that stream, and its first stream keeps flowing in the next session.
//! - Mutation checks (`Quotas::disable_check`, feature `fault-injection`): with one check
//!   left out, the scenario guarding it fails.

mod common;

use common::quic::Running;
use core_hub::server::Mutation;

use anyhow::{Context, Result, bail, ensure};
use common::{block, read_all, records};
use core_hub::ingest::BacklogReport;
use core_hub::ingest::quotas::Limit;
use core_hub::{Hub, HubConfig, IngestError};
use std::path::Path;
use std::time::{Duration, Instant as StdInstant};
use sync::block::{VERSION_COLUMNAR, VERSION_ROWS, encode_block};
use sync::protocol::{
    Backlog, ErrorCode, FrameBuffer, Instant, LaneAnnounce, Sender, SenderConfig, SenderEvent,
    TransmitKind,
};
use sync::record::Value;

/// Small limits, so each trips within a few blocks.
fn small(dir: &Path) -> HubConfig {
    common::config(dir, |c| {
        c.ingest.state.streams_per_device_max = 2;
        c.ingest.state.epochs_per_device_max = 2;
        c.ingest.state.lanes_per_device_max = 3;
        c.ingest.state.columns_per_stream_max = 6;
    })
}

fn metric(hub: &Hub, line: &str) -> u64 {
    let text = core_hub::metrics::render(hub);
    text.lines()
        .find_map(|l| l.strip_prefix(line)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {line} in\n{text}"))
}

fn refused(hub: &Hub, label: &str) -> u64 {
    metric(
        hub,
        &format!("tributary_hub_quota_refused_total{{limit=\"{label}\"}}"),
    )
}

fn quota_key(e: &IngestError) -> Option<&'static str> {
    match e {
        IngestError::QuotaExceeded { key, .. } => Some(key),
        _ => None,
    }
}

/// The durable mark of `(device, stream, epoch)`, 0 if the hub holds no such lane.
fn mark(hub: &Hub, device: &str, stream: &str, epoch: u64) -> u64 {
    hub.marks(device)
        .iter()
        .find(|m| m.stream == stream && m.epoch == epoch)
        .map_or(0, |m| m.durable_seq)
}

/// d1 fills its stream, epoch and lane limits; every further new state is refused with its
/// limit's key and creates nothing. Returns an error (instead of panicking) when a limit does
/// not hold, so the mutation checks can expect it.
async fn limits_hold(hub: &Hub) -> Result<()> {
    hub.commit_block("d1", "s1", &block("d1", 1, 1, 5)).await?;
    hub.commit_block("d1", "s2", &block("d1", 1, 1, 5)).await?;
    // A third stream: refused, and the stream is not in the catalog.
    let e = hub
        .commit_block("d1", "s3", &block("d1", 1, 1, 5))
        .await
        .err()
        .context("a third stream was admitted past streams_per_device_max = 2")?;
    ensure!(
        quota_key(&e) == Some("ingest.streams_per_device_max"),
        "{e}"
    );
    ensure!(e.to_string().starts_with("stream `s3`"), "{e}");
    ensure!(e.code() == "quota_exceeded");
    ensure!(hub.lookup_stream("s3").is_none(), "s3 was created");
    // A backlog report alone cannot create a stream either.
    let e = hub
        .record_backlog("d1", "s4", BacklogReport::default())
        .err()
        .context("a backlog report created a stream past the limit")?;
    ensure!(quota_key(&e) == Some("ingest.streams_per_device_max"));
    ensure!(hub.lookup_stream("s4").is_none(), "s4 was created");
    // A second epoch fits; a third does not.
    hub.commit_block("d1", "s1", &block("d1", 2, 1, 5)).await?;
    let e = hub
        .commit_block("d1", "s1", &block("d1", 3, 1, 5))
        .await
        .err()
        .context("a third epoch was admitted past epochs_per_device_max = 2")?;
    ensure!(quota_key(&e) == Some("ingest.epochs_per_device_max"));
    ensure!(mark(hub, "d1", "s1", 3) == 0);
    // Three lanes held: a fourth, of known stream and epoch, is refused (block and gap).
    let e = hub
        .commit_block("d1", "s2", &block("d1", 2, 1, 5))
        .await
        .err()
        .context("a fourth lane was admitted past lanes_per_device_max = 3")?;
    ensure!(quota_key(&e) == Some("ingest.lanes_per_device_max"));
    let e = hub
        .record_gap("d1", "s2", 2, 1, 10, "DiskFull")
        .await
        .err()
        .context("a gap created a lane past the limit")?;
    ensure!(quota_key(&e) == Some("ingest.lanes_per_device_max"));
    ensure!(mark(hub, "d1", "s2", 2) == 0);
    ensure!(hub.marks("d1").len() == 3, "{:?}", hub.marks("d1"));
    Ok(())
}

/// A block bringing fields past `columns_per_stream_max` = 6 is refused and registers none.
async fn columns_hold(hub: &Hub) -> Result<()> {
    // `common::record` has 4 fields; two more fit.
    let mut rs = records("d1", 6, 8);
    for r in &mut rs {
        r.fields.push(("extra1".into(), Value::I64(1)));
        r.fields.push(("extra2".into(), Value::I64(2)));
    }
    hub.commit_block("d1", "s1", &encode_block(VERSION_COLUMNAR, 1, 6, &rs)?)
        .await?;
    let mut rs = records("d1", 9, 11);
    rs[1].fields.push(("flood".into(), Value::I64(1)));
    let e = hub
        .commit_block("d1", "s1", &encode_block(VERSION_ROWS, 1, 9, &rs)?)
        .await
        .err()
        .context("a seventh column was admitted past columns_per_stream_max = 6")?;
    ensure!(
        quota_key(&e) == Some("ingest.columns_per_stream_max"),
        "{e}"
    );
    ensure!(mark(hub, "d1", "s1", 1) == 8);
    let registered = registered_fields(hub, "s1")?;
    ensure!(!registered.contains(&"flood".to_string()), "{registered:?}");
    ensure!(registered.len() == 6, "{registered:?}");
    Ok(())
}

fn registered_fields(hub: &Hub, stream: &str) -> Result<Vec<String>> {
    let sid = hub.lookup_stream(stream).context("no such stream")?;
    Ok(hub
        .catalog()
        .stream_fields()?
        .into_iter()
        .filter(|(s, _, _)| *s == sid)
        .map(|(_, f, _)| f)
        .collect())
}

#[tokio::test]
async fn each_limit_refuses_new_state_and_creates_nothing() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let cfg = small(dir.path());
    let hub = Hub::open(&cfg)?;
    limits_hold(&hub).await?;
    columns_hold(&hub).await?;
    // Counted by limit (the backlog report counts with the blocks).
    assert_eq!(refused(&hub, "streams_per_device"), 2);
    assert_eq!(refused(&hub, "epochs_per_device"), 1);
    assert_eq!(refused(&hub, "lanes_per_device"), 2);
    assert_eq!(refused(&hub, "columns_per_stream"), 1);
    // The device's admitted lanes keep flowing, and an honest device is not limited by it.
    hub.commit_block("d1", "s1", &block("d1", 1, 9, 20)).await?;
    hub.commit_block("d1", "s2", &block("d1", 1, 6, 9)).await?;
    for s in ["s3", "s1"] {
        hub.commit_block("d2", s, &block("d2", 1, 1, 5)).await?;
    }
    assert_eq!(mark(&hub, "d1", "s1", 1), 20);
    assert_eq!(mark(&hub, "d2", "s3", 1), 5);
    // s3 exists now (d2's), and d1 still holds nothing in it.
    assert_eq!(mark(&hub, "d1", "s3", 1), 0);
    assert_eq!(read_all(&hub, "s3").len(), 5);
    drop(hub);

    // After a restart the counts come from the catalog: the same refusals hold.
    let hub = Hub::open(&cfg)?;
    let e = hub
        .commit_block("d1", "s3", &block("d1", 1, 1, 5))
        .await
        .unwrap_err();
    assert_eq!(quota_key(&e), Some("ingest.streams_per_device_max"));
    let e = hub
        .commit_block("d1", "s1", &block("d1", 3, 1, 5))
        .await
        .unwrap_err();
    assert_eq!(quota_key(&e), Some("ingest.epochs_per_device_max"));
    let e = hub
        .commit_block("d1", "s2", &block("d1", 2, 1, 5))
        .await
        .unwrap_err();
    assert_eq!(quota_key(&e), Some("ingest.lanes_per_device_max"));
    let mut rs = records("d1", 21, 22);
    rs[0].fields.push(("flood".into(), Value::I64(1)));
    let e = hub
        .commit_block("d1", "s1", &encode_block(VERSION_ROWS, 1, 21, &rs)?)
        .await
        .unwrap_err();
    assert_eq!(quota_key(&e), Some("ingest.columns_per_stream_max"));
    hub.commit_block("d1", "s1", &block("d1", 1, 21, 25))
        .await?;
    assert_eq!(mark(&hub, "d1", "s1", 1), 25);
    Ok(())
}

#[tokio::test]
async fn mutation_each_unchecked_limit_is_caught() -> Result<()> {
    for limit in [
        Limit::StreamsPerDevice,
        Limit::EpochsPerDevice,
        Limit::LanesPerDevice,
    ] {
        let dir = tempfile::tempdir()?;
        let hub = Hub::open(&small(dir.path()))?;
        hub.quotas().disable_check(Some(limit));
        let outcome = limits_hold(&hub).await;
        ensure!(
            outcome.is_err(),
            "with {} unchecked the scenario still passed",
            limit.key()
        );
        println!("{} unchecked: {}", limit.key(), outcome.unwrap_err());
    }
    let dir = tempfile::tempdir()?;
    let hub = Hub::open(&small(dir.path()))?;
    hub.commit_block("d1", "s1", &block("d1", 1, 1, 5)).await?;
    hub.quotas().disable_check(Some(Limit::ColumnsPerStream));
    let outcome = columns_hold(&hub).await;
    ensure!(
        outcome.is_err(),
        "with columns unchecked the scenario passed"
    );
    println!("columns unchecked: {}", outcome.unwrap_err());
    Ok(())
}

#[tokio::test]
async fn metrics_list_a_bounded_number_of_devices() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let hub = Hub::open(&common::config(dir.path(), |c| {
        c.metrics.device_series_max = 2;
    }))?;
    for d in ["a1", "a2", "a3", "a4", "a5"] {
        hub.commit_block(d, "s", &block(d, 1, 1, 3)).await?;
    }
    let text = core_hub::metrics::render(&hub);
    let series = |device: &str| {
        text.lines()
            .filter(|l| l.contains(&format!("device=\"{device}\"")))
            .count()
    };
    assert_eq!(series("a1"), 1, "{text}");
    assert_eq!(series("a2"), 1);
    for d in ["a3", "a4", "a5"] {
        assert_eq!(series(d), 0, "{d} listed past the bound:\n{text}");
    }
    assert_eq!(metric(&hub, "tributary_hub_metrics_devices_omitted"), 3);
    Ok(())
}

// ---- over real QUIC ----

const WAIT: Duration = Duration::from_secs(20);
const RECORDS_PER_BLOCK: u64 = 10;

async fn start(streams_per_device_max: u32) -> Result<Running> {
    common::quic::start(Mutation::None, |c| {
        c.ingest.state.streams_per_device_max = streams_per_device_max;
    })
    .await
}

/// Connects as `device`, issuing its certificate on first use.
async fn connect(run: &Running, device: &str) -> Result<quinn::Connection> {
    let cert = run.pki.with_file_name(format!("cert-{device}"));
    if !cert.exists() {
        common::quic::issue(&run.pki, device)?;
    }
    common::quic::connect(run.quic, &cert).await
}

/// How a session ended: the code and message of the hub's Error frame, if any.
#[derive(Debug)]
struct Ended {
    code: Option<ErrorCode>,
    message: String,
}

fn lane_block(device: &str, n: u64) -> Vec<u8> {
    let first = n * RECORDS_PER_BLOCK + 1;
    let rs = records(device, first, first + RECORDS_PER_BLOCK - 1);
    encode_block(VERSION_ROWS, 1, first, &rs).unwrap()
}

/// One session shipping `blocks` blocks on each of `streams` (epoch 1). Returns once every
/// lane is acknowledged in full, or when the hub ends the session.
async fn session(run: &Running, device: &str, streams: &[&str], blocks: u64) -> Result<Ended> {
    let conn = connect(run, device).await?;
    let clock = StdInstant::now();
    let now = || Instant::from_nanos(clock.elapsed().as_nanos() as u64);
    let (mut ctl_tx, mut ctl_rx) = conn.open_bi().await?;
    let lanes = streams
        .iter()
        .map(|s| LaneAnnounce {
            stream: (*s).into(),
            epoch: 1,
            first_seq: 1,
            last_seq: blocks * RECORDS_PER_BLOCK,
            acked_seq: 0,
            backlog: Backlog::default(),
            gaps: Vec::new(),
        })
        .collect();
    let mut sender = Sender::new(SenderConfig::default(), 1, lanes, now())?;
    let mut frames = FrameBuffer::new(SenderConfig::default().frame_bytes_max);
    let mut acked: std::collections::HashMap<String, u64> = Default::default();
    let mut buf = vec![0u8; 64 << 10];
    let full = blocks * RECORDS_PER_BLOCK;
    loop {
        while let Some(t) = sender.poll_transmit() {
            match t.kind {
                TransmitKind::Control => ctl_tx.write_all(&t.frame).await?,
                TransmitKind::Data => {
                    let mut s = conn.open_uni().await?;
                    s.write_all(&t.frame).await?;
                    s.finish()?;
                }
            }
        }
        let mut progressed = false;
        while let Some(ev) = sender.poll_event() {
            progressed = true;
            match ev {
                SenderEvent::WantBlocks {
                    stream, after_seq, ..
                } => {
                    let from = after_seq / RECORDS_PER_BLOCK;
                    let bs = (from..blocks).map(|n| lane_block(device, n)).collect();
                    sender.supply_blocks(now(), &stream, 1, bs)?;
                }
                SenderEvent::Acked {
                    stream,
                    durable_seq,
                    ..
                } => {
                    acked.insert(stream, durable_seq);
                    if streams.iter().all(|s| acked.get(*s) == Some(&full)) {
                        return Ok(Ended {
                            code: None,
                            message: String::new(),
                        });
                    }
                }
                SenderEvent::Closed(r) => {
                    return Ok(Ended {
                        code: Some(r.code),
                        message: r.message,
                    });
                }
                // A refused stream: the session goes on without it, the test ends here.
                SenderEvent::StreamRefused { code, message, .. } => {
                    return Ok(Ended {
                        code: Some(code),
                        message,
                    });
                }
                SenderEvent::Established { .. } | SenderEvent::StreamRetrying { .. } => {}
                SenderEvent::MintEpoch { .. } => bail!("unexpected MintEpoch"),
            }
        }
        if progressed {
            continue;
        }
        // The control stream first: the hub's Error frame arrives just before it closes.
        tokio::select! {
            biased;
            read = ctl_rx.read(&mut buf) => match read? {
                Some(n) => {
                    frames.push(&buf[..n]);
                    while let Some(f) = frames.next_frame()? {
                        sender.handle_frame(now(), &f);
                    }
                }
                None => bail!("control stream closed without an Error frame"),
            },
            reason = conn.closed() => bail!("connection closed: {reason}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_past_its_stream_quota_gets_quota_exceeded_and_keeps_its_lane() -> Result<()> {
    let run = start(1).await?;
    // The honest device fills its one stream with `second`.
    let honest = tokio::time::timeout(WAIT, session(&run, "honest", &["second"], 5))
        .await
        .context("the honest device's session timed out")??;
    assert_eq!(honest.code, None, "{honest:?}");

    // d1 may hold one stream: `first` is admitted, then `second` is refused at its first
    // block (its backlog report in the Hello was refused too, and created nothing).
    let first = tokio::time::timeout(WAIT, session(&run, "d1", &["first"], 5))
        .await
        .context("d1's first session timed out")??;
    assert_eq!(first.code, None, "{first:?}");
    let ended = tokio::time::timeout(WAIT, session(&run, "d1", &["first", "second"], 5))
        .await
        .context("the session over the quota did not end")??;
    println!("over the quota: {ended:?}");
    assert_eq!(ended.code, Some(ErrorCode::QuotaExceeded));
    assert_eq!(ErrorCode::QuotaExceeded.to_u16(), 18);
    assert!(
        ended.message.starts_with("stream `second`")
            && ended.message.contains("ingest.streams_per_device_max"),
        "{}",
        ended.message
    );
    assert!(refused(&run.hub, "streams_per_device") >= 1);
    assert_eq!(mark(&run.hub, "d1", "second", 1), 0);

    // Leaving the refused stream out (what the agent does), its lane flows to the end.
    let again = tokio::time::timeout(WAIT, session(&run, "d1", &["first"], 8))
        .await
        .context("the next session timed out")??;
    assert_eq!(again.code, None, "{again:?}");
    assert_eq!(mark(&run.hub, "d1", "first", 1), 8 * RECORDS_PER_BLOCK);
    assert_eq!(mark(&run.hub, "honest", "second", 1), 5 * RECORDS_PER_BLOCK);
    let devices: Vec<String> = run.hub.marks("d1").into_iter().map(|m| m.stream).collect();
    assert_eq!(devices, vec!["first".to_string()]);
    Ok(())
}

/// `d1` with `n` new fields `{prefix}{i}` on top of `common::record`'s, seqs `first..`.
fn wide_block(device: &str, first: u64, prefix: &str, n: usize) -> Result<Vec<u8>> {
    let mut rs = records(device, first, first + 1);
    for r in &mut rs {
        for i in 0..n {
            r.fields.push((format!("{prefix}{i}"), Value::I64(1)));
        }
    }
    Ok(encode_block(VERSION_ROWS, 1, first, &rs)?)
}

/// On a stream many devices share (`columns_per_stream_max` = 16), a device that brought
/// `columns_per_device_max` = 8 of its columns is refused a ninth, while another still brings
/// its own.
async fn device_columns_hold(hub: &Hub) -> Result<()> {
    // `common::record`'s 4 fields count for the device that brought them first: the flooder.
    hub.commit_block("bad", "shared", &wide_block("bad", 1, "f", 4)?)
        .await?;
    let e = hub
        .commit_block("bad", "shared", &wide_block("bad", 3, "g", 1)?)
        .await
        .err()
        .context("a ninth column of one device was admitted")?;
    ensure!(
        quota_key(&e) == Some("ingest.columns_per_device_max"),
        "{e}"
    );
    // Another device still brings columns of its own, and uses the flooder's freely.
    hub.commit_block("good", "shared", &wide_block("good", 1, "f", 4)?)
        .await?;
    hub.commit_block("good", "shared", &wide_block("good", 3, "h", 5)?)
        .await?;
    ensure!(mark(hub, "good", "shared", 1) == 4);
    Ok(())
}

fn shared_stream_config(dir: &Path) -> HubConfig {
    common::config(dir, |c| {
        c.ingest.state.columns_per_stream_max = 16;
        c.ingest.state.columns_per_device_max = 8;
    })
}

/// One device cannot fill a shared stream with columns, and the count is charged to it again
/// after a restart; the stream-wide bound still holds for everyone.
#[tokio::test]
async fn one_device_cannot_fill_a_shared_stream_with_columns() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let cfg = shared_stream_config(dir.path());
    let hub = Hub::open(&cfg)?;
    device_columns_hold(&hub).await?;
    assert_eq!(refused(&hub, "columns_per_device"), 1);
    drop(hub);

    let hub = Hub::open(&cfg)?;
    let e = hub
        .commit_block("bad", "shared", &wide_block("bad", 3, "g", 1)?)
        .await
        .unwrap_err();
    assert_eq!(quota_key(&e), Some("ingest.columns_per_device_max"), "{e}");
    hub.commit_block("good", "shared", &wide_block("good", 5, "h", 6)?)
        .await?;
    // 4 + 4 + 6 = 14 of 16: a third device's three new columns do not fit.
    let e = hub
        .commit_block("third", "shared", &wide_block("third", 1, "t", 3)?)
        .await
        .unwrap_err();
    assert_eq!(quota_key(&e), Some("ingest.columns_per_stream_max"), "{e}");
    assert_eq!(registered_fields(&hub, "shared")?.len(), 14);

    // Mutation: with the per-device limit unchecked, the scenario fails.
    let dir = tempfile::tempdir()?;
    let hub = Hub::open(&shared_stream_config(dir.path()))?;
    hub.quotas().disable_check(Some(Limit::ColumnsPerDevice));
    let outcome = device_columns_hold(&hub).await;
    assert!(
        outcome.is_err(),
        "with columns_per_device unchecked the scenario passed"
    );
    println!("columns_per_device unchecked: {}", outcome.unwrap_err());
    Ok(())
}

/// Tags are columns too: a device that floods a stream with new tag names is refused at its
/// column quota as one that floods it with fields is.
#[tokio::test]
async fn tag_names_count_against_the_column_quota() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let hub = Hub::open(&shared_stream_config(dir.path()))?;
    let tagged = |first: u64, n: usize| -> Result<Vec<u8>> {
        let mut rs = records("bad", first, first + 1);
        for r in &mut rs {
            r.tags = (0..n).map(|i| (format!("t{i}"), "v".to_owned())).collect();
            r.key = sync::record::key_from_tags(&r.tags);
        }
        Ok(encode_block(VERSION_ROWS, 1, first, &rs)?)
    };
    // `common::record`'s 4 fields and 4 tags: 8, the device's quota.
    hub.commit_block("bad", "shared", &tagged(1, 4)?).await?;
    let e = hub
        .commit_block("bad", "shared", &tagged(3, 5)?)
        .await
        .err()
        .context("a ninth column (a tag) of one device was admitted")?;
    assert_eq!(quota_key(&e), Some("ingest.columns_per_device_max"), "{e}");
    Ok(())
}
