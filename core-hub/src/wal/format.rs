//! The WAL's byte layout: the file header, the frame and the entry header each frame starts
//! with, and file naming. Every offset is derived from the one before it and every size is
//! asserted at compile time; `docs/format/wal.md` is the specification, and the checked-in
//! fixture (`fixtures/v1.wal`) is a file of every released version, tested to still read.

use crate::catalog::{DeviceId, StreamId};
use crate::storage::Storage;
use std::path::{Path, PathBuf};
use sync::segment::{FRAME_BYTES_MAX, FRAME_HEADER_LEN};

/// Magic bytes at the start of every WAL file.
pub const WAL_MAGIC: [u8; 8] = *b"TRIBWAL\0";
/// The WAL file version written by this build.
pub const WAL_VERSION: u32 = 1;
const HDR_MAGIC: usize = 0;
const HDR_VERSION: usize = HDR_MAGIC + WAL_MAGIC.len();
const HDR_CRC: usize = HDR_VERSION + 4;
/// Size of the WAL file header.
pub const WAL_HEADER_LEN: usize = HDR_CRC + 4;
const _: () = assert!(WAL_HEADER_LEN == 16);

/// Entry kind: a committed block.
pub const KIND_BLOCK: u8 = 1;

const OFF_KIND: usize = 0;
const OFF_DEVICE: usize = OFF_KIND + 4;
const OFF_STREAM: usize = OFF_DEVICE + 4;
const OFF_COUNT: usize = OFF_STREAM + 4;
const OFF_EPOCH: usize = OFF_COUNT + 4;
const OFF_FIRST_SEQ: usize = OFF_EPOCH + 8;
const OFF_HUB_OFFSET: usize = OFF_FIRST_SEQ + 8;
const OFF_INGEST_TS: usize = OFF_HUB_OFFSET + 8;
const OFF_CHECKSUM: usize = OFF_INGEST_TS + 8;
/// Size of the entry header that precedes each block in a frame.
pub const ENTRY_HEADER_LEN: usize = OFF_CHECKSUM + 8;
const _: () = assert!(ENTRY_HEADER_LEN == 56);

/// The entry header of a WAL frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EntryHeader {
    pub kind: u8,
    pub device: DeviceId,
    pub stream: StreamId,
    pub count: u32,
    pub epoch: u64,
    pub first_seq: u64,
    pub hub_offset_base: u64,
    pub ingest_ts: i64,
    pub checksum: u64,
}

impl EntryHeader {
    /// Serialises the header.
    pub fn encode(&self) -> [u8; ENTRY_HEADER_LEN] {
        let mut b = [0u8; ENTRY_HEADER_LEN];
        b[OFF_KIND] = self.kind;
        b[OFF_DEVICE..OFF_STREAM].copy_from_slice(&self.device.to_le_bytes());
        b[OFF_STREAM..OFF_COUNT].copy_from_slice(&self.stream.to_le_bytes());
        b[OFF_COUNT..OFF_EPOCH].copy_from_slice(&self.count.to_le_bytes());
        b[OFF_EPOCH..OFF_FIRST_SEQ].copy_from_slice(&self.epoch.to_le_bytes());
        b[OFF_FIRST_SEQ..OFF_HUB_OFFSET].copy_from_slice(&self.first_seq.to_le_bytes());
        b[OFF_HUB_OFFSET..OFF_INGEST_TS].copy_from_slice(&self.hub_offset_base.to_le_bytes());
        b[OFF_INGEST_TS..OFF_CHECKSUM].copy_from_slice(&self.ingest_ts.to_le_bytes());
        b[OFF_CHECKSUM..OFF_CHECKSUM + 8].copy_from_slice(&self.checksum.to_le_bytes());
        b
    }

    /// Parses a header; `None` if `b` is too short.
    pub fn decode(b: &[u8]) -> Option<EntryHeader> {
        let b = b.get(..ENTRY_HEADER_LEN)?;
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
        Some(EntryHeader {
            kind: b[OFF_KIND],
            device: u32_at(OFF_DEVICE),
            stream: u32_at(OFF_STREAM),
            count: u32_at(OFF_COUNT),
            epoch: u64_at(OFF_EPOCH),
            first_seq: u64_at(OFF_FIRST_SEQ),
            hub_offset_base: u64_at(OFF_HUB_OFFSET),
            ingest_ts: u64_at(OFF_INGEST_TS) as i64,
            checksum: u64_at(OFF_CHECKSUM),
        })
    }
}

/// The header every WAL file starts with.
pub fn wal_file_header() -> [u8; WAL_HEADER_LEN] {
    let mut h = [0u8; WAL_HEADER_LEN];
    h[HDR_MAGIC..HDR_VERSION].copy_from_slice(&WAL_MAGIC);
    h[HDR_VERSION..HDR_CRC].copy_from_slice(&WAL_VERSION.to_le_bytes());
    let crc = crc32c::crc32c(&h[..HDR_CRC]);
    h[HDR_CRC..WAL_HEADER_LEN].copy_from_slice(&crc.to_le_bytes());
    h
}

pub(super) fn header_ok(h: &[u8]) -> bool {
    h.len() >= WAL_HEADER_LEN && h[..WAL_HEADER_LEN] == wal_file_header()
}

/// The path of the WAL file whose first logical offset is `first`.
pub fn wal_file_path(dir: &Path, first: u64) -> PathBuf {
    dir.join(format!("{first:020}.wal"))
}

/// The WAL files in `dir` on the real file system, by first logical offset.
pub fn list_wal_files(dir: &Path) -> std::io::Result<Vec<u64>> {
    list_wal_files_in(&crate::storage::RealStorage, dir)
}

