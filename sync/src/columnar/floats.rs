//! f64 columns, in one of three modes, all bit-exact:
//!
//! - **scaled**: values that came as short decimals (`71.28`) are stored as integers `m` with
//!   one power-of-ten scale `s` per column, and rebuilt as `m as f64 / 10^s`. The encoder keeps
//!   a value only if that exact expression gives back its bits; the rest (`-0.0`, NaN payloads,
//!   full-precision values) go to an exception list as raw bits. The integers then use the
//!   integer column's transforms.
//! - **gorilla**: XOR with the previous value (of the column or of the key), Facebook Gorilla's
//!   leading/trailing-zero bit packing. Wins on full-precision sensor values.
//! - **raw**: eight little-endian bytes per value, the fallback that never loses.
//!
//! The encoder estimates each mode's size and keeps the smallest, unless a [`FloatChoice`]
//! forces one (the benchmark does, to measure them against each other).

use super::ints::{self, IntDecoder, SlotBudget};
use super::wire::{BitReader, BitWriter, Cursor, put_section};
use super::{ColumnarError, FloatChoice};

const MODE_RAW: u8 = 0;
const MODE_SCALED: u8 = 1;
const MODE_GORILLA: u8 = 2;

/// Largest decimal scale tried. Every power of ten up to 10^22 is exact in f64.
pub(super) const SCALE_MAX: u8 = 18;
const POW10: [f64; SCALE_MAX as usize + 1] = [
    1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11, 1e12, 1e13, 1e14, 1e15, 1e16,
    1e17, 1e18,
];
/// Integers up to 2^53 convert to f64 exactly, so decoding is one exact conversion and one
/// correctly rounded division.
const EXACT_INT_MAX: f64 = 9_007_199_254_740_992.0;

/// The decoder's rebuild of a scaled value. The encoder calls the same function to verify.
#[inline]
fn unscale(m: i64, s: u8) -> f64 {
    m as f64 / POW10[s as usize]
}

/// `v` as an integer at scale `s`, if that round-trips bit for bit.
#[inline]
fn scale(v: f64, s: u8) -> Option<i64> {
    let m = (v * POW10[s as usize]).round();
    // NaN fails this test too: it is neither smaller nor larger.
    if m.abs().partial_cmp(&EXACT_INT_MAX) != Some(std::cmp::Ordering::Less) {
        return None;
    }
    let m = m as i64;
    (unscale(m, s).to_bits() == v.to_bits()).then_some(m)
}

/// The smallest scale at which all but a few values round-trip, or `None` if more than
/// `exceptions_max` values would need raw storage at every scale.
fn find_scale(vals: &[f64], exceptions_max: usize) -> Option<u8> {
    let mut s = 0u8;
    let mut misses = 0usize;
    for &v in vals {
        if scale(v, s).is_some() {
            continue;
        }
        match (s + 1..=SCALE_MAX).find(|&t| scale(v, t).is_some()) {
            Some(t) => s = t,
            None => {
                misses += 1;
                if misses > exceptions_max {
                    return None;
                }
            }
        }
    }
    Some(s)
}

/// A column split into scaled integers and raw exceptions.
struct Scaled {
    scale: u8,
    keys: Vec<u32>,
    ints: Vec<i64>,
    /// (ordinal within the column, raw bits).
    exceptions: Vec<(usize, u64)>,
}

fn split_scaled(keys: &[u32], vals: &[f64], s: u8) -> Scaled {
    let mut out = Scaled {
        scale: s,
        keys: Vec::with_capacity(keys.len()),
        ints: Vec::with_capacity(vals.len()),
        exceptions: Vec::new(),
    };
    for (i, (&k, &v)) in keys.iter().zip(vals).enumerate() {
        match scale(v, s) {
            Some(m) => {
                out.keys.push(k);
                out.ints.push(m);
            }
            None => out.exceptions.push((i, v.to_bits())),
        }
    }
    out
}

/// Gorilla predictor state for one slot.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct GorillaSlot {
    prev: u64,
    /// Leading and trailing zero counts of the current window; `window` is false until the
    /// first nonzero XOR sets one.
    lead: u32,
    trail: u32,
    window: bool,
}

/// Gorilla-encodes `vals` (into `w` when given) and returns the size in bits.
fn gorilla(keys: &[u32], vals: &[f64], nslots: usize, mut w: Option<&mut BitWriter>) -> u64 {
    let mut slots = vec![GorillaSlot::default(); nslots];
    let mut bits = 0u64;
    for (&k, &v) in keys.iter().zip(vals) {
        let slot = &mut slots[if nslots == 1 { 0 } else { k as usize }];
        let x = v.to_bits() ^ slot.prev;
        slot.prev = v.to_bits();
        let mut put = |value: u64, n: u32| {
            bits += u64::from(n);
            if let Some(w) = w.as_deref_mut() {
                w.put(value, n);
            }
        };
        if x == 0 {
            put(0, 1);
            continue;
        }
        let lead = x.leading_zeros().min(31);
        let trail = x.trailing_zeros();
        if slot.window && lead >= slot.lead && trail >= slot.trail {
            let len = 64 - slot.lead - slot.trail;
            put(0b01, 2);
            put(x >> slot.trail, len);
        } else {
            let len = 64 - lead - trail;
            put(0b11, 2);
            put(u64::from(lead), 5);
            put(u64::from(len - 1), 6);
            put(x >> trail, len);
            *slot = GorillaSlot {
                prev: slot.prev,
                lead,
                trail,
                window: true,
            };
        }
    }
    bits
}

