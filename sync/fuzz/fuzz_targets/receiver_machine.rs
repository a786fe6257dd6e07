//! Fuzz target `receiver_machine`: the hub's sans-IO `protocol::Receiver` driven by arbitrary frame sequences and driver calls.
//! The body is `sync_fuzz::receiver_machine` (`sync/fuzz/bodies.rs`), which
//! `sync/tests/fuzz_protocol_corpus.rs` also runs over `corpus/receiver_machine/` on stable.
//! Every block it decodes is held to the decoded-size contract
//! (`sync::fuzzing::assert_decoded_size`, docs/fuzzing.md).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| sync_fuzz::receiver_machine(data));