/// The WAL files in `dir` on `storage`, by first logical offset.
pub fn list_wal_files_in(storage: &dyn Storage, dir: &Path) -> std::io::Result<Vec<u64>> {
    let mut out: Vec<u64> = storage
        .list(dir)?
        .iter()
        .filter_map(|name| name.strip_suffix(".wal"))
        .filter(|stem| stem.len() == 20)
        .filter_map(|stem| stem.parse().ok())
        .collect();
    out.sort_unstable();
    Ok(out)
}

/// The bytes a frame of a `block_len`-byte block takes in the log.
pub fn frame_len(block_len: usize) -> usize {
    FRAME_HEADER_LEN + ENTRY_HEADER_LEN + block_len
}

/// Appends the frame of `block` under `header` to `buf`: length, checksum, entry header,
/// block. The checksum covers the payload (entry header and block) and is computed from its
/// two parts, so the block is copied once.
pub fn encode_frame(buf: &mut Vec<u8>, header: &EntryHeader, block: &[u8]) {
    let entry = header.encode();
    let payload_len = ENTRY_HEADER_LEN + block.len();
    assert!(
        payload_len <= FRAME_BYTES_MAX as usize,
        "frame over the maximum"
    );
    let crc = crc32c::crc32c_append(crc32c::crc32c(&entry), block);
    buf.extend_from_slice(&(payload_len as u32).to_le_bytes());
    buf.extend_from_slice(&crc.to_le_bytes());
    buf.extend_from_slice(&entry);
    buf.extend_from_slice(block);
}

/// A frame's header: the payload length and its checksum.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    pub payload_len: u32,
    pub crc: u32,
}

impl FrameHeader {
    /// Parses the frame header at the start of `b`.
    pub fn decode(b: &[u8; FRAME_HEADER_LEN]) -> FrameHeader {
        let payload_len = u32::from_le_bytes(b[..4].try_into().expect("4 bytes"));
        let crc = u32::from_le_bytes(b[4..].try_into().expect("4 bytes"));
        FrameHeader { payload_len, crc }
    }

    /// Whether a payload of this length can be a WAL entry at all.
    pub fn len_ok(&self) -> bool {
        self.payload_len >= ENTRY_HEADER_LEN as u32 && self.payload_len <= FRAME_BYTES_MAX
    }
}

/// Why a frame did not verify.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("frame shorter than its headers")]
    Short,
    #[error("bad frame length")]
    BadLength,
    #[error("frame checksum mismatch")]
    Checksum,
}

/// Verifies one whole frame (`buf` is exactly the frame) and splits it into its entry header
/// and block. The one check both recovery and readers apply.
pub fn verify_frame(buf: &[u8]) -> Result<(EntryHeader, &[u8]), FrameError> {
    let fh: &[u8; FRAME_HEADER_LEN] = buf
        .get(..FRAME_HEADER_LEN)
        .and_then(|b| b.try_into().ok())
        .ok_or(FrameError::Short)?;
    let fh = FrameHeader::decode(fh);
    if !fh.len_ok() {
        return Err(FrameError::BadLength);
    }
    if fh.payload_len as usize + FRAME_HEADER_LEN != buf.len() {
        return Err(FrameError::BadLength);
    }
    let payload = &buf[FRAME_HEADER_LEN..];
    if crc32c::crc32c(payload) != fh.crc {
        return Err(FrameError::Checksum);
    }
    let header = EntryHeader::decode(payload).ok_or(FrameError::Short)?;
    Ok((header, &payload[ENTRY_HEADER_LEN..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_header_round_trips() {
        let h = EntryHeader {
            kind: KIND_BLOCK,
            device: 7,
            stream: 9,
            count: 3,
            epoch: u64::MAX,
            first_seq: 11,
            hub_offset_base: 1 << 40,
            ingest_ts: -5,
            checksum: 0xdead_beef_0bad_f00d,
        };
        assert_eq!(EntryHeader::decode(&h.encode()), Some(h));
        assert_eq!(EntryHeader::decode(&[0u8; 10]), None);
    }

    fn fixture_header() -> EntryHeader {
        EntryHeader {
            kind: KIND_BLOCK,
            device: 1,
            stream: 2,
            count: 3,
            epoch: 4,
            first_seq: 5,
            hub_offset_base: 6,
            ingest_ts: 7,
            checksum: 8,
        }
    }

    /// A version-1 file: the header and one frame of the block `b"fixture block"`.
    const FIXTURE_V1: &[u8] = include_bytes!("fixtures/v1.wal");

    #[test]
    fn the_v1_fixture_still_reads() {
        assert_eq!(FIXTURE_V1[..WAL_HEADER_LEN], wal_file_header());
        assert!(header_ok(FIXTURE_V1));
        let (h, block) = verify_frame(&FIXTURE_V1[WAL_HEADER_LEN..]).unwrap();
        assert_eq!(h, fixture_header());
        assert_eq!(block, b"fixture block");
        // What this build writes is byte for byte the fixture.
        let mut now = wal_file_header().to_vec();
        encode_frame(&mut now, &fixture_header(), b"fixture block");
        assert_eq!(now, FIXTURE_V1);
    }

    #[test]
    fn damaged_frames_are_named() {
        let mut f = Vec::new();
        encode_frame(&mut f, &fixture_header(), b"abc");
        assert_eq!(frame_len(3), f.len());
        assert_eq!(verify_frame(&f[..7]).unwrap_err(), FrameError::Short);
        assert_eq!(
            verify_frame(&f[..f.len() - 1]).unwrap_err(),
            FrameError::BadLength
        );
        let last = f.len() - 1;
        f[last] ^= 1;
        assert_eq!(verify_frame(&f).unwrap_err(), FrameError::Checksum);
    }
}
