//! Auto-scaling decisions: per-segment rates against a stream's [`ScalePolicy`].
//!
//! Committed blocks are attributed to the open segments through their hash histograms
//! ([`BlockHashes::estimate_in`]). Every tick (a tenth of the window) the counts become one
//! sample; a segment's load is its rate over the last half window, as a fraction of the
//! target (records/s or bytes/s, whichever is higher). A segment whose load stays above 1 for
//! the whole window splits in two; two hash-adjacent segments whose loads both stay below a
//! quarter for the window merge (so the merged one starts below half the target and does not
//! split straight back). The window must be sustained, not reached once, so bursts and the
//! group-commit rhythm do not flap segments.

use super::graph::{Graph, NewSegment, ScaleEvent, SegmentId};
use super::hash::{BUCKET_WIDTH, BUCKETS, BlockHashes};
use crate::config::ScalePolicy;
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// Load (fraction of the target) below which a segment counts as cold.
const COLD_LOAD: f64 = 0.25;

/// The measured state of one open segment.
#[derive(Debug)]
struct SegLoad {
    /// Counts since the last tick.
    records: f64,
    bytes: f64,
    /// Per-tick samples `(records, bytes, seconds)`, newest last.
    samples: VecDeque<(f64, f64, f64)>,
    /// Records per hash bucket during the current hot streak (to pick a balanced split point).
    hist: Vec<f64>,
    hot_since: Option<Instant>,
    cold_since: Option<Instant>,
    load: f64,
}

impl SegLoad {
    fn new() -> SegLoad {
        SegLoad {
            records: 0.0,
            bytes: 0.0,
            samples: VecDeque::new(),
            hist: vec![0.0; BUCKETS],
            hot_since: None,
            cold_since: None,
            load: 0.0,
        }
    }
}

/// A segment's measured rates, for the API and the status page.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct SegmentRate {
    pub segment: SegmentId,
    pub records_per_s: f64,
    pub bytes_per_s: f64,
    /// Load relative to the policy's target (1.0 = at target); 0 without a policy.
    pub load: f64,
}

/// The scaler of one stream.
#[derive(Debug)]
pub struct Scaler {
    policy: Option<ScalePolicy>,
    segs: HashMap<SegmentId, SegLoad>,
    last_tick: Instant,
    tick: Duration,
    /// Samples that make up the rate (half a window).
    samples_max: usize,
}

/// Tick interval for a policy: a tenth of the window, within [5 ms, 1 s].
pub fn tick_for(policy: Option<&ScalePolicy>) -> Duration {
    policy.map_or(Duration::from_secs(1), |p| {
        (p.window / 10).clamp(Duration::from_millis(5), Duration::from_secs(1))
    })
}

impl Scaler {
    /// A scaler for a stream whose open segments are those of `graph`.
    pub fn new(policy: Option<ScalePolicy>, graph: &Graph, now: Instant) -> Scaler {
        let tick = tick_for(policy.as_ref());
        let samples_max = policy.map_or(5, |p| {
            ((p.window.as_secs_f64() / 2.0 / tick.as_secs_f64()).round() as usize).max(1)
        });
        Scaler {
            policy,
            segs: graph.open().map(|s| (s.id, SegLoad::new())).collect(),
            last_tick: now,
            tick,
            samples_max,
        }
    }

    /// The policy in force.
    pub fn policy(&self) -> Option<&ScalePolicy> {
        self.policy.as_ref()
    }

    /// Attributes a committed block of `bytes` to the open segments of `graph`.
    pub fn on_block(&mut self, graph: &Graph, hashes: &BlockHashes, bytes: u64) {
        let total = hashes.records() as f64;
        if total == 0.0 {
            return;
        }
        let track_hist = self.policy.is_some();
        for seg in graph.open() {
            let n = hashes.estimate_in(seg.lo, seg.hi);
            if n == 0.0 {
                continue;
            }
            let load = self.segs.entry(seg.id).or_insert_with(SegLoad::new);
            load.records += n;
            load.bytes += bytes as f64 * n / total;
            if track_hist {
                for &(b, c) in &hashes.buckets {
                    let b_lo = u64::from(b) * BUCKET_WIDTH;
                    if b_lo + BUCKET_WIDTH > seg.lo && b_lo < seg.hi {
                        load.hist[b as usize] += f64::from(c);
                    }
                }
            }
        }
    }