/// Writes one f64 column, choosing the mode as described in the module docs.
pub(super) fn write(
    out: &mut Vec<u8>,
    keys: &[u32],
    vals: &[f64],
    nkeys: usize,
    budget: &mut SlotBudget,
    per_key_ok: bool,
    choice: FloatChoice,
) {
    let per_key = per_key_ok && budget.fits(nkeys);
    let raw_bits = 64 * vals.len() as u64;
    let scaled = match choice {
        FloatChoice::Auto => find_scale(vals, vals.len() / 8 + 4),
        FloatChoice::Scaled => find_scale(vals, usize::MAX),
        FloatChoice::Gorilla | FloatChoice::Raw => None,
    }
    .map(|s| split_scaled(keys, vals, s));
    let scaled_cost = scaled.as_ref().map(|sc| {
        let (t, bits) = ints::choose(&sc.keys, &sc.ints, nkeys, per_key);
        (t, bits + 80 * sc.exceptions.len() as u64)
    });
    let gorilla_slots = if per_key { nkeys } else { 1 };
    let gorilla_cost = match choice {
        FloatChoice::Auto | FloatChoice::Gorilla => Some(gorilla(keys, vals, gorilla_slots, None)),
        _ => None,
    };
    let scaled_wins = match (scaled_cost, gorilla_cost) {
        (Some((_, s)), Some(g)) => s <= g && s <= raw_bits,
        (Some(_), None) => true,
        _ => false,
    };
    if let (true, Some(sc), Some((t, _))) = (scaled_wins, scaled, scaled_cost) {
        write_scaled(out, &sc, nkeys, t);
        if t.per_key {
            assert!(budget.take(nkeys), "fits() was checked above");
        }
    } else if gorilla_cost.is_some_and(|g| g < raw_bits || choice == FloatChoice::Gorilla) {
        out.push(MODE_GORILLA);
        out.push(u8::from(per_key));
        let mut w = BitWriter::with_capacity(vals.len() * 2);
        gorilla(keys, vals, gorilla_slots, Some(&mut w));
        put_section(out, &w.finish());
        if per_key {
            assert!(budget.take(nkeys), "fits() was checked above");
        }
    } else {
        out.push(MODE_RAW);
        let mut raw = Vec::with_capacity(vals.len() * 8);
        for v in vals {
            raw.extend_from_slice(&v.to_bits().to_le_bytes());
        }
        put_section(out, &raw);
    }
}

fn write_scaled(out: &mut Vec<u8>, sc: &Scaled, nkeys: usize, t: ints::Transform) {
    out.push(MODE_SCALED);
    out.push(sc.scale);
    let mut exc = Vec::with_capacity(sc.exceptions.len() * 10);
    let mut next = 0usize;
    for &(ord, bits) in &sc.exceptions {
        // Ordinals ascend strictly, so the gap to the previous one is never negative.
        crate::varint::put_u64(&mut exc, (ord - next) as u64);
        exc.extend_from_slice(&bits.to_le_bytes());
        next = ord + 1;
    }
    crate::varint::put_u64(out, sc.exceptions.len() as u64);
    put_section(out, &exc);
    ints::write(out, &sc.keys, &sc.ints, nkeys, t);
}

/// Reads one f64 column.
#[derive(Debug)]
pub(super) enum F64Decoder<'a> {
    Raw(Cursor<'a>),
    Scaled(ScaledDecoder<'a>),
    Gorilla {
        bits: BitReader<'a>,
        per_key: bool,
        slots: Vec<GorillaSlot>,
    },
}

#[derive(Debug)]
pub(super) struct ScaledDecoder<'a> {
    div: f64,
    ints: IntDecoder<'a>,
    exc: Cursor<'a>,
    exc_left: u64,
    /// Ordinal of the next exception; `u64::MAX` when none is left.
    next_exc: u64,
    ord: u64,
}

