//! The batch-completeness rule: which blocks of an epoch belong to a batch that is not whole.
//!
//! A producer batch too big for one block is split into consecutive blocks; every block but the
//! last carries `FLAG_BATCH_CONTINUES` and every block but the first `FLAG_BATCH_CONTINUED`.
//! Recovery walks an epoch's blocks in seq order (across segments) and groups them into
//! batches: a block with `FLAG_BATCH_CONTINUES` and the seq-contiguous block after it belong to
//! the same batch. A batch is incomplete when its head is missing (its first block carries
//! `FLAG_BATCH_CONTINUED`) or its tail is missing (its last block carries
//! `FLAG_BATCH_CONTINUES`), unless the missing part is accounted for by something that only
//! ever removes durable, acknowledged data: a `Dropped` gap marker (the disk budget), the hub's
//! tiered acknowledgement (retention), or a move into a newer epoch. Blocks written before
//! `FLAG_BATCH_CONTINUED` existed never carry it, so for them only a missing tail is detected.

use super::index::BlockRef;
use std::ops::Range;
use sync::block::{FLAG_BATCH_CONTINUED, FLAG_BATCH_CONTINUES};

/// The blocks (indices into the epoch's block list) of one incomplete batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Fragment {
    pub blocks: Range<usize>,
    /// The batch's head is present and it is the last thing in the epoch, with no gap marker
    /// after it: a batch whose end never reached the disk. It was never acknowledged, so it is
    /// truncated and its seqs are assigned again. Any other fragment is quarantined.
    pub torn_end: bool,
}

/// Finds the incomplete batches in `blocks` (one epoch, in seq order). `explained(seq)` says
/// the seq is missing for a reason that only removes acknowledged data; `gap(seq)` says a gap
/// marker covers it.
pub(crate) fn fragments(
    blocks: &[BlockRef],
    explained: impl Fn(u64) -> bool,
    gap: impl Fn(u64) -> bool,
) -> Vec<Fragment> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < blocks.len() {
        let mut j = i;
        while blocks[j].flags & FLAG_BATCH_CONTINUES != 0
            && j + 1 < blocks.len()
            && blocks[j + 1].first_seq == blocks[j].last_seq() + 1
        {
            j += 1;
        }
        let (head, tail) = (&blocks[i], &blocks[j]);
        let head_missing =
            head.flags & FLAG_BATCH_CONTINUED != 0 && !explained(head.first_seq.saturating_sub(1));
        let tail_missing =
            tail.flags & FLAG_BATCH_CONTINUES != 0 && !explained(tail.last_seq() + 1);
        if head_missing || tail_missing {
            let torn_end = !head_missing && j + 1 == blocks.len() && !gap(tail.last_seq() + 1);
            out.push(Fragment {
                blocks: i..j + 1,
                torn_end,
            });
        }
        i = j + 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const C: u8 = FLAG_BATCH_CONTINUES;
    const D: u8 = FLAG_BATCH_CONTINUED;

    fn blocks(spec: &[(u64, u8)]) -> Vec<BlockRef> {
        spec.iter()
            .map(|&(first_seq, flags)| BlockRef {
                offset: 0,
                len: 1,
                first_seq,
                count: 10,
                min_ts: 0,
                flags,
            })
            .collect()
    }

    fn frags(spec: &[(u64, u8)], explained_below: u64) -> Vec<(Range<usize>, bool)> {
        let b = blocks(spec);
        fragments(&b, |s| s < explained_below, |s| s == 51)
            .into_iter()
            .map(|f| (f.blocks, f.torn_end))
            .collect()
    }

    #[test]
    fn whole_batches_are_kept_and_fragments_found_anywhere() {
        // Whole: a single block, and a three-block batch.
        assert_eq!(frags(&[(1, 0), (11, C), (21, C | D), (31, D)], 0), vec![]);
        // Tail missing at the end: a torn end.
        assert_eq!(
            frags(&[(1, 0), (11, C), (21, C | D)], 0),
            vec![(1..3, true)]
        );
        // Tail missing before a hole in the seqs (a quarantined region): not a torn end.
        assert_eq!(
            frags(&[(1, C), (41, D), (51, 0)], 0),
            vec![(0..1, false), (1..2, false)]
        );
        // Head missing after a hole, then a whole batch.
        assert_eq!(
            frags(&[(1, 0), (31, C | D), (41, D), (51, 0)], 0),
            vec![(1..3, false)]
        );
        // Tail missing at the end, but a gap marker follows it.
        assert_eq!(frags(&[(31, C), (41, C | D)], 0), vec![(0..2, false)]);
        // Head removed by the budget or retention: explained, kept.
        assert_eq!(frags(&[(21, D), (31, 0)], 21), vec![]);
        // Old blocks never carry FLAG_BATCH_CONTINUED: only a missing tail is seen.
        assert_eq!(frags(&[(21, 0), (31, C)], 0), vec![(1..2, true)]);
    }
}