    /// Whether a tick is due.
    pub fn due(&self, now: Instant) -> bool {
        now.duration_since(self.last_tick) >= self.tick
    }

    /// Closes a sample, updates the streaks, and returns the scale event due, if any. The
    /// caller applies it at the stream's readable end.
    pub fn tick(&mut self, graph: &Graph, now: Instant) -> Option<ScaleEvent> {
        let secs = now.duration_since(self.last_tick).as_secs_f64();
        if secs <= 0.0 {
            return None;
        }
        self.last_tick = now;
        let open: Vec<_> = graph.open().map(|s| s.id).collect();
        self.segs.retain(|id, _| open.contains(id));
        for &id in &open {
            let samples_max = self.samples_max;
            let policy = self.policy;
            let l = self.segs.entry(id).or_insert_with(SegLoad::new);
            l.samples.push_back((l.records, l.bytes, secs));
            l.records = 0.0;
            l.bytes = 0.0;
            while l.samples.len() > samples_max {
                l.samples.pop_front();
            }
            let (r, b, t) = l
                .samples
                .iter()
                .fold((0.0, 0.0, 0.0), |a, s| (a.0 + s.0, a.1 + s.1, a.2 + s.2));
            let Some(p) = policy else { continue };
            let (rr, br) = (r / t, b / t);
            let load_r = p.target_records_per_s.map_or(0.0, |x| rr / x as f64);
            let load_b = p.target_bytes_per_s.map_or(0.0, |x| br / x as f64);
            l.load = load_r.max(load_b);
            // A streak only counts once the rate covers a full half window of samples.
            let full = l.samples.len() >= samples_max;
            if full && l.load > 1.0 {
                l.hot_since.get_or_insert(now);
            } else {
                l.hot_since = None;
                l.hist.iter_mut().for_each(|h| *h = 0.0);
            }
            if full && l.load < COLD_LOAD {
                l.cold_since.get_or_insert(now);
            } else {
                l.cold_since = None;
            }
        }
        self.decide(graph, now)
    }

    fn decide(&self, graph: &Graph, now: Instant) -> Option<ScaleEvent> {
        let p = self.policy?;
        // The streak started one half window after the rate began rising; count it from there.
        let sustained = |since: Option<Instant>| {
            since.is_some_and(|t| now.duration_since(t) + p.window / 2 >= p.window)
        };
        let open: Vec<_> = graph.open().collect();
        let mut count = open.len() as u32;
        let mut sealed = Vec::new();
        let mut created = Vec::new();
        // Splits, hottest first.
        let mut hot: Vec<_> = open
            .iter()
            .filter(|s| s.hi - s.lo >= 2)
            .filter_map(|s| self.segs.get(&s.id).map(|l| (s, l)))
            .filter(|(_, l)| sustained(l.hot_since))
            .collect();
        hot.sort_by(|a, b| b.1.load.total_cmp(&a.1.load));
        for (s, l) in hot {
            if count >= p.max_segments {
                break;
            }
            let mid = split_point(s.lo, s.hi, &l.hist);
            sealed.push(s.id);
            created.push(NewSegment {
                lo: s.lo,
                hi: mid,
                preds: vec![s.id],
            });
            created.push(NewSegment {
                lo: mid,
                hi: s.hi,
                preds: vec![s.id],
            });
            count += 1;
        }
        // Merges of cold neighbours not already splitting.
        let mut i = 0;
        while i + 1 < open.len() {
            let (a, b) = (open[i], open[i + 1]);
            let cold = |id| self.segs.get(&id).is_some_and(|l| sustained(l.cold_since));
            if count > p.min_segments
                && !sealed.contains(&a.id)
                && !sealed.contains(&b.id)
                && cold(a.id)
                && cold(b.id)
            {
                sealed.push(a.id);
                sealed.push(b.id);
                created.push(NewSegment {
                    lo: a.lo,
                    hi: b.hi,
                    preds: vec![a.id, b.id],
                });
                count -= 1;
                i += 2;
            } else {
                i += 1;
            }
        }
        if sealed.is_empty() {
            return None;
        }
        created.sort_by_key(|n| n.lo);
        Some(ScaleEvent {
            at: 0,
            sealed,
            created,
        })
    }

    /// Starts fresh measurements for segments a scale event created.
    pub fn on_created(&mut self, ids: &[SegmentId]) {
        for &id in ids {
            self.segs.insert(id, SegLoad::new());
        }
    }

