//! `/metrics`: the hub's counters in the Prometheus text format.
//!
//! Counters live as atomics next to the code that bumps them ([`crate::wal::WalStats`],
//! [`crate::ingest::IngestStats`]); per-device marks come from the catalog at scrape time, so
//! a scrape shows exactly what has been acknowledged.

use crate::ingest::Hub;
use crate::wal::BATCH_BUCKETS;
use std::fmt::Write;
use std::sync::atomic::Ordering;

/// Renders every hub metric except the completeness gauges.
pub fn render(hub: &Hub) -> String {
    render_with(hub, None)
}

/// Renders every hub metric, with the completeness gauges when `tracker` is given.
pub fn render_with(hub: &Hub, tracker: Option<&crate::completeness::Tracker>) -> String {
    let mut out = String::with_capacity(4096);
    let s = hub.stats();
    let w = hub.wal_stats();
    let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    counter(
        &mut out,
        "tributary_hub_blocks_committed_total",
        "Blocks made durable in tier 1.",
        load(&s.blocks_committed),
    );
    counter(
        &mut out,
        "tributary_hub_records_committed_total",
        "Records made durable in tier 1.",
        load(&s.records_committed),
    );
    counter(
        &mut out,
        "tributary_hub_block_bytes_committed_total",
        "Encoded block bytes made durable.",
        load(&s.bytes_committed),
    );
    counter(
        &mut out,
        "tributary_hub_duplicate_blocks_total",
        "Blocks acknowledged as duplicates.",
        load(&s.duplicates),
    );
    counter(
        &mut out,
        "tributary_hub_trimmed_blocks_total",
        "Blocks trimmed at the mark.",
        load(&s.trimmed_blocks),
    );
    counter(
        &mut out,
        "tributary_hub_conflicts_total",
        "Content conflicts (ALARM: a device was fenced).",
        load(&s.conflicts),
    );
    counter(
        &mut out,
        "tributary_hub_rejected_blocks_total",
        "Blocks refused for any reason.",
        load(&s.rejected),
    );
    counter(
        &mut out,
        "tributary_hub_gaps_total",
        "Gap markers recorded (the catalog's gaps at start, then each new one).",
        load(&s.gaps),
    );
    gauge(
        &mut out,
        "tributary_hub_devices_connected",
        "Devices with at least one live QUIC connection.",
        load(&s.devices_connected),
    );
    counter(
        &mut out,
        "tributary_hub_decoded_too_large_blocks_total",
        "Blocks refused because their records would exceed ingest.block_decoded_bytes_max.",
        load(&s.decoded_too_large),
    );
    counter(
        &mut out,
        "tributary_hub_stored_blocks_quarantined_total",
        "Stored WAL blocks found over the decode limits or undecodable by a reader, and quarantined.",
        load(&s.stored_quarantined),
    );
    counter(
        &mut out,
        "tributary_hub_stored_blocks_refused_total",
        "Reads of stored WAL blocks refused for not decoding within the limits.",
        load(&s.stored_refused),
    );
    revocation_metrics(&mut out, &s.revocation);
    quota_metrics(&mut out, hub);
    crate::server::connection_metrics(&mut out, &s.connections);
    counter(
        &mut out,
        "tributary_hub_wal_fsyncs_total",
        "WAL fdatasync calls.",
        load(&w.fsyncs),
    );
    counter(
        &mut out,
        "tributary_hub_group_commits_total",
        "Group commits (one catalog transaction each).",
        load(&w.group_commits),
    );
    counter(
        &mut out,
        "tributary_hub_wal_entries_total",
        "Blocks appended to the WAL.",
        load(&w.entries),
    );
    counter(
        &mut out,
        "tributary_hub_wal_bytes_total",
        "Bytes appended to the WAL.",
        load(&w.bytes),
    );
    gauge(
        &mut out,
        "tributary_hub_wal_committed_offset",
        "Logical WAL offset covered by the committed marks.",
        load(&w.committed_end),
    );
    gauge(
        &mut out,
        "tributary_hub_wal_poisoned",
        "1 once a WAL write or fsync failed (not for a full disk); cleared by a restart.",
        u64::from(w.poisoned.load(Ordering::Relaxed)),
    );
    gauge(
        &mut out,
        "tributary_hub_wal_disk_full",
        "1 while tier-1 writes are refused because the disk is full (resumes on its own).",
        u64::from(w.disk_full.load(Ordering::Relaxed)),
    );
    counter(
        &mut out,
        "tributary_hub_wal_disk_full_failures_total",
        "Group commits that failed for a full disk and were rolled back.",
        load(&w.disk_full_failures),
    );
    counter(
        &mut out,
        "tributary_hub_wal_disk_full_refused_total",
        "Requests refused without being written while the disk was full.",
        load(&w.disk_full_refused),
    );
    counter(
        &mut out,
        "tributary_hub_wal_disk_full_resumed_total",
        "Times tier-1 writes resumed after a full disk.",
        load(&w.disk_full_resumed),
    );
    hub.startup().render_metrics(&mut out);
    gauge(
        &mut out,
        "tributary_hub_wal_fd_exhausted",
        "1 while tier-1 writes back off because the hub is out of file descriptors.",
        u64::from(w.fd_exhausted.load(Ordering::Relaxed)),
    );
    counter(
        &mut out,
        "tributary_hub_wal_fd_exhausted_total",
        "WAL rolls (or retries) that failed for EMFILE or ENFILE and were rolled back.",
        load(&w.fd_exhausted_failures),
    );
    gauge(
        &mut out,
        "tributary_hub_ingest_memory_bytes",
        "Ingest memory reserved from the budget.",
        hub.memory_in_use_bytes(),
    );
    group_commit_histogram(&mut out, w);
    let listed = listed_devices(hub);
    catalog_metrics(&mut out, hub, &listed);
    streams_metrics(&mut out, hub);
    if let Some(t) = hub.tier_stats() {
        tier_metrics(&mut out, t);
    }
    if let Some(t) = tracker {
        completeness_metrics(&mut out, hub, t, &listed);
    }
    crate::scrub::render_metrics(&mut out, hub);
    crate::republish::store::render_metrics(&mut out, hub);
    out
}

