//! Byte- and bit-level primitives of the columnar codec: a bounds-checked cursor over one
//! section of the body and an LSB-first bit writer and reader.
//!
//! They live here rather than in `varint` because the columnar decoder's hot loop wants a
//! one-byte fast path and errors that name the section they came from.

use super::ColumnarError;

/// A bounds-checked cursor over untrusted bytes. Every read checks the remaining input first.
#[derive(Debug, Clone)]
pub(super) struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    /// Offset of `buf[0]` within the whole body, so errors point at absolute bytes.
    base: usize,
    section: &'static str,
}

impl<'a> Cursor<'a> {
    pub(super) fn new(buf: &'a [u8], section: &'static str) -> Self {
        Cursor {
            buf,
            pos: 0,
            base: 0,
            section,
        }
    }

    pub(super) fn err(&self, what: &'static str) -> ColumnarError {
        ColumnarError::Malformed {
            section: self.section,
            offset: self.base + self.pos,
            what,
        }
    }

    pub(super) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    pub(super) fn byte(&mut self) -> Result<u8, ColumnarError> {
        let b = *self
            .buf
            .get(self.pos)
            .ok_or_else(|| self.err("unexpected end of input"))?;
        self.pos += 1;
        Ok(b)
    }

    /// An unsigned LEB128 varint; the one-byte case is inlined for the decode loop.
    #[inline]
    pub(super) fn uvar(&mut self) -> Result<u64, ColumnarError> {
        if let Some(&b) = self.buf.get(self.pos)
            && b < 0x80
        {
            self.pos += 1;
            return Ok(u64::from(b));
        }
        self.uvar_slow()
    }

    fn uvar_slow(&mut self) -> Result<u64, ColumnarError> {
        let mut v: u64 = 0;
        for shift in (0..64).step_by(7) {
            let b = self.byte()?;
            if shift == 63 && b > 1 {
                return Err(self.err("varint overflows u64"));
            }
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(self.err("varint longer than 10 bytes"))
    }

    /// A zigzag-encoded signed varint.
    #[inline]
    pub(super) fn ivar(&mut self) -> Result<i64, ColumnarError> {
        Ok(crate::varint::unzigzag(self.uvar()?))
    }

    pub(super) fn take(&mut self, n: usize) -> Result<&'a [u8], ColumnarError> {
        if n > self.remaining() {
            return Err(self.err("length exceeds remaining input"));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    pub(super) fn u64_le(&mut self) -> Result<u64, ColumnarError> {
        let s = self.take(8)?;
        Ok(u64::from_le_bytes(
            s.try_into().expect("take returned 8 bytes"),
        ))
    }

    /// A count of items that each take at least `min_bytes` of the remaining input. Checking
    /// that here is what keeps every allocation sized from it bounded by the input.
    pub(super) fn count(&mut self, min_bytes: usize) -> Result<usize, ColumnarError> {
        let n = self.uvar()?;
        if n > (self.remaining() / min_bytes.max(1)) as u64 {
            return Err(self.err("count exceeds remaining input"));
        }
        Ok(n as usize)
    }

    /// A varint length followed by that many bytes.
    pub(super) fn bytes(&mut self) -> Result<&'a [u8], ColumnarError> {
        let n = self.uvar()?;
        if n > self.remaining() as u64 {
            return Err(self.err("length exceeds remaining input"));
        }
        self.take(n as usize)
    }

    /// A length-prefixed UTF-8 string, borrowed from the input.
    pub(super) fn str(&mut self) -> Result<&'a str, ColumnarError> {
        let at = self.clone();
        let b = self.bytes()?;
        std::str::from_utf8(b).map_err(|_| at.err("string is not UTF-8"))
    }

    /// A length-prefixed sub-section, as its own cursor.
    pub(super) fn section(&mut self, section: &'static str) -> Result<Cursor<'a>, ColumnarError> {
        let n = self.uvar()?;
        if n > self.remaining() as u64 {
            return Err(self.err("section length exceeds remaining input"));
        }
        let base = self.base + self.pos;
        let buf = self.take(n as usize)?;
        Ok(Cursor {
            buf,
            pos: 0,
            base,
            section,
        })
    }

    /// Fails unless every byte was consumed: a body has exactly one valid reading.
    pub(super) fn finish(&self) -> Result<(), ColumnarError> {
        if self.remaining() != 0 {
            return Err(self.err("trailing bytes"));
        }
        Ok(())
    }
}

/// Appends `body` with a varint length prefix.
pub(super) fn put_section(out: &mut Vec<u8>, body: &[u8]) {
    crate::varint::put_bytes(out, body);
}

/// Packs bit fields least-significant bit first.
#[derive(Debug, Default)]
pub(super) struct BitWriter {
    out: Vec<u8>,
    acc: u64,
    /// Bits used in `acc`, always below 64 between calls.
    used: u32,
}

impl BitWriter {
    pub(super) fn with_capacity(bytes: usize) -> Self {
        BitWriter {
            out: Vec::with_capacity(bytes),
            acc: 0,
            used: 0,
        }
    }

