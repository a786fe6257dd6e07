//! Fuzz target `filter_predicate`: arbitrary text as a filter `where` expression, compiled and evaluated.
//! The body is `edge_agent_fuzz::filter_predicate` (`edge-agent/fuzz/bodies.rs`), which `edge-agent/tests/fuzz_corpus.rs` also runs
//! over `corpus/filter_predicate/` on stable.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| edge_agent_fuzz::filter_predicate(data));
