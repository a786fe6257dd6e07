//! The republish tables in the hub catalog: each stream's checkpoint, the bounded dead-letter
//! list and the dead-letter counts per reason.
//!
//! A batch's dead letters, their counts and the checkpoint past the batch are written in one
//! transaction, so a crash either keeps all of them or none: a dead-lettered record is then
//! either recorded once and never read again, or read again and dead-lettered again.
//! The tables are created by the sink itself (`CREATE TABLE IF NOT EXISTS`), so a hub without
//! `[republish]` carries none; readers of a table that does not exist yet see it empty.

use super::dead_letter::DeadLetter;
use crate::ingest::Hub;
use rusqlite::{Connection, OptionalExtension, params};
use std::fmt::Write;

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS republish_checkpoints (
    stream TEXT PRIMARY KEY,
    next_offset INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS republish_dead_letters (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    stream TEXT NOT NULL,
    record_offset INTEGER NOT NULL,
    device TEXT NOT NULL,
    epoch INTEGER NOT NULL,
    seq INTEGER NOT NULL,
    key TEXT NOT NULL,
    key_bytes INTEGER NOT NULL,
    reason TEXT NOT NULL,
    detail TEXT NOT NULL,
    at_ns INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS republish_sparkplug_sessions (
    stream TEXT PRIMARY KEY,
    bd_seq INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS republish_dead_letter_counts (
    stream TEXT NOT NULL,
    reason TEXT NOT NULL,
    count INTEGER NOT NULL,
    PRIMARY KEY (stream, reason)
);";

/// Creates the tables if they are missing.
pub fn ensure_schema(hub: &Hub) -> rusqlite::Result<()> {
    hub.catalog().with_write_conn(|c| c.execute_batch(SCHEMA))
}

/// The stored checkpoint of `stream`: the next hub offset to publish (0 when none).
pub fn checkpoint(hub: &Hub, stream: &str) -> rusqlite::Result<u64> {
    ensure_schema(hub)?;
    let v = hub.catalog().with_write_conn(|c| {
        c.query_row(
            "SELECT next_offset FROM republish_checkpoints WHERE stream = ?1",
            [stream],
            |r| r.get::<_, i64>(0),
        )
        .optional()
    })?;
    Ok(v.map_or(0, |v| v as u64))
}

/// The `bdSeq` of `stream`'s next Sparkplug connection: one above the last one taken (0 for
/// the first ever, wrapping after 255), stored before it is used. Kept across restarts so that
/// the Will of a dead connection, which the broker may deliver after the next connection's
/// NBIRTH, never carries the new connection's `bdSeq`.
pub fn next_bd_seq(hub: &Hub, stream: &str) -> rusqlite::Result<u8> {
    ensure_schema(hub)?;
    hub.catalog().with_write_conn(|c| {
        let tx = c.transaction()?;
        let last: Option<i64> = tx
            .query_row(
                "SELECT bd_seq FROM republish_sparkplug_sessions WHERE stream = ?1",
                [stream],
                |r| r.get(0),
            )
            .optional()?;
        let next = last.map_or(0, |b| (b + 1) & 0xff) as u8;
        tx.execute(
            "INSERT INTO republish_sparkplug_sessions (stream, bd_seq) VALUES (?1, ?2)
             ON CONFLICT (stream) DO UPDATE SET bd_seq = excluded.bd_seq",
            params![stream, i64::from(next)],
        )?;
        tx.commit()?;
        Ok(next)
    })
}

/// Records `dead`, counts them, moves `stream`'s checkpoint to `next` and trims the list to
/// its newest `keep` entries, in one transaction.
pub fn commit_batch(
    hub: &Hub,
    stream: &str,
    next: u64,
    dead: &[DeadLetter],
    keep: u64,
) -> rusqlite::Result<()> {
    hub.catalog().with_write_conn(|c| {
        let tx = c.transaction()?;
        for d in dead {
            insert_dead_letter(&tx, d)?;
        }
        if !dead.is_empty() {
            tx.execute(
                "DELETE FROM republish_dead_letters
                 WHERE id <= (SELECT max(id) FROM republish_dead_letters) - ?1",
                [keep as i64],
            )?;
        }
        tx.execute(
            "INSERT INTO republish_checkpoints (stream, next_offset) VALUES (?1, ?2)
             ON CONFLICT (stream) DO UPDATE SET next_offset = max(next_offset, excluded.next_offset)",
            params![stream, next as i64],
        )?;
        tx.commit()
    })
}

fn insert_dead_letter(c: &Connection, d: &DeadLetter) -> rusqlite::Result<()> {
    c.execute(
        "INSERT INTO republish_dead_letters
         (stream, record_offset, device, epoch, seq, key, key_bytes, reason, detail, at_ns)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)",
        params![
            d.stream,
            d.offset as i64,
            d.device,
            d.epoch as i64,
            d.seq as i64,
            d.key,
            d.key_bytes as i64,
            d.reason.as_str(),
            d.detail,
            d.at_ns
        ],
    )?;
    c.execute(
        "INSERT INTO republish_dead_letter_counts (stream, reason, count) VALUES (?1, ?2, 1)
         ON CONFLICT (stream, reason) DO UPDATE SET count = count + 1",
        params![d.stream, d.reason.as_str()],
    )?;
    Ok(())
}

/// The newest `limit` dead letters (of `stream` when given), newest first.
pub fn dead_letters(hub: &Hub, stream: Option<&str>, limit: usize) -> Vec<DeadLetter> {
    let query = |c: &mut Connection| -> rusqlite::Result<Vec<DeadLetter>> {
        let mut st = c.prepare(
            "SELECT stream, record_offset, device, epoch, seq, key, key_bytes, reason, detail,
                    at_ns
             FROM republish_dead_letters WHERE ?1 IS NULL OR stream = ?1
             ORDER BY id DESC LIMIT ?2",
        )?;
        let rows = st.query_map(params![stream, limit as i64], |r| {
            Ok(DeadLetter {
                stream: r.get(0)?,
                offset: r.get::<_, i64>(1)? as u64,
                device: r.get(2)?,
                epoch: r.get::<_, i64>(3)? as u64,
                seq: r.get::<_, i64>(4)? as u64,
                key: r.get(5)?,
                key_bytes: r.get::<_, i64>(6)? as usize,
                reason: super::dead_letter::Reason::parse(&r.get::<_, String>(7)?),
                detail: r.get(8)?,
                at_ns: r.get(9)?,
            })
        })?;
        rows.collect()
    };
    // The table appears with the sink's first start.
    hub.catalog().with_read_conn(query).unwrap_or_default()
}

/// Dead letters counted so far, as `(stream, reason, count)`.
pub fn dead_letter_counts(hub: &Hub) -> Vec<(String, String, u64)> {
    let query = |c: &mut Connection| -> rusqlite::Result<Vec<(String, String, u64)>> {
        let mut st = c.prepare(
            "SELECT stream, reason, count FROM republish_dead_letter_counts
             ORDER BY stream, reason",
        )?;
        let rows = st.query_map([], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get::<_, i64>(2)? as u64))
        })?;
        rows.collect()
    };
    hub.catalog().with_read_conn(query).unwrap_or_default()
}