    /// Appends the low `bits` bits of `v` (0..=64 bits).
    pub(super) fn put(&mut self, v: u64, bits: u32) {
        debug_assert!(bits <= 64);
        if bits == 0 {
            return;
        }
        let v = if bits == 64 {
            v
        } else {
            v & ((1u64 << bits) - 1)
        };
        self.acc |= v << self.used;
        let total = self.used + bits;
        if total >= 64 {
            self.out.extend_from_slice(&self.acc.to_le_bytes());
            // The bits of `v` that did not fit; none when `acc` was empty.
            self.acc = if self.used == 0 {
                0
            } else {
                v >> (64 - self.used)
            };
            self.used = total - 64;
        } else {
            self.used = total;
        }
    }

    pub(super) fn finish(mut self) -> Vec<u8> {
        let tail = self.used.div_ceil(8) as usize;
        self.out.extend_from_slice(&self.acc.to_le_bytes()[..tail]);
        self.out
    }
}

/// Reads what [`BitWriter`] wrote, never past the end of its section.
#[derive(Debug)]
pub(super) struct BitReader<'a> {
    cur: Cursor<'a>,
    bits: &'a [u8],
    pos: usize,
}

impl<'a> BitReader<'a> {
    pub(super) fn new(mut cur: Cursor<'a>) -> Result<Self, ColumnarError> {
        let bits = cur.take(cur.remaining())?;
        Ok(BitReader { cur, bits, pos: 0 })
    }

    pub(super) fn err(&self, what: &'static str) -> ColumnarError {
        match self.cur.err(what) {
            ColumnarError::Malformed {
                section,
                offset,
                what,
            } => ColumnarError::Malformed {
                section,
                offset: offset - self.bits.len() + self.pos / 8,
                what,
            },
            other => other,
        }
    }

    /// The next `n` bits (0..=64).
    #[inline]
    pub(super) fn get(&mut self, n: u32) -> Result<u64, ColumnarError> {
        if n == 0 {
            return Ok(0);
        }
        if self.pos + n as usize > self.bits.len() * 8 {
            return Err(self.err("bit stream ends early"));
        }
        let byte = self.pos / 8;
        let shift = (self.pos % 8) as u32;
        let w = match self.bits.get(byte..byte + 16) {
            Some(s) => u128::from_le_bytes(s.try_into().expect("16 bytes")),
            None => {
                let mut window = [0u8; 16];
                window[..self.bits.len() - byte].copy_from_slice(&self.bits[byte..]);
                u128::from_le_bytes(window)
            }
        } >> shift;
        self.pos += n as usize;
        let mask = if n == 64 { u64::MAX } else { (1u64 << n) - 1 };
        Ok((w as u64) & mask)
    }

    /// The next single bit.
    #[inline]
    pub(super) fn bit(&mut self) -> Result<bool, ColumnarError> {
        let b = *self
            .bits
            .get(self.pos / 8)
            .ok_or_else(|| self.err("bit stream ends early"))?;
        let v = (b >> (self.pos % 8)) & 1 == 1;
        self.pos += 1;
        Ok(v)
    }

    /// Fails unless only zero padding (fewer than 8 bits) is left.
    pub(super) fn finish(&self) -> Result<(), ColumnarError> {
        let total = self.bits.len() * 8;
        if total - self.pos >= 8 {
            return Err(self.err("trailing bytes in bit stream"));
        }
        if self.pos < total && self.bits[self.pos / 8] >> (self.pos % 8) != 0 {
            return Err(self.err("nonzero padding bits"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bits_round_trip_every_width() {
        let mut w = BitWriter::default();
        let mut expect = Vec::new();
        for n in 0..=64u32 {
            let v = 0x9e37_79b9_7f4a_7c15u64.rotate_left(n);
            w.put(v, n);
            expect.push((n, if n == 64 { v } else { v & ((1u64 << n) - 1) }));
        }
        let bytes = w.finish();
        let mut r = BitReader::new(Cursor::new(&bytes, "test")).unwrap();
        for (n, v) in expect {
            assert_eq!(r.get(n).unwrap(), v, "width {n}");
        }
        r.finish().unwrap();
        assert!(r.get(8).is_err());
    }

    #[test]
    fn cursor_rejects_counts_larger_than_input() {
        let mut c = Cursor::new(&[200, 1, 0, 0], "test");
        assert!(c.count(1).is_err());
    }
}
