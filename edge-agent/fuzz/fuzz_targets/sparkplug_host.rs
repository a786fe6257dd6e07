//! Fuzz target `sparkplug_host`: arbitrary Sparkplug B topics and payloads, in sequence, through one `sparkplug::Host`.
//! The body is `edge_agent_fuzz::sparkplug_host` (`edge-agent/fuzz/bodies.rs`), which `edge-agent/tests/fuzz_corpus.rs` also runs
//! over `corpus/sparkplug_host/` on stable.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| edge_agent_fuzz::sparkplug_host(data));
