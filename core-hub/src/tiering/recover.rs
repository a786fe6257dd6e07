//! `core-hub recover --from-tier2`: rebuilds the hub's catalog from tier 2 alone after its
//! data directory was lost.
//!
//! Rebuilt from the manifests (and from chunk files that lack one):
//! - streams and their next offset (the end of the last chunk), so offsets stay dense;
//! - the chunk rows (all committed) and the field registry, so read-through and later uploads
//!   carry on with the same columns;
//! - per `(device, epoch, stream)` the durable mark and `tiered_seq`: the highest seq tier 2
//!   holds. Agents reconnect, see that mark, and re-ship everything above it (their retention
//!   keeps every record above the `tiered_seq` they were told, which is never more than tier 2
//!   holds), so nothing is lost and nothing is stored twice.
//!
//! A chunk object without a manifest is one whose upload completed but whose commit did not
//! (a crash between the two). SQL engines already see it, so it is adopted (its manifest is
//! written now) rather than re-shipped under new offsets, which would duplicate it. What the
//! old catalog alone knew is gone: tier-1 data that never reached tier 2 (the agents re-ship
//! it), fences and gaps.
//!
//! # Range checksums
//!
//! The hub detects a device re-shipping *different* content for seqs it already holds by the
//! content checksum of every committed block range (`blocks.checksum`, see `ingest.rs`). The
//! first manifest of every plan range carries those ranges as the hub stored them
//! (`extra.block_ranges`, written at upload by `store::block_ranges_json`); recovery restores
//! them as block index rows that point to no WAL file ([`RECOVERED_WAL_FILE`]), exactly like
//! the rows eviction leaves behind. A re-ship after recovery is therefore compared exactly as
//! before the loss: identical content is a duplicate, different content is a conflict and
//! fences the device. (The checksums are not recomputed from the Parquet rows: the checksum
//! covers each record's fields in the producer's order, which Parquet does not keep.) Ranges
//! of chunks uploaded before manifests carried them, and of adopted chunk files, cannot be
//! restored; resent records there are treated as duplicates without comparison
//! ([`RecoverReport::unverified_chunks`]).
//!
//! # Object checks
//!
//! Each manifest also carries its object's crc32c (`extra.crc32c`); recovery restores the
//! check so that read-through and the tier-2 scrub keep detecting damage. A manifest whose
//! object is gone from `streams/` is recovered as a quarantined chunk (reported, skipped by
//! readers) rather than failing the whole rebuild.
//!
//! # Sync points
//!
//! The data directory is created with each new directory synced into its parent; adopted
//! manifests are durable when their put returns (`tier::Tier2`); the catalog commits with
//! `synchronous=FULL`, and the data directory is synced at the end so that the new catalog
//! file's entry is durable. A crash before the end leaves a partial catalog: move it away and
//! run recovery again (tier 2 is only read, apart from adopted manifests, which are
//! idempotent).

use super::store::{self, COMMITTED, ChunkRow, ObjectCheck, RangeCommit, TierState};
use crate::catalog::{BlockRow, Catalog, CatalogError, GroupCommit, StreamId};
use crate::config::HubConfig;
use std::collections::{BTreeMap, BTreeSet};
use thiserror::Error;
use tier::{ChunkSummary, Manifest, SeqRange, TierRecord};

