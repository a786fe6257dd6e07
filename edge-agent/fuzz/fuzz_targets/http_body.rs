//! Fuzz target `http_body`: arbitrary ingest request bodies and content types (`http::parse_body`).
//! The body is `edge_agent_fuzz::http_body` (`edge-agent/fuzz/bodies.rs`), which `edge-agent/tests/fuzz_corpus.rs` also runs
//! over `corpus/http_body/` on stable.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| edge_agent_fuzz::http_body(data));