/// Seconds since the Unix epoch of a ns timestamp, as a Prometheus float.
fn secs(ns: i64) -> f64 {
    ns as f64 / 1e9
}

/// Per stream: watermark, complete-through time and active devices; per device and stream:
/// backlog and last contact. Retired devices are left out (see [`crate::completeness`]).
fn completeness_metrics(
    out: &mut String,
    hub: &Hub,
    tracker: &crate::completeness::Tracker,
    listed: &Listed,
) {
    let streams = hub.catalog().streams().unwrap_or_default();
    let summaries: Vec<_> = streams
        .iter()
        .filter_map(|s| tracker.summary(hub, &s.name).ok())
        .collect();
    let families: [(&str, &str, &str); 6] = [
        (
            "tributary_hub_stream_watermark_seconds",
            "gauge",
            "Minimum over active devices of their newest event time (s since the Unix epoch).",
        ),
        (
            "tributary_hub_stream_complete_through_seconds",
            "gauge",
            "Event time up to which every non-retired device is settled (s since the Unix epoch).",
        ),
        (
            "tributary_hub_stream_active_devices",
            "gauge",
            "Devices in the stream's watermark (not idle).",
        ),
        (
            "tributary_hub_device_backlog_blocks",
            "gauge",
            "Unsent blocks a device last reported, per stream.",
        ),
        (
            "tributary_hub_device_backlog_bytes",
            "gauge",
            "Unsent bytes a device last reported, per stream.",
        ),
        (
            "tributary_hub_device_last_contact_seconds",
            "gauge",
            "When the hub last heard from a device (s since the Unix epoch).",
        ),
    ];
    for (i, (name, kind, help)) in families.iter().enumerate() {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for sum in &summaries {
            let stream = escape(&sum.stream);
            match i {
                0 => {
                    if let Some(w) = sum.watermark_ns {
                        let _ = writeln!(out, "{name}{{stream=\"{stream}\"}} {}", secs(w));
                    }
                }
                1 => {
                    if let Some(c) = sum.complete_through_ns.filter(|&c| c > i64::MIN) {
                        let _ = writeln!(out, "{name}{{stream=\"{stream}\"}} {}", secs(c));
                    }
                }
                2 => {
                    let _ = writeln!(out, "{name}{{stream=\"{stream}\"}} {}", sum.active_devices);
                }
                _ => {
                    for d in sum.devices.iter().filter(|d| listed.contains(&d.device)) {
                        let device = escape(&d.device);
                        let v = match i {
                            3 => d.backlog_blocks as f64,
                            4 => d.backlog_bytes as f64,
                            _ => match d.last_contact_ns {
                                Some(t) => secs(t),
                                None => continue,
                            },
                        };
                        let _ =
                            writeln!(out, "{name}{{device=\"{device}\",stream=\"{stream}\"}} {v}");
                    }
                }
            }
        }
    }
}

