//! Fuzz target `block_body_decode`: The block body decoders, reached past the checksums: a valid header and zstd frame are built around the input.
//! The body lives in `sync::fuzzing::block_body_decode` so that the corpus also runs on stable.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| sync::fuzzing::block_body_decode(data));
