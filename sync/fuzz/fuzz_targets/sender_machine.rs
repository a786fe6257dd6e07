//! Fuzz target `sender_machine`: the edge's sans-IO `protocol::Sender` driven by arbitrary frame sequences and driver calls.
//! The body is `sync_fuzz::sender_machine` (`sync/fuzz/bodies.rs`), which
//! `sync/tests/fuzz_protocol_corpus.rs` also runs over `corpus/sender_machine/` on stable.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| sync_fuzz::sender_machine(data));
