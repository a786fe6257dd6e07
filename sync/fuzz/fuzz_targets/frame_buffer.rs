//! Fuzz target `frame_buffer`: a transport byte stream split into frames (`protocol::FrameBuffer`) in arbitrary chunks.
//! The body is `sync_fuzz::frame_buffer` (`sync/fuzz/bodies.rs`), which
//! `sync/tests/fuzz_protocol_corpus.rs` also runs over `corpus/frame_buffer/` on stable.
//! Every block it decodes is held to the decoded-size contract
//! (`sync::fuzzing::assert_decoded_size`, docs/fuzzing.md).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| sync_fuzz::frame_buffer(data));
