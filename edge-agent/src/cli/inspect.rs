//! `edge-agent inspect`: prints a stopped agent's stored records of one stream as NDJSON, one
//! object per record: `{"epoch","seq","key","ts","fields"}`, in epoch then seq order, the epoch
//! as 16 hex digits (a string, as in the agent's and the hub's other JSON). Gap
//! markers (dropped or quarantined seq ranges) go to stderr, so the output stays pure data.
//!
//! It opens the log exactly as `run` does, recovery included, so it takes the same data
//! directory lock and refuses to run beside a live agent.

use std::io::Write as _;
use std::path::Path;
use std::sync::Arc;

use anyhow::Context as _;
use edge_agent::log::{GapReason, Log, LogHandle};
use edge_agent::storage::RealStorage;
use sync::block::{DecodeLimits, decode_block};
use sync::parse::write_ndjson_line;

use super::lock::DataDirLock;

/// Bytes of blocks fetched per read.
const READ_BYTES_MAX: usize = 4 << 20;

pub fn inspect(config_path: &Path, stream: &str, from_seq: Option<u64>) -> anyhow::Result<()> {
    let cfg = super::load_config(config_path)?;
    if cfg.stream(stream).is_none() {
        let names: Vec<&str> = cfg.streams.iter().map(|s| s.name.as_str()).collect();
        anyhow::bail!(
            "unknown stream {stream:?}: the config declares {}",
            names.join(", ")
        );
    }
    let _lock = DataDirLock::acquire(&cfg.data_dir)?;
    let (log, _report) = Log::open(cfg.log_config(), Arc::new(RealStorage))
        .with_context(|| format!("opening the local log in {}", cfg.data_dir.display()))?;
    let result = print_stream(&log, stream, from_seq);
    log.shutdown();
    match result {
        Err(e) if is_broken_pipe(&e) => Ok(()),
        other => other,
    }
}

fn print_stream(log: &LogHandle, stream: &str, from_seq: Option<u64>) -> anyhow::Result<()> {
    for gap in log.gaps(stream) {
        let why = match gap.reason {
            GapReason::Dropped => "dropped by the disk budget",
            GapReason::Corrupt => "quarantined as corrupt",
            GapReason::Refused => "refused by the hub for good, quarantined",
        };
        eprintln!(
            "gap: epoch {:016x} seqs {}..={} ({} records) {why}",
            gap.epoch, gap.first_seq, gap.last_seq, gap.records
        );
    }
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    let epochs: Vec<(u64, u64)> = match from_seq {
        Some(seq) => vec![(log.epoch(), seq)],
        None => log
            .epochs_held(stream)
            .into_iter()
            .map(|(epoch, first, _)| (epoch, first))
            .collect(),
    };
    for (epoch, first) in epochs {
        print_epoch(log, stream, epoch, first, &mut out)?;
    }
    out.flush()?;
    Ok(())
}

/// Prints the records of one epoch with seq >= `from`.
fn print_epoch(
    log: &LogHandle,
    stream: &str,
    epoch: u64,
    from: u64,
    out: &mut impl std::io::Write,
) -> anyhow::Result<()> {
    let mut after = from.saturating_sub(1);
    let mut line = String::new();
    loop {
        let blocks = log.read_blocks(stream, epoch, after, READ_BYTES_MAX)?;
        let Some(last) = blocks.last() else {
            return Ok(());
        };
        after = last.header.last_seq();
        for stored in blocks {
            let block =
                decode_block(&stored.bytes, &DecodeLimits::default()).with_context(|| {
                    format!("decoding the block at seq {}", stored.header.first_seq)
                })?;
            for (i, record) in block.records.iter().enumerate() {
                let seq = block.header.first_seq + i as u64;
                if seq < from {
                    continue;
                }
                line.clear();
                line.push_str(&format!("{{\"epoch\":\"{epoch:016x}\",\"seq\":{seq},"));
                let start = line.len();
                write_ndjson_line(record, &mut line)?;
                // The writer opens the object with '{'; our epoch and seq already did.
                line.remove(start);
                line.push('\n');
                out.write_all(line.as_bytes())?;
            }
        }
    }
}

fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.downcast_ref::<std::io::Error>()
        .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe)
}
