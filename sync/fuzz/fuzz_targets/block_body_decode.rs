//! Fuzz target `block_body_decode`: The block body decoders, reached past the checksums: a valid header and zstd frame are built around the input.
//! The body lives in `sync::fuzzing::block_body_decode` so that the corpus also runs on stable.
//! Every block it decodes is held to the decoded-size contract
//! (`sync::fuzzing::assert_decoded_size`, docs/fuzzing.md).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| sync::fuzzing::block_body_decode(data));
