//! The rule that tells a region of a segment that was never durable from corruption of data
//! that was durable, when recovery meets bytes that do not frame.
//!
//! A crash may leave any mixture of data, zeros and garbage in the unsynced tail of the last
//! fsync group, including a hole followed by valid frames of that same group (a later write
//! persisted, an earlier one did not). Only a sync mark can prove that a hole was durable: the
//! writer puts one before the first frame it appends after an fsync, holding the length that
//! fsync made durable. The rule (`docs/format/segment.md`, "Telling a torn write from
//! corruption"):
//!
//! 1. In a sealed segment (one with a later segment of its epoch) every byte was fsynced before
//!    the next segment was created: any damage is corruption.
//! 2. In the tail segment, damage at offset `at` is corruption if a valid sync mark after `at`
//!    says the file was durable beyond `at` when that mark was written.
//! 3. Otherwise, in a version 2 tail, the damage and everything after it lie in the unsynced
//!    group: never durable, never acknowledged, truncated without a gap marker.
//! 4. A version 1 tail has no marks; a hole followed by a valid frame is taken for corruption,
//!    as version 1 readers did, and quarantined rather than deleted.

use super::switches;
use sync::segment::{
    FRAME_HEADER_LEN, SEGMENT_VERSION_V1, SYNC_MARK_LEN, SYNC_MARK_MAGIC, check_frame,
    decode_sync_mark,
};

/// What recovery knows about one place where frames stop making sense.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct HoleFacts {
    /// File offset of the first byte that does not frame.
    pub at: u64,
    /// The segment has a later segment of its epoch, so it was fsynced whole.
    pub sealed: bool,
    /// The segment header's version.
    pub version: u32,
    /// A valid block frame follows the damage.
    pub valid_after: bool,
    /// The largest `synced_len` of a valid sync mark after `at` (0 if none).
    pub durable_to: u64,
}

/// What the damage is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Part of the unsynced tail: truncate it and everything after it.
    NeverDurable,
    /// Damage to durable data: quarantine it and report a `Corrupt` gap.
    Corrupt,
}

/// Applies the rule in the module docs.
pub(crate) fn judge(f: &HoleFacts) -> Verdict {
    if !switches::hole_rule() {
        // The rule before sync marks: any valid frame after the damage meant corruption.
        return if f.sealed || f.valid_after {
            Verdict::Corrupt
        } else {
            Verdict::NeverDurable
        };
    }
    if f.sealed || f.durable_to > f.at || (f.version == SEGMENT_VERSION_V1 && f.valid_after) {
        Verdict::Corrupt
    } else {
        Verdict::NeverDurable
    }
}

/// The largest `synced_len` carried by a valid sync mark that starts after `at`. A mark can
/// only speak of bytes before itself, so one claiming more is ignored.
pub(crate) fn durable_to_after(bytes: &[u8], at: usize) -> u64 {
    let mut best = 0;
    let mut pos = at.saturating_add(1);
    while pos.saturating_add(FRAME_HEADER_LEN + SYNC_MARK_LEN) <= bytes.len() {
        let m = pos + FRAME_HEADER_LEN;
        if bytes[m..m + SYNC_MARK_MAGIC.len()] == SYNC_MARK_MAGIC
            && check_frame(bytes, pos) == Ok(SYNC_MARK_LEN as u32)
            && let Some(d) = decode_sync_mark(&bytes[m..m + SYNC_MARK_LEN])
            && d <= pos as u64
        {
            best = best.max(d);
        }
        pos += 1;
    }
    best
}

/// The first offset after `at` where a valid frame starts: a block (as
/// [`sync::segment::resync`] finds them) or, in a version 2 segment, a sync mark.
pub(crate) fn next_frame(bytes: &[u8], at: usize, marks: bool) -> Option<usize> {
    let block = sync::segment::resync(bytes, at);
    if !marks {
        return block;
    }
    let end = block.unwrap_or(bytes.len());
    let mut pos = at.saturating_add(1);
    while pos < end && pos.saturating_add(FRAME_HEADER_LEN + SYNC_MARK_LEN) <= bytes.len() {
        let m = pos + FRAME_HEADER_LEN;
        if bytes[m..m + SYNC_MARK_MAGIC.len()] == SYNC_MARK_MAGIC
            && check_frame(bytes, pos) == Ok(SYNC_MARK_LEN as u32)
        {
            return Some(pos);
        }
        pos += 1;
    }
    block
}

#[cfg(test)]
mod tests {
    use super::*;
    use Verdict::{Corrupt, NeverDurable};
    use sync::segment::{SEGMENT_VERSION, encode_frame, encode_sync_mark, segment_header};

    /// The decision table: a hole at offset 100 of a segment.
    #[test]
    fn durable_hole_versus_never_durable_hole() {
        let v2 = SEGMENT_VERSION;
        let v1 = SEGMENT_VERSION_V1;
        #[rustfmt::skip]
        let table = [
            // sealed, version, valid after, durable_to, verdict,      why
            (false, v2, false, 0,   NeverDurable, "torn tail, no mark after it"),
            (false, v2, true,  0,   NeverDurable, "hole then frames of the same unsynced group"),
            (false, v2, true,  100, NeverDurable, "a mark saying durable up to the hole, not past it"),
            (false, v2, true,  101, Corrupt,      "a later group's mark proves the hole was fsynced"),
            (false, v2, false, 400, Corrupt,      "damaged end that a later (torn) group's mark covers"),
            (true,  v2, false, 0,   Corrupt,      "a sealed segment was fsynced whole"),
            (true,  v2, true,  0,   Corrupt,      "sealed, with frames after the damage"),
            (false, v1, true,  0,   Corrupt,      "version 1 tail: no marks, quarantine as before"),
            (false, v1, false, 0,   NeverDurable, "version 1 torn tail"),
        ];
        for (sealed, version, valid_after, durable_to, want, why) in table {
            let f = HoleFacts {
                at: 100,
                sealed,
                version,
                valid_after,
                durable_to,
            };
            assert_eq!(judge(&f), want, "{why}: {f:?}");
        }
    }

    #[test]
    fn marks_after_the_hole_bound_what_was_durable() {
        let mut seg = segment_header().to_vec();
        seg.extend(encode_frame(b"TRBK block one"));
        let hole = seg.len();
        seg.extend([0u8; 30]);
        let m1 = seg.len();
        seg.extend(encode_sync_mark(hole as u64));
        let m2 = seg.len();
        seg.extend(encode_sync_mark(m1 as u64 + 5));
        // A mark claiming bytes after itself cannot be true.
        seg.extend(encode_sync_mark(u64::MAX));
        assert_eq!(durable_to_after(&seg, hole), m1 as u64 + 5);
        assert_eq!(
            durable_to_after(&seg, m2),
            0,
            "only marks after the offset count"
        );
        assert_eq!(durable_to_after(&seg[..m2 + 3], hole), hole as u64);
    }
}
