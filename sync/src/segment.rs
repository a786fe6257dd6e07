//! Segment files: an append-only sequence of CRC-framed blocks.
//!
//! ```text
//! segment := header frame*
//! header  := magic "TRIBSEG\0" (8) | version u32 LE (4) | crc32c(magic..version) u32 LE (4)
//! frame   := len u32 LE (4) | crc32c(block) u32 LE (4) | block (len bytes)
//! ```
//!
//! The frame checksum covers the whole block, so a torn write at the tail is detected without
//! decoding the block. Recovery keeps every frame up to the first one that fails and reports
//! the rest; whether the rest is a torn tail (truncate) or a corrupt sealed block (quarantine)
//! is the caller's decision, helped by [`resync`] and, in version 2 segments, by sync marks.
//!
//! Version 2 adds one kind of frame that is not a block: a **sync mark**, whose payload is
//! `magic "TRSM" (4) | synced_len u64 LE (8)`. The writer puts one before the first frame it
//! appends after an fsync; `synced_len` is how much of the file that fsync made durable. A valid
//! mark at offset `m` therefore proves the bytes before `synced_len` (never more than `m`) were
//! durable before anything at or after `m` was written.

use thiserror::Error;

/// Magic bytes at the start of every segment file.
pub const SEGMENT_MAGIC: [u8; 8] = *b"TRIBSEG\0";
/// The segment container version written by this build: 2, which may hold sync marks.
pub const SEGMENT_VERSION: u32 = 2;
/// The first segment version: frames hold blocks only.
pub const SEGMENT_VERSION_V1: u32 = 1;
/// Size of the segment file header.
pub const SEGMENT_HEADER_LEN: usize = SEGMENT_MAGIC.len() + 4 + 4;
/// Size of a frame header (length and checksum).
pub const FRAME_HEADER_LEN: usize = 8;
const _: () = assert!(SEGMENT_HEADER_LEN == 16);

/// The largest block a frame may carry; anything larger is treated as corruption.
pub const FRAME_BYTES_MAX: u32 = 256 << 20;

/// `TRSM`: the payload of a sync mark starts with it (a block starts with `TRBK`).
pub const SYNC_MARK_MAGIC: [u8; 4] = *b"TRSM";
/// Length of a sync mark's payload: magic and `synced_len`.
pub const SYNC_MARK_LEN: usize = SYNC_MARK_MAGIC.len() + 8;
/// Length of a framed sync mark.
pub const SYNC_MARK_FRAME_LEN: usize = FRAME_HEADER_LEN + SYNC_MARK_LEN;
const _: () = assert!(SYNC_MARK_FRAME_LEN == 20);

/// A framed sync mark saying the file was durable up to `synced_len` when it was written.
pub fn encode_sync_mark(synced_len: u64) -> [u8; SYNC_MARK_FRAME_LEN] {
    let mut payload = [0u8; SYNC_MARK_LEN];
    payload[..4].copy_from_slice(&SYNC_MARK_MAGIC);
    payload[4..].copy_from_slice(&synced_len.to_le_bytes());
    let mut out = [0u8; SYNC_MARK_FRAME_LEN];
    out[..FRAME_HEADER_LEN].copy_from_slice(&frame_header(&payload));
    out[FRAME_HEADER_LEN..].copy_from_slice(&payload);
    out
}

/// The `synced_len` of a frame payload that is a sync mark, or `None` for anything else.
pub fn decode_sync_mark(payload: &[u8]) -> Option<u64> {
    if payload.len() != SYNC_MARK_LEN || payload[..4] != SYNC_MARK_MAGIC {
        return None;
    }
    Some(u64::from_le_bytes(
        payload[4..].try_into().expect("8 bytes"),
    ))
}

/// Returns the header every new segment file starts with.
pub fn segment_header() -> [u8; SEGMENT_HEADER_LEN] {
    let mut h = [0u8; SEGMENT_HEADER_LEN];
    h[..8].copy_from_slice(&SEGMENT_MAGIC);
    h[8..12].copy_from_slice(&SEGMENT_VERSION.to_le_bytes());
    let crc = crc32c::crc32c(&h[..12]);
    h[12..16].copy_from_slice(&crc.to_le_bytes());
    h
}

