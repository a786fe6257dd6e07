//! Stream cuts: a position in every segment of a frontier, as a printable opaque token.
//!
//! A cut maps segment ids to the next offset to read in each. The records *after* a cut are
//! those at or past the cut's position in a segment of the cut, plus every record of a
//! segment that descends (through successor links) from a segment of the cut. A cut taken at
//! the readable end holds the open segments, so this is "everything committed later"; a cut
//! taken from a reader group's checkpoints holds the group's frontier (unfinished segments
//! whose predecessors are finished), so it is "everything the group has not checkpointed".
//!
//! Token: `base64url(version=1 | varint stream | varint n | n x (varint segment, varint
//! offset) | crc32c LE)`, without padding. The version byte makes every token start with `A`.

use super::graph::{Graph, SegmentId};
use crate::catalog::StreamId;
use std::collections::{BTreeMap, HashMap};
use thiserror::Error;

const VERSION: u8 = 1;

/// Why a token is not a cut.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum CutError {
    #[error("not a stream cut token")]
    Malformed,
    #[error("the cut belongs to another stream")]
    OtherStream,
    #[error("the cut names segment {0}, which the stream does not have")]
    UnknownSegment(SegmentId),
}

/// A stream cut.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cut {
    pub stream: StreamId,
    pub positions: BTreeMap<SegmentId, u64>,
}

impl Cut {
    /// The cut at offset `o`: the segments spanning `o`, each at `o`.
    pub fn at_offset(stream: StreamId, graph: &Graph, o: u64) -> Cut {
        Cut {
            stream,
            positions: graph.open_at(o).map(|s| (s.id, o)).collect(),
        }
    }

    /// The printable token.
    pub fn token(&self) -> String {
        let mut b = vec![VERSION];
        put_varint(&mut b, u64::from(self.stream));
        put_varint(&mut b, self.positions.len() as u64);
        for (&s, &o) in &self.positions {
            put_varint(&mut b, u64::from(s));
            put_varint(&mut b, o);
        }
        let crc = crc32c::crc32c(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        base64url_encode(&b)
    }

    /// Parses a token.
    pub fn parse(token: &str) -> Result<Cut, CutError> {
        let b = base64url_decode(token).ok_or(CutError::Malformed)?;
        if b.len() < 5 || b[0] != VERSION {
            return Err(CutError::Malformed);
        }
        let (body, crc) = b.split_at(b.len() - 4);
        if crc32c::crc32c(body).to_le_bytes() != crc {
            return Err(CutError::Malformed);
        }
        let mut r = &body[1..];
        let stream = StreamId::try_from(get_varint(&mut r)?).map_err(|_| CutError::Malformed)?;
        let n = get_varint(&mut r)?;
        let mut positions = BTreeMap::new();
        for _ in 0..n {
            let s = SegmentId::try_from(get_varint(&mut r)?).map_err(|_| CutError::Malformed)?;
            positions.insert(s, get_varint(&mut r)?);
        }
        if !r.is_empty() {
            return Err(CutError::Malformed);
        }
        Ok(Cut { stream, positions })
    }

    /// Checks the cut against a stream's graph.
    pub fn check(&self, stream: StreamId, graph: &Graph) -> Result<(), CutError> {
        if self.stream != stream {
            return Err(CutError::OtherStream);
        }
        match self.positions.keys().find(|&&s| graph.segment(s).is_none()) {
            Some(&s) => Err(CutError::UnknownSegment(s)),
            None => Ok(()),
        }
    }

    /// The lowest offset a record after the cut can have.
    pub fn min_offset(&self, graph: &Graph) -> u64 {
        self.positions
            .iter()
            .map(|(&s, &o)| graph.segment(s).map_or(o, |seg| o.max(seg.start)))
            .min()
            .unwrap_or(0)
    }
}

/// Decides "after the cut" for records, caching which segments descend from the cut.
#[derive(Debug)]
pub struct CutFilter {
    cut: Cut,
    descends: HashMap<SegmentId, bool>,
}

impl CutFilter {
    pub fn new(cut: Cut) -> CutFilter {
        CutFilter {
            cut,
            descends: HashMap::new(),
        }
    }

    /// The cut.
    pub fn cut(&self) -> &Cut {
        &self.cut
    }

