//! Fuzz target `columnar_decode`: the version 2 (columnar) body decoder on arbitrary bytes.
//! The first two bytes are the record count; whatever decodes must re-encode to the same
//! records. The body lives in `sync::columnar::fuzz_decode` so that
//! `sync/tests/columnar_fuzz_corpus.rs` replays the corpus on stable.
//! Every block it decodes is held to the decoded-size contract
//! (`sync::fuzzing::assert_decoded_size`, docs/fuzzing.md).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| sync::columnar::fuzz_decode(data));