/// Why recovery failed.
#[derive(Debug, Error)]
pub enum RecoverError {
    #[error("{0} already holds a catalog; move the data directory away first")]
    NotEmpty(std::path::PathBuf),
    #[error(transparent)]
    Open(#[from] super::TierOpenError),
    #[error(transparent)]
    Catalog(#[from] CatalogError),
    #[error("tier 2: {0}")]
    Tier2(#[from] tier::TierError),
    #[error("cannot create {path}: {source}")]
    DataDir {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("cannot sync directory {path}: {source}")]
    Sync {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("stream `{stream}`: tier 2 is not contiguous: {what}")]
    Hole { stream: String, what: String },
    #[error("manifest {path}: {what}")]
    Manifest { path: String, what: String },
}

/// What recovery rebuilt.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecoverReport {
    pub streams: u64,
    pub chunks: u64,
    pub records: u64,
    pub lanes: u64,
    /// Chunk files that had no manifest and were adopted.
    pub adopted: u64,
    /// Segments of the rebuilt segment graphs (merged streams).
    pub segments: u64,
    /// Block ranges whose content checksums were restored (dedupe and conflict detection).
    pub ranges: u64,
    /// Chunks whose manifest carries no block ranges (uploaded before they were recorded, or
    /// adopted): re-shipped records there cannot be compared.
    pub unverified_chunks: u64,
    /// Chunks whose object is missing: recovered quarantined.
    pub missing_objects: u64,
}

/// The WAL file of restored block index rows: none. No WAL file ever has this first offset,
/// so readers, eviction and the scrubber never look for their frames; they only carry the
/// dedupe checksums (like the rows of evicted WAL files).
pub const RECOVERED_WAL_FILE: u64 = u64::MAX;

/// Block index rows from a manifest's `extra.block_ranges` (see `store::block_ranges_json`).
/// `None` when the manifest carries none (or an unknown version).
fn block_rows(
    cat: &Catalog,
    stream: StreamId,
    m: &Manifest,
) -> Result<Option<Vec<BlockRow>>, RecoverError> {
    let Some(br) = m.extra.get("block_ranges") else {
        return Ok(None);
    };
    if br.get("v").and_then(serde_json::Value::as_u64) != Some(store::BLOCK_RANGES_VERSION) {
        return Ok(None);
    }
    let bad = |what: &str| RecoverError::Manifest {
        path: m.path(),
        what: format!("block_ranges: {what}"),
    };
    let lanes = br
        .get("lanes")
        .and_then(serde_json::Value::as_array)
        .ok_or_else(|| bad("no lanes"))?;
    let mut out = Vec::new();
    for lane in lanes {
        let device = lane
            .get("device")
            .and_then(serde_json::Value::as_str)
            .ok_or_else(|| bad("lane without device"))?;
        let epoch = lane
            .get("epoch")
            .and_then(serde_json::Value::as_u64)
            .ok_or_else(|| bad("lane without epoch"))?;
        let d = cat.intern_device(device)?;
        let blocks = lane
            .get("blocks")
            .and_then(serde_json::Value::as_str)
            .ok_or_else(|| bad("lane without blocks"))?;
        for b in blocks.split(';').filter(|b| !b.is_empty()) {
            let v: Vec<&str> = b.split(',').collect();
            if v.len() != 7 {
                return Err(bad("block entry"));
            }
            let n = |k: usize| v[k].parse::<u64>().map_err(|_| bad("block field"));
            let t = |k: usize| v[k].parse::<i64>().map_err(|_| bad("block time"));
            let (first_seq, last_seq) = (n(0)?, n(1)?);
            if last_seq < first_seq {
                return Err(bad("block with last_seq < first_seq"));
            }
            out.push(BlockRow {
                device: d,
                epoch,
                stream,
                first_seq,
                last_seq,
                checksum: n(2)?,
                hub_offset_base: n(3)?,
                wal_file: RECOVERED_WAL_FILE,
                wal_pos: 0,
                frame_len: 0,
                ingest_ts: t(4)?,
                min_ts: t(5)?,
                max_ts: t(6)?,
                key_hash_min: None,
                key_hash_max: None,
            });
        }
    }
    Ok(Some(out))
}

/// The segment graph of a stream whose tier-2 records end at `end`, from its manifests: the
/// latest graph a manifest carries (`extra.segments`, written with the first manifest of
/// every range), else the per-chunk fields (`segment`, `hash_lo`/`hash_hi`, `segment_start`,
/// `preds`). Segments created at or past `end` are dropped, their predecessors reopened.
/// `None` when no consistent graph (open segments partitioning the hash space) results.
fn rebuild_graph(manifests: &[Manifest], end: u64) -> Option<Vec<crate::streams::Segment>> {
    use crate::streams::Segment;
    use crate::streams::graph::{from_json, truncate_at};
    let carried = manifests
        .iter()
        .filter_map(|m| m.extra.get("segments").and_then(from_json))
        .max_by_key(Vec::len);
    let segments = match carried {
        Some(g) => g,
        None => {
            // One entry per segment id, which must be dense from 0.
            let mut by_id: BTreeMap<u64, &Manifest> = BTreeMap::new();
            for m in manifests {
                by_id.entry(m.segment).or_insert(m);
            }
            let mut segs: Vec<Segment> = Vec::new();
            for (i, (&id, m)) in by_id.iter().enumerate() {
                let sid = crate::streams::SegmentId::try_from(id).ok()?;
                if id != i as u64 || (id > 0 && m.preds.is_empty()) {
                    return None;
                }
                let preds = m
                    .preds
                    .iter()
                    .map(|&p| {
                        crate::streams::SegmentId::try_from(p)
                            .ok()
                            .filter(|&p| p < sid)
                    })
                    .collect::<Option<Vec<_>>>()?;
                segs.push(Segment {
                    id: sid,
                    lo: u64::try_from(m.hash_lo).ok()?,
                    hi: u64::try_from(m.hash_hi).ok()?,
                    start: if id == 0 { 0 } else { m.segment_start },
                    end: None,
                    preds,
                    succs: Vec::new(),
                    created_ns: m.committed_ns,
                    sealed_ns: None,
                });
            }
            for i in 0..segs.len() {
                for p in segs[i].preds.clone() {
                    let (id, start, at) = (segs[i].id, segs[i].start, segs[i].created_ns);
                    let pred = &mut segs[p as usize];
                    pred.succs.push(id);
                    pred.end = Some(start);
                    pred.sealed_ns = Some(at);
                }
            }
            segs
        }
    };
    let segments = truncate_at(segments, end);
    // The open segments must partition the hash space, as the stream manager assumes.
    let mut open: Vec<(u64, u64)> = segments
        .iter()
        .filter(|s| s.end.is_none())
        .map(|s| (s.lo, s.hi))
        .collect();
    open.sort_unstable();
    let mut at = 0;
    for (lo, hi) in open {
        if lo != at || hi <= lo {
            return None;
        }
        at = hi;
    }
    (at == crate::streams::hash::HASH_SPACE).then_some(segments)
}

/// Parses `seg-{segment:08}-{first_offset:020}.parquet` at the end of a chunk path.
fn parse_chunk_name(path: &str) -> Option<(u64, u64)> {
    let name = path.rsplit('/').next()?;
    let rest = name.strip_prefix("seg-")?.strip_suffix(".parquet")?;
    let (seg, first) = rest.split_once('-')?;
    Some((seg.parse().ok()?, first.parse().ok()?))
}

/// The summary of decoded records (for adopted chunk files).
fn summarize(records: &[TierRecord], bytes: u64) -> ChunkSummary {
    let mut lanes: BTreeMap<(String, u64), SeqRange> = BTreeMap::new();
    for r in records {
        let e = lanes
            .entry((r.device.clone(), r.epoch))
            .or_insert_with(|| SeqRange {
                device: r.device.clone(),
                epoch: r.epoch,
                min_seq: r.seq,
                max_seq: r.seq,
                count: 0,
            });
        e.min_seq = e.min_seq.min(r.seq);
        e.max_seq = e.max_seq.max(r.seq);
        e.count += 1;
    }
    let min_max = |f: &dyn Fn(&TierRecord) -> i64| {
        let it = records.iter().map(f);
        (it.clone().min().unwrap_or(0), it.max().unwrap_or(0))
    };
    let (min_ts, max_ts) = min_max(&|r| r.ts_ns);
    let (min_in, max_in) = min_max(&|r| r.ingest_ts_ns);
    ChunkSummary {
        rows: records.len() as u64,
        bytes,
        min_offset: records.iter().map(|r| r.offset).min().unwrap_or(0),
        max_offset: records.iter().map(|r| r.offset).max().unwrap_or(0),
        min_ts_ns: min_ts,
        max_ts_ns: max_ts,
        min_ingest_ts_ns: min_in,
        max_ingest_ts_ns: max_in,
        seq_ranges: lanes.into_values().collect(),
    }
}

/// Rebuilds the catalog of `cfg.data_dir` from tier 2. The data directory must not hold a
/// catalog. `progress` is called with (chunks done, chunks total) per stream.
pub async fn from_tier2(
    cfg: &HubConfig,
    mut progress: impl FnMut(&str, u64, u64),
) -> Result<RecoverReport, RecoverError> {
    let cat_path = cfg.catalog_path();
    if cat_path.exists() {
        return Err(RecoverError::NotEmpty(cfg.data_dir.clone()));
    }
    create_dir_durably(&cfg.data_dir)?;
    let t2 = super::open_store(&cfg.tier2)?;
    let mut names: BTreeSet<String> = t2
        .list_streams()
        .await
        .map_err(tier::TierError::from)?
        .into_iter()
        .collect();
    // Streams whose only chunk files lack manifests (a crash before the first commit).
    for o in t2.list("streams/").await.map_err(tier::TierError::from)? {
        if let Some(name) = o
            .path
            .strip_prefix("streams/")
            .and_then(|r| r.split('/').next())
        {
            names.insert(name.to_string());
        }
    }
    let cat = Catalog::open(&cat_path)?;
    store::init(&cat)?;
    let mut report = RecoverReport::default();
    for name in names {
        let mut manifests = t2
            .list_manifests(&name)
            .await
            .map_err(tier::TierError::from)?;
        let known: BTreeSet<String> = manifests.iter().map(|m| m.path.clone()).collect();
        let objects = t2
            .list(&tier::chunks_prefix(&name))
            .await
            .map_err(tier::TierError::from)?;
        let present: BTreeSet<String> = objects.iter().map(|o| o.path.clone()).collect();
        for o in objects.iter().filter(|o| o.path.ends_with(".parquet")) {
            if known.contains(&o.path) {
                continue;
            }
            let Some((segment, first_offset)) = parse_chunk_name(&o.path) else {
                tracing::warn!(path = %o.path, "ignoring a file that is not a chunk name");
                continue;
            };
            let records = t2
                .read_chunk(&o.path)
                .await
                .map_err(tier::TierError::from)?;
            if records.is_empty() {
                continue;
            }
            // The file's columns: the stream's latest registry plus what its records carry.
            let latest = manifests
                .iter()
                .max_by_key(|m| m.columns.len())
                .map(|m| m.columns.clone())
                .unwrap_or_default();
            let mut registry =
                tier::FieldRegistry::from_columns(latest).map_err(tier::TierError::from)?;
            registry.observe_records(&records);
            let summary = summarize(&records, o.size);
            let m = Manifest {
                version: tier::layout::MANIFEST_VERSION,
                stream: name.clone(),
                segment,
                first_offset,
                end_offset: summary.max_offset + 1,
                path: o.path.clone(),
                summary,
                columns: registry.columns().to_vec(),
                hash_lo: 0,
                hash_hi: super::HASH_SPACE_END as i64,
                segment_start: 0,
                preds: Vec::new(),
                committed_ns: super::now_ns(),
                extra: serde_json::json!({ "adopted": true }),
            };
            t2.put_manifest(&m).await.map_err(tier::TierError::from)?;
            tracing::warn!(path = %o.path, "adopted a chunk file uploaded but never committed");
            report.adopted += 1;
            manifests.push(m);
        }
        manifests.sort_by_key(|m| (m.first_offset, m.segment));
        if manifests.is_empty() {
            continue;
        }
        let sid = cat.intern_stream(&name)?;
        let total = manifests.len() as u64;
        // Chunk ranges must be contiguous: each starts where the previous ones end.
        let start = manifests[0].first_offset;
        let mut end = start;
        let mut lanes: BTreeMap<(u32, u64), u64> = BTreeMap::new();
        let mut rows = Vec::new();
        let mut columns = Vec::new();
        for (i, m) in manifests.iter().enumerate() {
            if m.first_offset > end {
                return Err(RecoverError::Hole {
                    stream: name.clone(),
                    what: format!("offsets {end}..{} are in no chunk", m.first_offset),
                });
            }
            end = end.max(m.end_offset);
            for r in &m.summary.seq_ranges {
                let d = cat.intern_device(&r.device)?;
                let e = lanes.entry((d, r.epoch)).or_insert(0);
                *e = (*e).max(r.max_seq);
            }
            if m.columns.len() >= columns.len() {
                columns = m.columns.clone();
            }
            let range_first = m
                .extra
                .get("range_first")
                .and_then(serde_json::Value::as_u64)
                .unwrap_or(m.first_offset);
            rows.push(ChunkRow {
                stream: sid,
                segment: m.segment,
                first_offset: m.first_offset,
                end_offset: m.end_offset,
                range_first,
                state: COMMITTED,
                path: m.path.clone(),
                rows: m.summary.rows,
                bytes: m.summary.bytes,
                ingest_ts_min: m.summary.min_ingest_ts_ns,
                ingest_ts_max: m.summary.max_ingest_ts_ns,
            });
            report.records += m.summary.rows;
            progress(&name, i as u64 + 1, total);
        }
        store::insert_plan(&cat, sid, &rows, end)?;
        match rebuild_graph(&manifests, end) {
            Some(segments) => {
                crate::streams::graph::init_schema(&cat)?;
                crate::streams::graph::store_all(&cat, sid, &segments)?;
                report.segments += segments.len() as u64;
            }
            None => tracing::warn!(
                stream = %name,
                "the manifests hold no consistent segment graph; the stream restarts with one segment"
            ),
        }
        let marks: Vec<_> = lanes.iter().map(|(&(d, e), &s)| (d, e, sid, s)).collect();
        cat.commit_group(&GroupCommit {
            marks,
            stream_offsets: vec![(sid, end)],
            ..GroupCommit::default()
        })?;
        for (&(d, e), &s) in &lanes {
            cat.set_tiered_seq(d, e, sid, s)?;
        }
        store::commit_range(
            &cat,
            &RangeCommit {
                stream: sid,
                tiered_end: end,
                fields: columns,
                ..RangeCommit::default()
            },
        )?;
        store::restore_state(
            &cat,
            sid,
            TierState {
                planned_end: end,
                tiered_end: end,
                evicted_end: end,
                tier2_start: start,
            },
        )?;
        // Dedupe checksums of the old ranges, object checks, missing objects.
        let mut blocks = Vec::new();
        let mut with_ranges: BTreeSet<u64> = BTreeSet::new();
        for m in &manifests {
            if let Some(rows) = block_rows(&cat, sid, m)? {
                let range_first = m
                    .extra
                    .get("range_first")
                    .and_then(serde_json::Value::as_u64)
                    .unwrap_or(m.first_offset);
                with_ranges.insert(range_first);
                blocks.extend(rows);
            }
            if let Some(crc) = m
                .extra
                .get("crc32c")
                .and_then(serde_json::Value::as_u64)
                .and_then(|c| u32::try_from(c).ok())
            {
                let check = ObjectCheck {
                    bytes: m.summary.bytes,
                    crc32c: crc,
                };
                store::set_object_check(&cat, sid, m.segment, m.first_offset, check)?;
            }
        }
        for chunk in blocks.chunks(10_000) {
            cat.commit_group(&GroupCommit {
                blocks: chunk.to_vec(),
                ..GroupCommit::default()
            })?;
        }
        report.ranges += blocks.len() as u64;
        report.unverified_chunks += rows
            .iter()
            .filter(|r| !with_ranges.contains(&r.range_first))
            .count() as u64;
        for r in rows.iter().filter(|r| !present.contains(&r.path)) {
            tracing::error!(path = %r.path, "tier-2 chunk object missing: recovered quarantined");
            store::quarantine_chunk(&cat, r, "object missing at recovery", super::now_ns())?;
            report.missing_objects += 1;
        }
        report.streams += 1;
        report.chunks += total;
        report.lanes += lanes.len() as u64;
    }
    // SQLite syncs its commits (`synchronous=FULL`) but not the directory entry of a database
    // file it created: the new catalog is durable only once its directory is synced.
    sync_dir(&cfg.data_dir)?;
    Ok(report)
}

/// Creates `dir` and its missing ancestors, fsyncing the parent of each new one.
fn create_dir_durably(dir: &std::path::Path) -> Result<(), RecoverError> {
    let mut made = Vec::new();
    let mut d = Some(dir);
    while let Some(p) = d.filter(|p| !p.as_os_str().is_empty() && !p.exists()) {
        made.push(p.to_path_buf());
        d = p.parent();
    }
    std::fs::create_dir_all(dir).map_err(|source| RecoverError::DataDir {
        path: dir.to_path_buf(),
        source,
    })?;
    for new in &made {
        match new.parent() {
            Some(p) if !p.as_os_str().is_empty() => sync_dir(p)?,
            _ => sync_dir(std::path::Path::new("."))?,
        }
    }
    Ok(())
}

fn sync_dir(dir: &std::path::Path) -> Result<(), RecoverError> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|source| RecoverError::Sync {
            path: dir.to_path_buf(),
            source,
        })
}
