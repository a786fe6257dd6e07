//! LEB128 varints and zigzag integers, with a bounds-checked reader.
//!
//! Every read checks the remaining input first, so decoders built on [`Reader`] cannot read
//! past the end or allocate more than the input could hold.

/// Appends `v` as an unsigned LEB128 varint.
pub fn put_u64(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Appends `v` zigzag-encoded, so small negative numbers stay short.
pub fn put_i64(out: &mut Vec<u8>, v: i64) {
    put_u64(out, zigzag(v));
}

/// Appends a length-prefixed byte string.
pub fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    put_u64(out, b.len() as u64);
    out.extend_from_slice(b);
}

pub fn zigzag(v: i64) -> u64 {
    ((v << 1) ^ (v >> 63)) as u64
}

pub fn unzigzag(v: u64) -> i64 {
    ((v >> 1) as i64) ^ -((v & 1) as i64)
}

/// Why a read failed, and where.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadError {
    pub offset: usize,
    pub what: &'static str,
}

/// A cursor over untrusted bytes.
#[derive(Debug)]
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    pub fn offset(&self) -> usize {
        self.pos
    }

    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn err(&self, what: &'static str) -> ReadError {
        ReadError {
            offset: self.pos,
            what,
        }
    }

    pub fn byte(&mut self) -> Result<u8, ReadError> {
        let b = *self
            .buf
            .get(self.pos)
            .ok_or(self.err("unexpected end of input"))?;
        self.pos += 1;
        Ok(b)
    }

    pub fn u64(&mut self) -> Result<u64, ReadError> {
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

    pub fn i64(&mut self) -> Result<i64, ReadError> {
        Ok(unzigzag(self.u64()?))
    }

    pub fn u64_le(&mut self) -> Result<u64, ReadError> {
        let s = self.take(8)?;
        Ok(u64::from_le_bytes(s.try_into().expect("8 bytes")))
    }

    pub fn take(&mut self, n: usize) -> Result<&'a [u8], ReadError> {
        if n > self.remaining() {
            return Err(self.err("length exceeds remaining input"));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    pub fn bytes(&mut self) -> Result<&'a [u8], ReadError> {
        let n = self.u64()?;
        if n > self.remaining() as u64 {
            return Err(self.err("length exceeds remaining input"));
        }
        self.take(n as usize)
    }

    pub fn string(&mut self) -> Result<String, ReadError> {
        let start = self.pos;
        let b = self.bytes()?;
        std::str::from_utf8(b)
            .map(str::to_owned)
            .map_err(|_| ReadError {
                offset: start,
                what: "string is not UTF-8",
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zigzag_round_trips_extremes() {
        for v in [0, 1, -1, i64::MAX, i64::MIN, 123456789, -987654321] {
            assert_eq!(unzigzag(zigzag(v)), v);
            let mut out = Vec::new();
            put_i64(&mut out, v);
            assert_eq!(Reader::new(&out).i64().unwrap(), v);
        }
    }

    #[test]
    fn overlong_varint_is_an_error() {
        let bad = [0xffu8; 11];
        assert!(Reader::new(&bad).u64().is_err());
    }
}
