//! The status page's devices table: worst first, each device that is not fine with why in
//! words (revoked: the line of the list that does it and, once the hub refused a certificate
//! of it by device or by serial, where and when; fenced and the conflict, the gaps
//! its agent reported and how many records they lost, offline), and the healthy rest of a
//! large fleet collapsed under one `<details>` line, so the page stays usable with thousands.
//!
//! A device with gaps is never shown as complete: the gaps are permanent (the agent dropped
//! those records under its disk budget), so "incomplete" stays until the device is retired.
//!
//! Element ids: `devices` (the table of devices that need attention), `devices-healthy` (the
//! collapsed rest), `device-{name}` (a row), with the state in `td.state` and why in `td.why`.

use std::collections::HashMap;
use std::fmt::Write;

use super::{ago, bytes, esc, slug, span, time_cell};
use crate::catalog::{DeviceRow, GapRow, StreamId};
use crate::ingest::Hub;

/// Rows of the attention table shown at most; the rest are counted, `core-hub devices` lists all.
pub(super) const ATTENTION_ROWS_MAX: usize = 100;
/// Rows of the collapsed healthy table rendered at most.
pub(super) const HEALTHY_ROWS_MAX: usize = 500;

/// A device's overall state, worst first (the order of the table).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Health {
    Revoked,
    Fenced,
    Gaps,
    Offline,
    Connected,
    Retired,
}

impl Health {
    fn label(self) -> &'static str {
        match self {
            Health::Revoked => "<span class=bad>revoked</span>",
            Health::Fenced => "<span class=bad>fenced</span>",
            Health::Gaps => "<span class=bad>incomplete: gaps</span>",
            Health::Offline => "<span class=bad>offline</span>",
            Health::Connected => "<span class=ok>connected</span>",
            Health::Retired => "<span class=dim>retired</span>",
        }
    }

    fn needs_attention(self) -> bool {
        self < Health::Connected
    }
}

/// One device as the page shows it.
pub(super) struct DeviceView<'a> {
    pub row: &'a DeviceRow,
    pub health: Health,
    /// Every reason it is not fine, as sentences (escaped when rendered).
    pub why: Vec<String>,
}

/// No catalog row has this id: a device refused for a revocation before any session of it
/// started is shown with it, so it matches no marks, backlog or gaps.
const UNCATALOGUED: crate::catalog::DeviceId = crate::catalog::DeviceId::MAX;

/// The catalog's devices and those refused for a revocation before they ever had a session.
pub(super) fn with_refused(hub: &Hub, mut devices: Vec<DeviceRow>) -> Vec<DeviceRow> {
    let strangers = crate::refusals::uncatalogued(hub, &devices);
    devices.extend(strangers.into_iter().map(|name| DeviceRow {
        id: UNCATALOGUED,
        name,
        fence_reason: None,
        last_contact_ns: None,
        retired: false,
    }));
    devices
}

/// The gaps each device reported, by device name.
pub(super) fn gaps_by_device(hub: &Hub, devices: &[DeviceRow]) -> HashMap<String, Vec<GapRow>> {
    let cat = hub.catalog();
    devices
        .iter()
        .filter_map(|d| {
            let gaps = cat.gaps_of(d.id).unwrap_or_default();
            (!gaps.is_empty()).then(|| (d.name.clone(), gaps))
        })
        .collect()
}

/// "1,000 records lost in 2 gaps (telemetry@7: seqs 10-1009, budget full; ...)", over the
/// gaps of `stream` only when given.
pub(super) fn gap_summary(hub: &Hub, gaps: &[GapRow], stream: Option<StreamId>) -> Option<String> {
    let gaps: Vec<&GapRow> = gaps
        .iter()
        .filter(|g| stream.is_none_or(|s| g.stream == s))
        .collect();
    if gaps.is_empty() {
        return None;
    }
    let lost: u64 = gaps
        .iter()
        .map(|g| g.last_seq.saturating_sub(g.first_seq) + 1)
        .sum();
    let detail: Vec<String> = gaps
        .iter()
        .take(3)
        .map(|g| {
            let s = hub.stream_name(g.stream).unwrap_or_default();
            let epoch = sync::epoch::format(g.epoch);
            format!(
                "{s}@{epoch}: seqs {}-{}, {}",
                g.first_seq, g.last_seq, g.reason
            )
        })
        .collect();
    let more = if gaps.len() > 3 { "; ..." } else { "" };
    let n = gaps.len();
    let plural = if n == 1 { "" } else { "s" };
    Some(format!(
        "{lost} records lost in {n} gap{plural} the agent reported ({}{more})",
        detail.join("; ")
    ))
}

