//! Fuzz target `mqtt_map`: arbitrary MQTT topic templates, topics and payloads through the MQTT source's `Mapper`.
//! The body is `edge_agent_fuzz::mqtt_map` (`edge-agent/fuzz/bodies.rs`), which `edge-agent/tests/fuzz_corpus.rs` also runs
//! over `corpus/mqtt_map/` on stable.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| edge_agent_fuzz::mqtt_map(data));
