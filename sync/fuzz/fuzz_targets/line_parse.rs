//! Fuzz target `line_parse`: The line-protocol ingest parser.
//! The body lives in `sync::fuzzing::line_parse` so that the corpus also runs on stable.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| sync::fuzzing::line_parse(data));