    /// The current rates of the open segments.
    pub fn rates(&self, graph: &Graph) -> Vec<SegmentRate> {
        graph
            .open()
            .map(|s| {
                let (r, b, t) = self.segs.get(&s.id).map_or((0.0, 0.0, 0.0), |l| {
                    l.samples
                        .iter()
                        .fold((0.0, 0.0, 0.0), |a, x| (a.0 + x.0, a.1 + x.1, a.2 + x.2))
                });
                let per = |x: f64| if t > 0.0 { x / t } else { 0.0 };
                SegmentRate {
                    segment: s.id,
                    records_per_s: per(r),
                    bytes_per_s: per(b),
                    load: self.segs.get(&s.id).map_or(0.0, |l| l.load),
                }
            })
            .collect()
    }
}

/// The bucket boundary inside `(lo, hi)` that best halves the load in `hist`, or the middle of
/// the range when the range lies within one bucket or the load sits in one bucket.
fn split_point(lo: u64, hi: u64, hist: &[f64]) -> u64 {
    let mid = lo + (hi - lo) / 2;
    let total: f64 = hist.iter().sum();
    if total <= 0.0 {
        return mid;
    }
    let first = lo.div_ceil(BUCKET_WIDTH).max(1);
    let last = (hi - 1) / BUCKET_WIDTH;
    let mut best: Option<(f64, u64)> = None;
    let mut below = 0.0;
    for b in (lo / BUCKET_WIDTH)..first {
        below += hist[b as usize];
    }
    for b in first..=last {
        let point = b * BUCKET_WIDTH;
        if point <= lo || point >= hi {
            below += hist[b as usize];
            continue;
        }
        let imbalance = (below - (total - below)).abs();
        if best.is_none_or(|(i, _)| imbalance < i) {
            best = Some((imbalance, point));
        }
        below += hist[b as usize];
    }
    match best {
        // A boundary that leaves one side empty is no split at all: cut the range in half.
        Some((imbalance, point)) if imbalance < total => point,
        _ => mid,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::streams::hash::HASH_SPACE;

    #[test]
    fn split_point_balances_the_histogram() {
        let mut hist = vec![0.0; BUCKETS];
        hist[10] = 100.0;
        hist[200] = 100.0;
        let p = split_point(0, HASH_SPACE, &hist);
        assert!(p > 10 * BUCKET_WIDTH && p <= 200 * BUCKET_WIDTH, "{p}");
        // All the load in one bucket: halve the range.
        let mut one = vec![0.0; BUCKETS];
        one[5] = 10.0;
        assert_eq!(split_point(0, HASH_SPACE, &one), HASH_SPACE / 2);
        // A range inside one bucket.
        assert_eq!(split_point(100, 200, &hist), 150);
    }

    #[test]
    fn sustained_heat_splits_and_cold_merges() {
        let policy = ScalePolicy {
            target_records_per_s: Some(1000),
            target_bytes_per_s: None,
            window: Duration::from_millis(100),
            min_segments: 1,
            max_segments: 4,
        };
        let g = Graph::initial(0);
        let t0 = Instant::now();
        let mut s = Scaler::new(Some(policy), &g, t0);
        let keys: Vec<String> = (0..100).map(|i| format!("k{i}")).collect();
        let h = BlockHashes::of_keys(keys.iter().map(String::as_str));
        let mut ev = None;
        for i in 1..=40 {
            // 100 records per 10 ms = 10k/s, ten times the target.
            s.on_block(&g, &h, 1000);
            if let Some(e) = s.tick(&g, t0 + Duration::from_millis(10 * i)) {
                ev = Some((i, e));
                break;
            }
        }
        let (i, ev) = ev.expect("a hot segment splits");
        assert!(i >= 10, "split only after the window: tick {i}");
        assert_eq!(ev.sealed, vec![0]);
        assert_eq!(ev.created.len(), 2);
        let (g2, ids) = g.apply(&ScaleEvent { at: 5, ..ev }, 1);
        s.on_created(&ids);
        let t1 = t0 + Duration::from_secs(1);
        let mut merged = None;
        for i in 1..=40 {
            if let Some(e) = s.tick(&g2, t1 + Duration::from_millis(10 * i)) {
                merged = Some(e);
                break;
            }
        }
        let merged = merged.expect("cold neighbours merge");
        assert_eq!(merged.sealed, ids);
        assert_eq!(merged.created[0].lo, 0);
        assert_eq!(merged.created[0].hi, HASH_SPACE);
    }
}