impl<'a> F64Decoder<'a> {
    pub(super) fn parse(
        c: &mut Cursor<'a>,
        nkeys: usize,
        budget: &mut SlotBudget,
    ) -> Result<Self, ColumnarError> {
        match c.byte()? {
            MODE_RAW => Ok(F64Decoder::Raw(c.section("f64 raw")?)),
            MODE_SCALED => Ok(F64Decoder::Scaled(ScaledDecoder::parse(c, nkeys, budget)?)),
            MODE_GORILLA => {
                let per_key = match c.byte()? {
                    0 => false,
                    1 => true,
                    _ => return Err(c.err("bad gorilla scope")),
                };
                if per_key && !budget.take(nkeys) {
                    return Err(c.err("per-key state exceeds the body's budget"));
                }
                let bits = BitReader::new(c.section("f64 gorilla")?)?;
                let slots = vec![GorillaSlot::default(); if per_key { nkeys } else { 1 }];
                Ok(F64Decoder::Gorilla {
                    bits,
                    per_key,
                    slots,
                })
            }
            _ => Err(c.err("unknown f64 column mode")),
        }
    }

    #[inline]
    pub(super) fn next(&mut self, key: u32) -> Result<f64, ColumnarError> {
        match self {
            F64Decoder::Scaled(d) => d.next(key),
            F64Decoder::Raw(c) => Ok(f64::from_bits(c.u64_le()?)),
            F64Decoder::Gorilla {
                bits,
                per_key,
                slots,
            } => {
                let slot = &mut slots[if *per_key { key as usize } else { 0 }];
                gorilla_next(bits, slot)
            }
        }
    }

    pub(super) fn finish(&self) -> Result<(), ColumnarError> {
        match self {
            F64Decoder::Raw(c) => c.finish(),
            F64Decoder::Scaled(d) => d.finish(),
            F64Decoder::Gorilla { bits, .. } => bits.finish(),
        }
    }
}

fn gorilla_next(bits: &mut BitReader<'_>, slot: &mut GorillaSlot) -> Result<f64, ColumnarError> {
    if !bits.bit()? {
        return Ok(f64::from_bits(slot.prev));
    }
    let x = if !bits.bit()? {
        if !slot.window {
            return Err(bits.err("gorilla window reused before it was set"));
        }
        bits.get(64 - slot.lead - slot.trail)? << slot.trail
    } else {
        let lead = bits.get(5)? as u32;
        let len = bits.get(6)? as u32 + 1;
        if lead + len > 64 {
            return Err(bits.err("gorilla window wider than 64 bits"));
        }
        let trail = 64 - lead - len;
        slot.lead = lead;
        slot.trail = trail;
        slot.window = true;
        bits.get(len)? << trail
    };
    slot.prev ^= x;
    Ok(f64::from_bits(slot.prev))
}

impl<'a> ScaledDecoder<'a> {
    fn parse(
        c: &mut Cursor<'a>,
        nkeys: usize,
        budget: &mut SlotBudget,
    ) -> Result<Self, ColumnarError> {
        let s = c.byte()?;
        if s > SCALE_MAX {
            return Err(c.err("decimal scale out of range"));
        }
        let exc_left = c.uvar()?;
        let mut exc = c.section("f64 exceptions")?;
        // Each exception takes at least nine bytes.
        if exc_left > (exc.remaining() / 9) as u64 {
            return Err(exc.err("exception count exceeds its section"));
        }
        let next_exc = if exc_left == 0 { u64::MAX } else { exc.uvar()? };
        let ints = IntDecoder::parse(c, "f64 scaled", nkeys, true, budget)?;
        Ok(ScaledDecoder {
            div: POW10[s as usize],
            ints,
            exc,
            exc_left,
            next_exc,
            ord: 0,
        })
    }

    #[inline]
    fn next(&mut self, key: u32) -> Result<f64, ColumnarError> {
        let ord = self.ord;
        self.ord += 1;
        if ord != self.next_exc {
            return Ok(self.ints.next(key)? as f64 / self.div);
        }
        let v = f64::from_bits(self.exc.u64_le()?);
        self.exc_left -= 1;
        self.next_exc = if self.exc_left == 0 {
            u64::MAX
        } else {
            let gap = self.exc.uvar()?;
            ord.checked_add(1)
                .and_then(|o| o.checked_add(gap))
                .ok_or_else(|| self.exc.err("exception gap overflows"))?
        };
        Ok(v)
    }

    fn finish(&self) -> Result<(), ColumnarError> {
        if self.exc_left != 0 {
            return Err(self.exc.err("exceptions left over"));
        }
        self.exc.finish()?;
        self.ints.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decimals_scale_and_odd_values_do_not() {
        assert_eq!(scale(71.28, 2), Some(7128));
        assert_eq!(scale(45.941342, 6), Some(45_941_342));
        assert_eq!(scale(-0.0, 0), None);
        assert_eq!(scale(f64::NAN, 0), None);
        assert_eq!(scale(f64::INFINITY, 3), None);
        assert_eq!(scale(0.1 + 0.2, SCALE_MAX), None);
        assert_eq!(find_scale(&[71.28, 12.5, 3.0], 0), Some(2));
    }
}
