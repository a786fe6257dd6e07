//! Fuzz target `segment_scan`: The segment reader: arbitrary bytes as a segment file, every frame decoded.
//! The body lives in `sync::fuzzing::segment_scan` so that the corpus also runs on stable.
//! Every block it decodes is held to the decoded-size contract
//! (`sync::fuzzing::assert_decoded_size`, docs/fuzzing.md).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| sync::fuzzing::segment_scan(data));