/// The revocation list in force: a line it could not take as written is an alarm, never a
/// silent no-op.
fn revocation_metrics(out: &mut String, r: &crate::pki::RevocationStats) {
    let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    gauge(
        out,
        "tributary_hub_revocation_entries",
        "Devices and serials in the revocation list in force.",
        load(&r.entries),
    );
    gauge(
        out,
        "tributary_hub_revocation_entries_invalid",
        "Revocation-list lines that do not parse (ALARM; the device of such a line is revoked whole).",
        load(&r.invalid),
    );
    gauge(
        out,
        "tributary_hub_revocation_entries_unmatched",
        "Revoked serials that match no issued certificate of their device (ALARM).",
        load(&r.unmatched),
    );
    counter(
        out,
        "tributary_hub_revocation_load_failures_total",
        "Revocation-list reloads that failed; the previous list stayed in force.",
        load(&r.load_failures),
    );
    counter(
        out,
        "tributary_hub_revoked_sessions_closed_total",
        "Live sessions closed because their certificate was revoked.",
        load(&r.sessions_closed),
    );
}

/// The devices listed with their own series: the first `metrics.device_series_max` by name.
/// The others are left out of every per-device family, and counted, so a flood of devices
/// cannot make a scrape unbounded.
struct Listed {
    names: std::collections::HashSet<String>,
    omitted: u64,
}

impl Listed {
    fn contains(&self, device: &str) -> bool {
        self.names.contains(device)
    }
}

fn listed_devices(hub: &Hub) -> Listed {
    // The catalog lists devices by name.
    let devices = hub.catalog().devices().unwrap_or_default();
    let max = hub.device_series_max();
    let omitted = devices.len().saturating_sub(max) as u64;
    let names = devices.into_iter().take(max).map(|d| d.name).collect();
    Listed { names, omitted }
}

/// Refusals per per-device state quota (`ingest::quotas`), and how many devices the
/// per-device families leave out.
fn quota_metrics(out: &mut String, hub: &Hub) {
    let name = "tributary_hub_quota_refused_total";
    let _ = writeln!(
        out,
        "# HELP {name} Blocks, gaps and backlog reports refused by a per-device state quota (QUOTA_EXCEEDED), by limit.\n# TYPE {name} counter"
    );
    for limit in crate::ingest::quotas::Limit::ALL {
        let v = hub.quotas().stats().refused(limit);
        let _ = writeln!(out, "{name}{{limit=\"{}\"}} {v}", limit.label());
    }
}

pub(crate) fn counter(out: &mut String, name: &str, help: &str, v: u64) {
    let _ = writeln!(
        out,
        "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
    );
}

pub(crate) fn gauge(out: &mut String, name: &str, help: &str, v: u64) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
}

fn group_commit_histogram(out: &mut String, w: &crate::wal::WalStats) {
    let name = "tributary_hub_group_commit_size";
    let _ = writeln!(
        out,
        "# HELP {name} Requests per group commit.\n# TYPE {name} histogram"
    );
    let mut cumulative = 0;
    for (i, bucket) in w.batch_hist.iter().enumerate() {
        cumulative += bucket.load(Ordering::Relaxed);
        let le = if i == BATCH_BUCKETS - 1 {
            "+Inf".to_string()
        } else {
            (1u64 << i).to_string()
        };
        let _ = writeln!(out, "{name}_bucket{{le=\"{le}\"}} {cumulative}");
    }
    let _ = writeln!(
        out,
        "{name}_sum {}",
        w.group_commit_requests.load(Ordering::Relaxed)
    );
    let _ = writeln!(out, "{name}_count {cumulative}");
}

