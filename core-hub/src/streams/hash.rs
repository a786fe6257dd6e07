//! The routing key hash and the per-block hash summary ingest computes.
//!
//! A record's hash point is `xxh3_64(key) >> 32`, a `u32` in `[0, 2^32)`; segments own
//! half-open ranges of points (`hi` may be `2^32`, so ranges are `u64`). The function is fixed
//! forever: segments persisted by one build must route the same keys in the next.
//!
//! Ingest already decodes every block, so it also summarises the block's points as a sparse
//! 256-bucket histogram (bucket = point >> 24) with the min and max point. The stream manager
//! uses it to measure each segment's rate without decoding anything again.

use xxhash_rust::xxh3::xxh3_64;

/// The size of the hash space: every segment range lies within `[0, HASH_SPACE)`.
pub const HASH_SPACE: u64 = 1 << 32;
/// Number of histogram buckets; bucket `b` covers points `[b << 24, (b + 1) << 24)`.
pub const BUCKETS: usize = 256;
/// Hash points per bucket.
pub const BUCKET_WIDTH: u64 = HASH_SPACE / BUCKETS as u64;

/// The hash point of a routing key.
#[inline]
pub fn key_point(key: &str) -> u32 {
    (xxh3_64(key.as_bytes()) >> 32) as u32
}

/// The hash summary of one block's records.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockHashes {
    /// Smallest and largest hash point in the block (`0, 0` for an empty block).
    pub min: u32,
    pub max: u32,
    /// `(bucket, records)` for every non-empty bucket, by bucket.
    pub buckets: Vec<(u8, u32)>,
}

impl BlockHashes {
    /// Summarises the hash points of `keys`.
    pub fn of_keys<'a>(keys: impl IntoIterator<Item = &'a str>) -> BlockHashes {
        let mut counts = [0u32; BUCKETS];
        let (mut min, mut max) = (u32::MAX, 0u32);
        let mut any = false;
        for key in keys {
            let p = key_point(key);
            counts[(p >> 24) as usize] += 1;
            min = min.min(p);
            max = max.max(p);
            any = true;
        }
        if !any {
            return BlockHashes::default();
        }
        let buckets = counts
            .iter()
            .enumerate()
            .filter(|&(_, &n)| n > 0)
            .map(|(b, &n)| (b as u8, n))
            .collect();
        BlockHashes { min, max, buckets }
    }

    /// Records in the block.
    pub fn records(&self) -> u64 {
        self.buckets.iter().map(|&(_, n)| u64::from(n)).sum()
    }

    /// Estimated records with points in `[lo, hi)`: exact for whole buckets, proportional for
    /// a bucket the range cuts.
    pub fn estimate_in(&self, lo: u64, hi: u64) -> f64 {
        if hi <= u64::from(self.min) || lo > u64::from(self.max) {
            return 0.0;
        }
        let mut total = 0.0;
        for &(b, n) in &self.buckets {
            let b_lo = u64::from(b) * BUCKET_WIDTH;
            let b_hi = b_lo + BUCKET_WIDTH;
            let overlap = hi.min(b_hi).saturating_sub(lo.max(b_lo));
            if overlap > 0 {
                total += f64::from(n) * overlap as f64 / BUCKET_WIDTH as f64;
            }
        }
        total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_is_stable() {
        // Persisted segment ranges depend on these exact values.
        assert_eq!(key_point(""), (xxh3_64(b"") >> 32) as u32);
        assert_eq!(key_point("truck-1/engine"), key_point("truck-1/engine"));
        assert_ne!(key_point("a"), key_point("b"));
    }

    #[test]
    fn summary_counts_and_estimates() {
        let keys: Vec<String> = (0..1000).map(|i| format!("k{i}")).collect();
        let h = BlockHashes::of_keys(keys.iter().map(String::as_str));
        assert_eq!(h.records(), 1000);
        assert!((h.estimate_in(0, HASH_SPACE) - 1000.0).abs() < 1e-6);
        let below = keys
            .iter()
            .filter(|k| u64::from(key_point(k)) < HASH_SPACE / 2)
            .count() as f64;
        assert!((h.estimate_in(0, HASH_SPACE / 2) - below).abs() < 1e-6);
        assert_eq!(BlockHashes::of_keys([]).records(), 0);
    }
}
