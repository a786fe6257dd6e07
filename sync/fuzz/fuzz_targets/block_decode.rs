//! Fuzz target `block_decode`: The block decoder on arbitrary bytes (header, limits, checksums, body).
//! The body lives in `sync::fuzzing::block_decode` so that the corpus also runs on stable.
//! Every block it decodes is held to the decoded-size contract
//! (`sync::fuzzing::assert_decoded_size`, docs/fuzzing.md).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| sync::fuzzing::block_decode(data));