fn catalog_metrics(out: &mut String, hub: &Hub, listed: &Listed) {
    let devices = hub.catalog().devices().unwrap_or_default();
    let fenced = devices.iter().filter(|d| d.fence_reason.is_some()).count();
    gauge(
        out,
        "tributary_hub_fenced_devices",
        "Devices fenced after a content conflict.",
        fenced as u64,
    );
    gauge(
        out,
        "tributary_hub_metrics_devices_omitted",
        "Devices left out of the per-device series (beyond metrics.device_series_max, by name).",
        listed.omitted,
    );
    let name = "tributary_hub_stream_next_offset";
    let _ = writeln!(
        out,
        "# HELP {name} Next hub offset (records committed) per stream.\n# TYPE {name} gauge"
    );
    for s in hub.catalog().streams().unwrap_or_default() {
        let _ = writeln!(
            out,
            "{name}{{stream=\"{}\"}} {}",
            escape(&s.name),
            s.next_offset
        );
    }
    let name = "tributary_hub_durable_seq";
    let _ = writeln!(
        out,
        "# HELP {name} Durable mark per device, stream and epoch.\n# TYPE {name} gauge"
    );
    for m in hub.catalog().all_marks().unwrap_or_default() {
        let device = hub.device_name(m.device).unwrap_or_default();
        if !listed.contains(&device) {
            continue;
        }
        let stream = hub.stream_name(m.stream).unwrap_or_default();
        let _ = writeln!(
            out,
            "{name}{{device=\"{}\",stream=\"{}\",epoch=\"{}\"}} {}",
            escape(&device),
            escape(&stream),
            sync::epoch::format(m.epoch),
            m.durable_seq
        );
    }
}

/// Merged streams: scale events, open segments per stream and each open segment's rates.
fn streams_metrics(out: &mut String, hub: &Hub) {
    // Reader bounds: the block cache, follow responses, byte-cut pages.
    crate::read::render_metrics(out, hub);
    let st = hub.streams().stats();
    counter(
        out,
        "tributary_hub_segment_splits_total",
        "Segment splits applied by the scalers.",
        st.splits.load(Ordering::Relaxed),
    );
    counter(
        out,
        "tributary_hub_segment_merges_total",
        "Segment merges applied by the scalers.",
        st.merges.load(Ordering::Relaxed),
    );
    counter(
        out,
        "tributary_hub_scale_errors_total",
        "Scale events that could not be applied or stored.",
        st.scale_errors.load(Ordering::Relaxed),
    );
    let mut open = Vec::new();
    let mut rates = Vec::new();
    for s in hub.catalog().streams().unwrap_or_default() {
        let name = escape(&s.name);
        if let Ok(snap) = hub.streams().snapshot(s.id) {
            open.push((name.clone(), snap.graph.open().count()));
        }
        if let Ok((r, _)) = hub.streams().rates(s.id) {
            rates.push((name, r));
        }
    }
    let name = "tributary_hub_stream_open_segments";
    let _ = writeln!(
        out,
        "# HELP {name} Open segments per stream.\n# TYPE {name} gauge"
    );
    for (stream, n) in &open {
        let _ = writeln!(out, "{name}{{stream=\"{stream}\"}} {n}");
    }
    let families: [(&str, &str); 3] = [
        (
            "tributary_hub_segment_records_per_second",
            "Recent records/s per open segment, as its scaler measures it.",
        ),
        (
            "tributary_hub_segment_bytes_per_second",
            "Recent tier-1 block bytes/s per open segment.",
        ),
        (
            "tributary_hub_segment_load",
            "Segment rate relative to the stream's scale target (1 = at target, 0 without a policy).",
        ),
    ];
    for (i, (name, help)) in families.iter().enumerate() {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
        for (stream, segs) in &rates {
            for r in segs {
                let v = match i {
                    0 => r.records_per_s,
                    1 => r.bytes_per_s,
                    _ => r.load,
                };
                let _ = writeln!(
                    out,
                    "{name}{{stream=\"{stream}\",segment=\"{}\"}} {v}",
                    r.segment
                );
            }
        }
    }
}

