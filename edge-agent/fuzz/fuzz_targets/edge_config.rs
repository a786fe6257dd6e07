//! Fuzz target `edge_config`: arbitrary text as `edge.toml` (`EdgeConfig::from_toml`); a valid config's filters compile.
//! The body is `edge_agent_fuzz::edge_config` (`edge-agent/fuzz/bodies.rs`), which `edge-agent/tests/fuzz_corpus.rs` also runs
//! over `corpus/edge_config/` on stable.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| edge_agent_fuzz::edge_config(data));
