//! Fuzz target `segment_scan`: The segment reader: arbitrary bytes as a segment file, every frame decoded.
//! The body lives in `sync::fuzzing::segment_scan` so that the corpus also runs on stable.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| sync::fuzzing::segment_scan(data));
