//! Fuzz target `cut_token`: arbitrary text as a stream-cut token (`Cut::parse`); valid cuts round-trip.
//! The body is `core_hub_fuzz::cut_token` (`core-hub/fuzz/bodies.rs`), which `core-hub/tests/fuzz_corpus.rs` also runs
//! over `corpus/cut_token/` on stable.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| core_hub_fuzz::cut_token(data));
