//! The WAL's byte layout: the file header, the entry header each frame starts with, and file
//! naming.

#[allow(unused_imports)]
use super::*;

/// Magic bytes at the start of every WAL file.
pub const WAL_MAGIC: [u8; 8] = *b"TRIBWAL\0";
/// The WAL file version written by this build.
pub const WAL_VERSION: u32 = 1;
/// Size of the WAL file header.
pub const WAL_HEADER_LEN: usize = WAL_MAGIC.len() + 4 + 4;
const _: () = assert!(WAL_HEADER_LEN == 16);

/// Entry kind: a committed block.
pub const KIND_BLOCK: u8 = 1;

pub(super) const OFF_KIND: usize = 0;
pub(super) const OFF_DEVICE: usize = OFF_KIND + 4;
pub(super) const OFF_STREAM: usize = OFF_DEVICE + 4;
pub(super) const OFF_COUNT: usize = OFF_STREAM + 4;
pub(super) const OFF_EPOCH: usize = OFF_COUNT + 4;
pub(super) const OFF_FIRST_SEQ: usize = OFF_EPOCH + 8;
pub(super) const OFF_HUB_OFFSET: usize = OFF_FIRST_SEQ + 8;
pub(super) const OFF_INGEST_TS: usize = OFF_HUB_OFFSET + 8;
pub(super) const OFF_CHECKSUM: usize = OFF_INGEST_TS + 8;
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
    h[..8].copy_from_slice(&WAL_MAGIC);
    h[8..12].copy_from_slice(&WAL_VERSION.to_le_bytes());
    let crc = crc32c::crc32c(&h[..12]);
    h[12..16].copy_from_slice(&crc.to_le_bytes());
    h
}

pub(super) fn header_ok(h: &[u8]) -> bool {
    h.len() >= WAL_HEADER_LEN && h[..WAL_HEADER_LEN] == wal_file_header()
}

/// The path of the WAL file whose first logical offset is `first`.
pub fn wal_file_path(dir: &Path, first: u64) -> PathBuf {
    dir.join(format!("{first:020}.wal"))
}

/// The WAL files in `dir`, by first logical offset.
pub fn list_wal_files(dir: &Path) -> std::io::Result<Vec<u64>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let name = entry?.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(stem) = name.strip_suffix(".wal") else {
            continue;
        };
        if stem.len() == 20
            && let Ok(first) = stem.parse::<u64>()
        {
            out.push(first);
        }
    }
    out.sort_unstable();
    Ok(out)
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
}