/// Classifies every device, worst first, then by name.
pub(super) fn classify<'a>(
    hub: &Hub,
    devices: &'a [DeviceRow],
    gaps: &HashMap<String, Vec<GapRow>>,
    now: i64,
    offline_after: i64,
) -> Vec<DeviceView<'a>> {
    let revocation = &hub.stats().revocation;
    let mut out: Vec<DeviceView<'a>> = devices
        .iter()
        .map(|row| {
            let mut why = Vec::new();
            let revoked = revocation.revoked_reason(&row.name);
            why.extend(revoked.as_ref().map(|r| format!("revoked: {r}")));
            if let Some(r) = &row.fence_reason {
                why.push(format!("fenced: {r}"));
            }
            let gap = gaps.get(&row.name).and_then(|g| gap_summary(hub, g, None));
            why.extend(gap.clone());
            let online = row
                .last_contact_ns
                .is_some_and(|t| now - t <= offline_after);
            if !online && !row.retired {
                let since = row
                    .last_contact_ns
                    .map_or("never".into(), |t| span(now - t));
                why.push(format!("no contact for {since}"));
            }
            let health = if row.retired {
                Health::Retired
            } else if revoked.is_some() {
                Health::Revoked
            } else if row.fence_reason.is_some() {
                Health::Fenced
            } else if gap.is_some() {
                Health::Gaps
            } else if !online {
                Health::Offline
            } else {
                Health::Connected
            };
            DeviceView { row, health, why }
        })
        .collect();
    out.sort_by(|a, b| (a.health, &a.row.name).cmp(&(b.health, &b.row.name)));
    out
}

const HEAD: &str = "<thead><tr><th>Device</th><th>State</th><th>Why</th><th>Last seen</th>\
    <th>Event-time lag</th><th>Backlog</th><th>Oldest unsent</th><th>Acked seqs</th></tr></thead>";

/// The devices section: counts, the attention table, the collapsed healthy devices.
pub(super) fn section(
    h: &mut String,
    hub: &Hub,
    views: &[DeviceView<'_>],
    newest: &HashMap<&str, i64>,
    now: i64,
) {
    let (attention, healthy): (Vec<&DeviceView>, Vec<&DeviceView>) =
        views.iter().partition(|v| v.health.needs_attention());
    let _ = writeln!(
        h,
        "<h2>Devices</h2>\n<p id=devices-summary>{} need attention, {} connected or retired.</p>\n\
         <table id=devices>{HEAD}<tbody>",
        attention.len(),
        healthy.len()
    );
    for v in attention.iter().take(ATTENTION_ROWS_MAX) {
        row(h, hub, v, newest, now);
    }
    h.push_str("</tbody></table>\n");
    more(h, attention.len(), ATTENTION_ROWS_MAX);
    let _ = writeln!(
        h,
        "<details id=devices-healthy><summary>{} devices connected with no gaps, or retired \
         (click to show)</summary>\n<table>{HEAD}<tbody>",
        healthy.len()
    );
    for v in healthy.iter().take(HEALTHY_ROWS_MAX) {
        row(h, hub, v, newest, now);
    }
    h.push_str("</tbody></table>\n");
    more(h, healthy.len(), HEALTHY_ROWS_MAX);
    h.push_str("</details>\n");
}

fn more(h: &mut String, n: usize, shown: usize) {
    if n > shown {
        let _ = writeln!(
            h,
            "<p class=dim>and {} more, not shown: <code>core-hub devices</code> lists every \
             device.</p>",
            n - shown
        );
    }
}

fn row(h: &mut String, hub: &Hub, v: &DeviceView<'_>, newest: &HashMap<&str, i64>, now: i64) {
    let d = v.row;
    let cat = hub.catalog();
    let backlog = cat.backlog_of(d.id).unwrap_or_default();
    let (blocks, size) = backlog
        .iter()
        .fold((0u64, 0u64), |(b, s), r| (b + r.blocks, s + r.bytes));
    let oldest = backlog
        .iter()
        .filter(|r| r.blocks > 0 || r.bytes > 0)
        .filter_map(|r| r.oldest_unsent_ts)
        .min();
    let acked: Vec<String> = cat
        .marks_of(d.id)
        .unwrap_or_default()
        .iter()
        .map(|m| {
            let s = hub.stream_name(m.stream).unwrap_or_default();
            format!(
                "{}@{}: {}",
                esc(&s),
                sync::epoch::format(m.epoch),
                m.durable_seq
            )
        })
        .collect();
    let lag = newest
        .get(d.name.as_str())
        .map_or("&mdash;".to_string(), |&t| span(now - t));
    let why: Vec<String> = v.why.iter().map(|w| esc(w)).collect();
    let _ = writeln!(
        h,
        "<tr id=\"device-{}\"><td class=name>{}</td><td class=state>{}</td><td class=why>{}</td>\
         <td>{}</td><td>{lag}</td><td>{blocks} blocks, {}</td><td>{}</td><td>{}</td></tr>",
        slug(&d.name),
        esc(&d.name),
        v.health.label(),
        if why.is_empty() {
            "&mdash;".to_string()
        } else {
            why.join("<br>")
        },
        ago(now, d.last_contact_ns),
        bytes(size),
        time_cell(oldest),
        acked.join("<br>")
    );
}
