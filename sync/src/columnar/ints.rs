//! Integer columns: a transform (none, delta or delta-of-delta, against the previous value of
//! the whole column or of the same key) followed by zigzag varints.
//!
//! Telemetry interleaves many keys, so the previous value *of the same key* is usually the
//! best predictor: a temperature moves a little from one reading of a truck to the next, while
//! neighbouring records belong to different trucks. The encoder estimates the size of every
//! transform and writes the cheapest; the decoder simply follows the tag.

use super::ColumnarError;
use super::wire::{Cursor, put_section};
use crate::varint;

/// What an integer is predicted from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Order {
    /// Stored as is.
    Plain = 0,
    /// Difference from the previous value.
    Delta = 1,
    /// Difference from the previous difference: constant rates cost nothing.
    DeltaOfDelta = 2,
}

/// The transform tag byte: bits 0-1 the [`Order`], bit 2 set when predecessors are per key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Transform {
    pub(super) order: Order,
    pub(super) per_key: bool,
}

const PER_KEY_BIT: u8 = 4;

impl Transform {
    fn tag(self) -> u8 {
        self.order as u8 | if self.per_key { PER_KEY_BIT } else { 0 }
    }

    fn from_tag(tag: u8) -> Option<Self> {
        let order = match tag & !PER_KEY_BIT {
            0 => Order::Plain,
            1 => Order::Delta,
            2 => Order::DeltaOfDelta,
            _ => return None,
        };
        Some(Transform {
            order,
            per_key: tag & PER_KEY_BIT != 0,
        })
    }
}

/// Predictor state for one slot (the whole column, or one key).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Slot {
    prev: i64,
    prev_delta: i64,
}

impl Slot {
    /// The residual the encoder stores for `v`.
    #[inline]
    fn residual(&mut self, order: Order, v: i64) -> i64 {
        let d = v.wrapping_sub(self.prev);
        let r = match order {
            Order::Plain => v,
            Order::Delta => d,
            Order::DeltaOfDelta => d.wrapping_sub(self.prev_delta),
        };
        self.prev = v;
        self.prev_delta = d;
        r
    }

    /// The value the decoder rebuilds from a residual: the exact inverse of `residual`.
    #[inline]
    fn value(&mut self, order: Order, r: i64) -> i64 {
        let v = match order {
            Order::Plain => r,
            Order::Delta => self.prev.wrapping_add(r),
            Order::DeltaOfDelta => self.prev.wrapping_add(self.prev_delta.wrapping_add(r)),
        };
        self.prev_delta = v.wrapping_sub(self.prev);
        self.prev = v;
        v
    }
}

/// Estimated entropy-coded size of a residual, in bits: its zigzag bit length plus one.
#[inline]
pub(super) fn cost_bits(r: i64) -> u64 {
    u64::from(65 - varint::zigzag(r).leading_zeros())
}

/// The candidate transforms in the order ties are broken (simplest first).
const CANDIDATES: [Transform; 5] = [
    Transform {
        order: Order::Plain,
        per_key: false,
    },
    Transform {
        order: Order::Delta,
        per_key: false,
    },
    Transform {
        order: Order::DeltaOfDelta,
        per_key: false,
    },
    Transform {
        order: Order::Delta,
        per_key: true,
    },
    Transform {
        order: Order::DeltaOfDelta,
        per_key: true,
    },
];

/// Picks the transform with the smallest estimated size, and returns that estimate in bits.
///
/// `keys[i]` is the key id of `vals[i]`; per-key candidates are tried only when `per_key_ok`.
pub(super) fn choose(
    keys: &[u32],
    vals: &[i64],
    nkeys: usize,
    per_key_ok: bool,
) -> (Transform, u64) {
    let mut cost = [0u64; CANDIDATES.len()];
    let mut global = Slot::default();
    let mut global_dod = Slot::default();
    for &v in vals {
        cost[0] += cost_bits(v);
        cost[1] += cost_bits(global.residual(Order::Delta, v));
        cost[2] += cost_bits(global_dod.residual(Order::DeltaOfDelta, v));
    }
    let tried = if per_key_ok {
        let mut slots = vec![Slot::default(); nkeys];
        let mut slots_dod = vec![Slot::default(); nkeys];
        for (&k, &v) in keys.iter().zip(vals) {
            cost[3] += cost_bits(slots[k as usize].residual(Order::Delta, v));
            cost[4] += cost_bits(slots_dod[k as usize].residual(Order::DeltaOfDelta, v));
        }
        CANDIDATES.len()
    } else {
        3
    };
    let best = (0..tried)
        .min_by_key(|&i| (cost[i], i))
        .expect("at least one candidate");
    (CANDIDATES[best], cost[best])
}

