//! Shared by the decoded-size tests: hand-made block bodies (bombs), a per-thread counting
//! allocator, and the check that a bomb is refused before anything is allocated for it.
#![allow(dead_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use sync::block::{self, BlockError, BlockHeader, DecodeLimits, VERSION_COLUMNAR};
use sync::varint;

/// Counts the bytes each thread allocates, so that tests running in parallel do not disturb
/// each other's figures.
struct Counting;

thread_local! {
    static ALLOCATED: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: forwards every call to the system allocator unchanged; the counter is a
// const-initialised thread-local that never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCATED.try_with(|a| a.set(a.get() + layout.size() as u64));
        // SAFETY: the caller's contract is passed through.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract is passed through.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Runs `f` and returns its result with the bytes this thread allocated meanwhile.
pub fn allocated_by<T>(f: impl FnOnce() -> T) -> (T, u64) {
    let before = ALLOCATED.with(Cell::get);
    let out = f();
    (out, ALLOCATED.with(Cell::get) - before)
}

/// A block with valid checksums around `raw`, whatever it claims.
pub fn forge(version: u8, raw: &[u8], count: u32) -> Vec<u8> {
    let body = zstd::bulk::compress(raw, 3).unwrap();
    let h = BlockHeader {
        version,
        flags: 0,
        epoch: 1,
        first_seq: 1,
        count,
        raw_len: raw.len() as u32,
        min_ts: 0,
        max_ts: 0,
        body_len: body.len() as u32,
        body_crc: crc32c::crc32c(&body),
        raw_crc: crc32c::crc32c(raw),
    };
    let mut out = block::write_header(&h).to_vec();
    out.extend_from_slice(&body);
    out
}

/// An integer column of `n` plain zeros (every id 0, every ts 0).
pub fn zeros_col(out: &mut Vec<u8>, n: usize) {
    out.push(0);
    varint::put_bytes(out, &vec![0u8; n]);
}

/// A version 2 body: one key, the given columns (name, type), one shape listing `shape`, `n`
/// records of key 0 and shape 0 with ts 0, then the columns' own bytes.
pub fn columnar(key: &str, cols: &[(&str, u8)], shape: &[u64], n: usize, fields: &[u8]) -> Vec<u8> {
    let mut b = vec![0u8];
    varint::put_u64(&mut b, 1);
    varint::put_bytes(&mut b, key.as_bytes());
    varint::put_u64(&mut b, cols.len() as u64);
    for (name, tag) in cols {
        varint::put_bytes(&mut b, name.as_bytes());
        b.push(*tag);
    }
    varint::put_u64(&mut b, 1);
    varint::put_u64(&mut b, shape.len() as u64);
    for &c in shape {
        varint::put_u64(&mut b, c);
    }
    for _ in 0..3 {
        zeros_col(&mut b, n);
    }
    b.extend_from_slice(fields);
    b
}

/// The one-key bomb: a key of `key_len` bytes named once, and `n` records that each copy it.
pub fn key_bomb(key_len: usize, n: usize) -> Vec<u8> {
    forge(
        VERSION_COLUMNAR,
        &columnar(&"k".repeat(key_len), &[], &[], n, &[]),
        n as u32,
    )
}

/// Decodes `bytes` and checks that it is refused for its decoded size, having allocated no more
/// than its decompressed body and a little bookkeeping. Returns a summary line, or what failed.
pub fn check_refused(bytes: &[u8], limits: &DecodeLimits) -> Result<String, String> {
    let raw_len = u64::from(block::decode_header(bytes).unwrap().raw_len);
    let (result, allocated) = allocated_by(|| block::decode_block(bytes, limits));
    let Err(BlockError::DecodedTooLarge { size, limit }) = result else {
        return Err(format!(
            "not refused for its decoded size ({} allocated): {:?}",
            allocated,
            result.map(|b| b.records.len())
        ));
    };
    if limit != limits.decoded_bytes_max || size <= limit {
        return Err(format!("refused with size {size}, limit {limit}"));
    }
    if allocated >= raw_len + (1 << 20) {
        return Err(format!(
            "{allocated} bytes allocated for a {raw_len}-byte body (decoded size {size})"
        ));
    }
    Ok(format!(
        "{} bytes sealed, {size} decoded, {allocated} allocated",
        bytes.len()
    ))
}