fn checkpoints(hub: &Hub) -> Vec<(String, u64)> {
    let query = |c: &mut Connection| -> rusqlite::Result<Vec<(String, u64)>> {
        let mut st =
            c.prepare("SELECT stream, next_offset FROM republish_checkpoints ORDER BY stream")?;
        let rows = st.query_map([], |r| Ok((r.get(0)?, r.get::<_, i64>(1)? as u64)))?;
        rows.collect()
    };
    hub.catalog().with_read_conn(query).unwrap_or_default()
}

/// Appends the republish families to a `/metrics` scrape: dead letters per stream and reason,
/// and each stream's checkpoint. Nothing when the sink never ran.
pub fn render_metrics(out: &mut String, hub: &Hub) {
    let counts = dead_letter_counts(hub);
    let checkpoints = checkpoints(hub);
    if counts.is_empty() && checkpoints.is_empty() {
        return;
    }
    let name = "tributary_hub_republish_dead_letter_total";
    let _ = writeln!(
        out,
        "# HELP {name} Records the MQTT republish sink could not publish and skipped (see GET /v1/republish/dead-letters).\n# TYPE {name} counter"
    );
    for (stream, reason, n) in &counts {
        let _ = writeln!(
            out,
            "{name}{{stream=\"{}\",reason=\"{}\"}} {n}",
            label(stream),
            label(reason)
        );
    }
    let name = "tributary_hub_republish_checkpoint_offset";
    let _ = writeln!(
        out,
        "# HELP {name} The next hub offset the republish sink publishes, per stream.\n# TYPE {name} gauge"
    );
    for (stream, next) in &checkpoints {
        let _ = writeln!(out, "{name}{{stream=\"{}\"}} {next}", label(stream));
    }
}

fn label(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}