    /// Whether the record at offset `o` of segment `s` lies after the cut.
    #[inline]
    pub fn after(&mut self, graph: &Graph, s: SegmentId, o: u64) -> bool {
        if let Some(&pos) = self.cut.positions.get(&s) {
            return o >= pos;
        }
        if let Some(&d) = self.descends.get(&s) {
            return d;
        }
        let d = self
            .cut
            .positions
            .keys()
            .any(|&c| c < s && graph.descends_from(s, c));
        self.descends.insert(s, d);
        d
    }

    /// The cut equivalent to this one once every offset below `n` was read: cut segments move
    /// to `n` (within their range), descendants that began below `n` join at `n`, and
    /// finished segments whose successors are all in the cut leave it.
    pub fn advanced(&mut self, graph: &Graph, n: u64) -> Cut {
        let mut positions = self.cut.positions.clone();
        for seg in graph.segments() {
            if seg.start >= n {
                continue;
            }
            let in_cut = positions.contains_key(&seg.id);
            if in_cut || self.after(graph, seg.id, seg.start) {
                let clip = seg.end.map_or(n, |e| n.min(e)).max(seg.start);
                let p = positions.entry(seg.id).or_insert(clip);
                *p = (*p).max(clip);
            }
        }
        let done: Vec<SegmentId> = positions
            .iter()
            .filter(|&(&s, &p)| {
                graph.segment(s).is_some_and(|seg| {
                    seg.end.is_some_and(|e| p >= e)
                        && !seg.succs.is_empty()
                        && seg.succs.iter().all(|x| positions.contains_key(x))
                })
            })
            .map(|(&s, _)| s)
            .collect();
        for s in done {
            positions.remove(&s);
        }
        Cut {
            stream: self.cut.stream,
            positions,
        }
    }
}

fn put_varint(b: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        b.push((v as u8) | 0x80);
        v >>= 7;
    }
    b.push(v as u8);
}

fn get_varint(r: &mut &[u8]) -> Result<u64, CutError> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let (&byte, rest) = r.split_first().ok_or(CutError::Malformed)?;
        *r = rest;
        v |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Ok(v);
        }
    }
    Err(CutError::Malformed)
}

/// Tokens are URL-safe base64 without padding, so they go in a query string as they are.
fn base64url_encode(b: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b)
}

fn base64url_decode(s: &str) -> Option<Vec<u8>> {
    use base64::Engine as _;
    base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(s)
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::streams::graph::{NewSegment, ScaleEvent};
    use crate::streams::hash::HASH_SPACE;

    #[test]
    fn tokens_round_trip_and_reject_garbage() {
        let cut = Cut {
            stream: 3,
            positions: [(0, 0), (7, 1 << 40), (300, 12345)].into_iter().collect(),
        };
        let t = cut.token();
        assert!(t.starts_with('A'));
        assert!(
            t.bytes()
                .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_')
        );
        assert_eq!(Cut::parse(&t), Ok(cut));
        assert_eq!(Cut::parse("yesterday"), Err(CutError::Malformed));
        assert_eq!(Cut::parse(""), Err(CutError::Malformed));
        let mut bad = t.into_bytes();
        bad[3] = if bad[3] == b'B' { b'C' } else { b'B' };
        assert!(Cut::parse(std::str::from_utf8(&bad).unwrap()).is_err());
        for len in 0..20 {
            let b: Vec<u8> = (0..len).map(|i| (i * 37) as u8).collect();
            assert_eq!(base64url_decode(&base64url_encode(&b)).unwrap(), b);
        }
    }

    #[test]
    fn after_covers_descendants_and_advances() {
        let half = HASH_SPACE / 2;
        let (g, _) = Graph::initial(0).apply(
            &ScaleEvent {
                at: 10,
                sealed: vec![0],
                created: vec![
                    NewSegment {
                        lo: 0,
                        hi: half,
                        preds: vec![0],
                    },
                    NewSegment {
                        lo: half,
                        hi: HASH_SPACE,
                        preds: vec![0],
                    },
                ],
            },
            0,
        );
        let mut f = CutFilter::new(Cut::at_offset(1, &g, 5));
        assert!(!f.after(&g, 0, 4));
        assert!(f.after(&g, 0, 5));
        assert!(f.after(&g, 1, 10));
        let c = f.advanced(&g, 12);
        // Segment 0 is finished and both successors joined the cut.
        assert_eq!(c.positions, [(1, 12), (2, 12)].into_iter().collect());
        let mut f2 = CutFilter::new(Cut {
            stream: 1,
            positions: [(1, 11)].into_iter().collect(),
        });
        assert!(!f2.after(&g, 2, 15), "not a descendant of the cut");
        assert!(!f2.after(&g, 0, 9));
    }
}
