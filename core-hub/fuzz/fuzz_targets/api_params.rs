//! Fuzz target `api_params`: arbitrary text through the hub's small parsers of request and file input (read start, group positions, query times, API URLs, revocation list, republish topics).
//! The body is `core_hub_fuzz::api_params` (`core-hub/fuzz/bodies.rs`), which `core-hub/tests/fuzz_corpus.rs` also runs
//! over `corpus/api_params/` on stable.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| core_hub_fuzz::api_params(data));