/// Tiering to tier 2 (see [`crate::tiering`]): rounds, uploads, eviction and pushback.
fn tier_metrics(out: &mut String, t: &crate::tiering::TierStats) {
    let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    let flag = |a: &std::sync::atomic::AtomicBool| u64::from(a.load(Ordering::Relaxed));
    let counters: [(&str, &str, u64); 16] = [
        (
            "tributary_hub_tier_rounds_total",
            "Tiering rounds run.",
            load(&t.rounds),
        ),
        (
            "tributary_hub_tier_round_errors_total",
            "Tiering rounds that failed.",
            load(&t.round_errors),
        ),
        (
            "tributary_hub_tier_chunks_committed_total",
            "Tier-2 chunks committed to the catalog.",
            load(&t.chunks_committed),
        ),
        (
            "tributary_hub_tier_records_tiered_total",
            "Records committed to tier 2.",
            load(&t.records_tiered),
        ),
        (
            "tributary_hub_tier_bytes_uploaded_total",
            "Bytes uploaded to tier 2.",
            load(&t.bytes_uploaded),
        ),
        (
            "tributary_hub_tier_wal_files_evicted_total",
            "Tier-1 WAL files evicted after tiering.",
            load(&t.wal_files_evicted),
        ),
        (
            "tributary_hub_tier_wal_bytes_evicted_total",
            "Tier-1 WAL bytes evicted after tiering.",
            load(&t.wal_bytes_evicted),
        ),
        (
            "tributary_hub_tier2_chunks_deleted_total",
            "Tier-2 chunks deleted (retention or cleanup).",
            load(&t.tier2_chunks_deleted),
        ),
        (
            "tributary_hub_iceberg_commits_total",
            "Iceberg snapshots that appended tiering ranges (at most one per table per tier2.commit_interval).",
            load(&t.lake_commits),
        ),
        (
            "tributary_hub_iceberg_already_committed_total",
            "Commits a restart skipped because the table already held the ranges.",
            load(&t.lake_ranges_already_committed),
        ),
        (
            "tributary_hub_iceberg_files_deleted_total",
            "Data files removed from Iceberg tables by tier-2 retention.",
            load(&t.lake_files_deleted),
        ),
        (
            "tributary_hub_iceberg_snapshots_expired_total",
            "Iceberg snapshots expired by table maintenance (tier2.snapshot_retention).",
            load(&t.lake_snapshots_expired),
        ),
        (
            "tributary_hub_iceberg_orphans_removed_total",
            "Objects no retained Iceberg snapshot referenced, removed by table maintenance.",
            load(&t.lake_orphans_removed),
        ),
        (
            "tributary_hub_iceberg_maintenance_errors_total",
            "Iceberg table maintenance runs that failed (retried at the next interval).",
            load(&t.lake_maintenance_errors),
        ),
        (
            "tributary_hub_tier_pushbacks_total",
            "Blocks refused while tier 1 was over its budget.",
            load(&t.pushbacks),
        ),
        (
            "tributary_hub_tier_field_kind_changes_total",
            "Fields that arrived with a new kind (e.g. a string after numbers) and got a column of their own in tier 2.",
            load(&t.field_kind_changes),
        ),
    ];
    for (name, help, v) in counters {
        counter(out, name, help, v);
    }
    gauge(
        out,
        "tributary_hub_tier2_down",
        "1 while the last tiering round failed talking to tier 2.",
        flag(&t.tier2_down),
    );
    gauge(
        out,
        "tributary_hub_tier_pushing_back",
        "1 while the admission gate refuses new blocks.",
        flag(&t.pushing_back),
    );
}

/// Escapes a Prometheus label value.
fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}
