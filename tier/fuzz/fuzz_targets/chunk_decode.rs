//! Fuzz target `chunk_decode`: arbitrary bytes as a tier-2 Parquet chunk (`tier::decode_chunk`).
//! The body is `tier_fuzz::chunk_decode` (`tier/fuzz/bodies.rs`), which `tier/tests/fuzz_corpus.rs` also runs
//! over `corpus/chunk_decode/` on stable.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tier_fuzz::chunk_decode(data));
