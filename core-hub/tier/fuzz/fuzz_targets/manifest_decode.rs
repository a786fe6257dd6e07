//! Fuzz target `manifest_decode`: arbitrary bytes as a tier-2 manifest (JSON), and its column registry.
//! The body is `tier_fuzz::manifest_decode` (`tier/fuzz/bodies.rs`), which `tier/tests/fuzz_corpus.rs` also runs
//! over `corpus/manifest_decode/` on stable.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tier_fuzz::manifest_decode(data));
