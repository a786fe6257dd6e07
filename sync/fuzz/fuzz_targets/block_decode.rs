//! Fuzz target `block_decode`: The block decoder on arbitrary bytes (header, limits, checksums, body).
//! The body lives in `sync::fuzzing::block_decode` so that the corpus also runs on stable.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| sync::fuzzing::block_decode(data));
