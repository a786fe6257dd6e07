//! Fuzz target `ndjson_parse`: The NDJSON ingest parser; successes must write back and re-parse identically.
//! The body lives in `sync::fuzzing::ndjson_parse` so that the corpus also runs on stable.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| sync::fuzzing::ndjson_parse(data));
