//! Fuzz target `hub_config`: arbitrary text as the hub's TOML configuration (`HubConfig::from_toml`).
//! The body is `core_hub_fuzz::hub_config` (`core-hub/fuzz/bodies.rs`), which `core-hub/tests/fuzz_corpus.rs` also runs
//! over `corpus/hub_config/` on stable.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| core_hub_fuzz::hub_config(data));
