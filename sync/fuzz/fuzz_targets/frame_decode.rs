//! Fuzz target `frame_decode`: one replication protocol frame (`protocol::Frame::decode`); what decodes re-encodes.
//! The body is `sync_fuzz::frame_decode` (`sync/fuzz/bodies.rs`), which
//! `sync/tests/fuzz_protocol_corpus.rs` also runs over `corpus/frame_decode/` on stable.
//! Every block it decodes is held to the decoded-size contract
//! (`sync::fuzzing::assert_decoded_size`, docs/fuzzing.md).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| sync_fuzz::frame_decode(data));
