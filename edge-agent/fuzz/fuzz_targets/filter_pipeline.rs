//! Fuzz target `filter_pipeline`: arbitrary JSON as a filter pipeline snapshot (`Pipeline::restore`), then records through it.
//! The body is `edge_agent_fuzz::filter_pipeline` (`edge-agent/fuzz/bodies.rs`), which `edge-agent/tests/fuzz_corpus.rs` also runs
//! over `corpus/filter_pipeline/` on stable.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| edge_agent_fuzz::filter_pipeline(data));