/// Returns the 8-byte frame header for `block`.
pub fn frame_header(block: &[u8]) -> [u8; FRAME_HEADER_LEN] {
    let len = u32::try_from(block.len()).expect("block larger than 4 GiB");
    assert!(
        len <= FRAME_BYTES_MAX,
        "block of {len} bytes exceeds FRAME_BYTES_MAX"
    );
    let mut h = [0u8; FRAME_HEADER_LEN];
    h[..4].copy_from_slice(&len.to_le_bytes());
    h[4..].copy_from_slice(&crc32c::crc32c(block).to_le_bytes());
    h
}

/// A frame followed by its block, ready to append.
pub fn encode_frame(block: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(FRAME_HEADER_LEN + block.len());
    out.extend_from_slice(&frame_header(block));
    out.extend_from_slice(block);
    out
}

/// Why the segment header is unusable.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum SegmentError {
    #[error("segment file is {0} bytes, shorter than its 16-byte header")]
    ShortHeader(usize),
    #[error("not a segment file: bad magic")]
    BadMagic,
    #[error("segment header checksum mismatch")]
    HeaderChecksum,
    #[error("unsupported segment version {0}; this build reads versions 1 and 2")]
    UnsupportedVersion(u32),
}

/// Why scanning stopped before the end of the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameFault {
    /// Fewer than 8 bytes left for a frame header.
    ShortFrameHeader,
    /// The frame claims more bytes than remain.
    ShortBlock { len: u32 },
    /// The frame length is zero or above [`FRAME_BYTES_MAX`].
    BadLength { len: u32 },
    /// The block bytes do not match the frame checksum.
    Checksum,
}

/// A valid frame found by [`scan`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameRef {
    /// File offset of the frame header.
    pub offset: u64,
    /// Length of the block that follows the frame header.
    pub len: u32,
}

impl FrameRef {
    /// File offset of the block itself.
    pub fn block_offset(&self) -> u64 {
        self.offset + FRAME_HEADER_LEN as u64
    }
    /// File offset just past this frame.
    pub fn end(&self) -> u64 {
        self.block_offset() + u64::from(self.len)
    }

    /// The block bytes of this frame within the scanned segment, or `None` if `segment` is not
    /// the buffer this frame was found in (it is too short).
    pub fn block<'a>(&self, segment: &'a [u8]) -> Option<&'a [u8]> {
        let start = usize::try_from(self.block_offset()).ok()?;
        let end = usize::try_from(self.end()).ok()?;
        segment.get(start..end)
    }
}

/// The result of scanning a segment file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scan {
    /// Valid frames, in file order.
    pub frames: Vec<FrameRef>,
    /// Length of the valid prefix: header plus every valid frame.
    pub valid_len: u64,
    /// Where and why scanning stopped, if it did not reach a clean end of file.
    pub fault: Option<(u64, FrameFault)>,
}

/// Checks the segment header.
pub fn check_header(bytes: &[u8]) -> Result<(), SegmentError> {
    header_version(bytes).map(|_| ())
}

/// Checks the segment header and returns its version (1 or 2).
pub fn header_version(bytes: &[u8]) -> Result<u32, SegmentError> {
    if bytes.len() < SEGMENT_HEADER_LEN {
        return Err(SegmentError::ShortHeader(bytes.len()));
    }
    if bytes[..8] != SEGMENT_MAGIC {
        return Err(SegmentError::BadMagic);
    }
    let crc = u32::from_le_bytes(bytes[12..16].try_into().expect("4 bytes"));
    if crc32c::crc32c(&bytes[..12]) != crc {
        return Err(SegmentError::HeaderChecksum);
    }
    let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    if version != SEGMENT_VERSION && version != SEGMENT_VERSION_V1 {
        return Err(SegmentError::UnsupportedVersion(version));
    }
    Ok(version)
}

/// Scans a whole segment file held in memory, stopping at the first bad frame.
pub fn scan(bytes: &[u8]) -> Result<Scan, SegmentError> {
    check_header(bytes)?;
    Ok(scan_frames(bytes, SEGMENT_HEADER_LEN))
}

/// Scans frames starting at `start`, which must be a frame boundary.
pub fn scan_frames(bytes: &[u8], start: usize) -> Scan {
    let mut frames = Vec::new();
    let mut pos = start;
    let fault = loop {
        if pos == bytes.len() {
            break None;
        }
        match check_frame(bytes, pos) {
            Ok(len) => {
                frames.push(FrameRef {
                    offset: pos as u64,
                    len,
                });
                pos += FRAME_HEADER_LEN + len as usize;
            }
            Err(f) => break Some((pos as u64, f)),
        }
    };
    Scan {
        frames,
        valid_len: pos as u64,
        fault,
    }
}