/// Writes `tag | len | residual varints` for `vals` under transform `t`.
pub(super) fn write(out: &mut Vec<u8>, keys: &[u32], vals: &[i64], nkeys: usize, t: Transform) {
    out.push(t.tag());
    let mut stream = Vec::with_capacity(vals.len() + 16);
    if t.per_key {
        let mut slots = vec![Slot::default(); nkeys];
        for (&k, &v) in keys.iter().zip(vals) {
            varint::put_i64(&mut stream, slots[k as usize].residual(t.order, v));
        }
    } else {
        let mut slot = Slot::default();
        for &v in vals {
            varint::put_i64(&mut stream, slot.residual(t.order, v));
        }
    }
    put_section(out, &stream);
}

/// Chooses and writes in one call; returns the transform used.
pub(super) fn write_best(
    out: &mut Vec<u8>,
    keys: &[u32],
    vals: &[i64],
    nkeys: usize,
    per_key_ok: bool,
) -> Transform {
    let (t, _) = choose(keys, vals, nkeys, per_key_ok);
    write(out, keys, vals, nkeys, t);
    t
}

/// Budget of per-key predictor slots a decoder may allocate, shared by all columns of a body.
///
/// Per-key state costs one slot per distinct key per column. Bounding the total by the record
/// count keeps a hostile body from asking for `keys x columns` memory; the encoder respects the
/// same bound, falling back to whole-column prediction when it would be exceeded.
#[derive(Debug)]
pub(super) struct SlotBudget {
    left: usize,
}

impl SlotBudget {
    pub(super) fn new(count: usize) -> Self {
        SlotBudget {
            left: count.saturating_add(4096),
        }
    }

    /// Whether `n` more slots fit, without taking them.
    pub(super) fn fits(&self, n: usize) -> bool {
        n <= self.left
    }

    /// Takes `n` slots, or reports that the body asks for too many.
    pub(super) fn take(&mut self, n: usize) -> bool {
        if n > self.left {
            return false;
        }
        self.left -= n;
        true
    }
}

/// Reads one integer column written by [`write`].
#[derive(Debug)]
pub(super) struct IntDecoder<'a> {
    cur: Cursor<'a>,
    order: Order,
    per_key: bool,
    slots: Vec<Slot>,
}

impl<'a> IntDecoder<'a> {
    /// Parses the column header; `per_key_ok` is false where per-key prediction is meaningless.
    pub(super) fn parse(
        c: &mut Cursor<'a>,
        section: &'static str,
        nkeys: usize,
        per_key_ok: bool,
        budget: &mut SlotBudget,
    ) -> Result<Self, ColumnarError> {
        let t = Transform::from_tag(c.byte()?).ok_or_else(|| c.err("unknown integer transform"))?;
        if t.per_key && !per_key_ok {
            return Err(c.err("per-key transform where none is allowed"));
        }
        if t.per_key && !budget.take(nkeys) {
            return Err(c.err("per-key state exceeds the body's budget"));
        }
        let nslots = if t.per_key { nkeys } else { 1 };
        let cur = c.section(section)?;
        Ok(IntDecoder {
            cur,
            order: t.order,
            per_key: t.per_key,
            slots: vec![Slot::default(); nslots],
        })
    }

    /// The next value, for a record with key id `key` (already checked against the key count).
    #[inline]
    pub(super) fn next(&mut self, key: u32) -> Result<i64, ColumnarError> {
        let r = self.cur.ivar()?;
        let slot = if self.per_key { key as usize } else { 0 };
        Ok(self.slots[slot].value(self.order, r))
    }

    pub(super) fn finish(&self) -> Result<(), ColumnarError> {
        self.cur.finish()
    }

    /// An error located at the stream's current position.
    pub(super) fn err(&self, what: &'static str) -> ColumnarError {
        self.cur.err(what)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_transform_round_trips_extremes() {
        let vals = [0, i64::MAX, i64::MIN, -1, 1, i64::MIN, 7, 7, 7, i64::MAX];
        let keys = [0, 1, 0, 1, 0, 1, 0, 1, 0, 1];
        for t in CANDIDATES {
            let mut out = Vec::new();
            write(&mut out, &keys, &vals, 2, t);
            let mut c = Cursor::new(&out, "test");
            let mut d =
                IntDecoder::parse(&mut c, "test", 2, true, &mut SlotBudget::new(0)).unwrap();
            for (&k, &v) in keys.iter().zip(&vals) {
                assert_eq!(d.next(k).unwrap(), v, "{t:?}");
            }
            d.finish().unwrap();
        }
    }

    #[test]
    fn per_key_prediction_wins_on_interleaved_series() {
        let keys: Vec<u32> = (0..1000).map(|i| i % 10).collect();
        let vals: Vec<i64> = (0..1000).map(|i| (i % 10) * 1_000_000 + i / 10).collect();
        let (t, _) = choose(&keys, &vals, 10, true);
        assert!(t.per_key, "{t:?}");
    }
}