/// Checks the frame at `pos`, returning the block length. A `pos` past the end is a short
/// frame header, not a panic.
pub fn check_frame(bytes: &[u8], pos: usize) -> Result<u32, FrameFault> {
    let rest = bytes.get(pos..).unwrap_or_default();
    if rest.len() < FRAME_HEADER_LEN {
        return Err(FrameFault::ShortFrameHeader);
    }
    let len = u32::from_le_bytes(rest[..4].try_into().expect("4 bytes"));
    let crc = u32::from_le_bytes(rest[4..8].try_into().expect("4 bytes"));
    if len == 0 || len > FRAME_BYTES_MAX {
        return Err(FrameFault::BadLength { len });
    }
    let body = rest.get(FRAME_HEADER_LEN..FRAME_HEADER_LEN + len as usize);
    let body = body.ok_or(FrameFault::ShortBlock { len })?;
    if crc32c::crc32c(body) != crc {
        return Err(FrameFault::Checksum);
    }
    Ok(len)
}

/// Finds the next offset after `from` where a valid frame starts, to skip a corrupt block.
///
/// Candidates are positions where the block magic `TRBK` sits 8 bytes in; the frame must then
/// pass its checksum, so a false match inside data is vanishingly unlikely.
pub fn resync(bytes: &[u8], from: usize) -> Option<usize> {
    let magic = crate::block::BLOCK_MAGIC;
    let mut pos = from.saturating_add(1);
    while pos.saturating_add(FRAME_HEADER_LEN + magic.len()) <= bytes.len() {
        let at = pos + FRAME_HEADER_LEN;
        if bytes[at..at + magic.len()] == magic && check_frame(bytes, pos).is_ok() {
            return Some(pos);
        }
        pos += 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn segment_with(blocks: &[&[u8]]) -> Vec<u8> {
        let mut out = segment_header().to_vec();
        for b in blocks {
            out.extend_from_slice(&encode_frame(b));
        }
        out
    }

    #[test]
    fn scan_finds_all_frames() {
        let seg = segment_with(&[b"TRBKone", b"TRBKtwo!"]);
        let s = scan(&seg).unwrap();
        assert_eq!(s.frames.len(), 2);
        assert_eq!(s.valid_len as usize, seg.len());
        assert_eq!(s.fault, None);
    }

    #[test]
    fn out_of_range_positions_are_faults_not_panics() {
        let seg = segment_with(&[b"TRBKone"]);
        assert_eq!(
            check_frame(&seg, seg.len() + 5),
            Err(FrameFault::ShortFrameHeader)
        );
        let s = scan_frames(&seg, seg.len() + 5);
        assert_eq!(
            (s.frames.len(), s.fault.map(|f| f.1)),
            (0, Some(FrameFault::ShortFrameHeader))
        );
        assert_eq!(resync(&seg, usize::MAX), None);
        let f = scan(&seg).unwrap().frames[0];
        assert_eq!(f.block(&seg), Some(&b"TRBKone"[..]));
        assert_eq!(f.block(&seg[..seg.len() - 1]), None);
    }

    #[test]
    fn sync_marks_round_trip_and_are_frames() {
        let mut seg = segment_with(&[b"TRBKone"]);
        let at = seg.len();
        seg.extend_from_slice(&encode_sync_mark(at as u64));
        let s = scan(&seg).unwrap();
        assert_eq!((s.frames.len(), s.fault), (2, None));
        let mark = s.frames[1];
        assert_eq!(mark.offset as usize, at);
        assert_eq!(decode_sync_mark(mark.block(&seg).unwrap()), Some(at as u64));
        assert_eq!(decode_sync_mark(s.frames[0].block(&seg).unwrap()), None);
        assert_eq!(header_version(&seg), Ok(SEGMENT_VERSION));
        let mut v1 = seg.clone();
        v1[8..12].copy_from_slice(&SEGMENT_VERSION_V1.to_le_bytes());
        let crc = crc32c::crc32c(&v1[..12]);
        v1[12..16].copy_from_slice(&crc.to_le_bytes());
        assert_eq!(header_version(&v1), Ok(SEGMENT_VERSION_V1));
    }

    #[test]
    fn torn_tail_stops_scan() {
        let seg = segment_with(&[b"TRBKone", b"TRBKtwo!"]);
        let s = scan(&seg[..seg.len() - 1]).unwrap();
        assert_eq!(s.frames.len(), 1);
        assert!(matches!(s.fault, Some((_, FrameFault::ShortBlock { .. }))));
    }
}
