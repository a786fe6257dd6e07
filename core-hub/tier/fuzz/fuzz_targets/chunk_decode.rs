//! Fuzz target `chunk_decode`: arbitrary bytes as a tier-2 Parquet chunk (`tier::decode_chunk`).
//! The body is `tier_fuzz::chunk_decode` (`tier/fuzz/bodies.rs`), which `tier/tests/fuzz_corpus.rs` also runs
//! over `corpus/chunk_decode/` on stable.
#![no_main]

libfuzzer_sys::fuzz_target!(
    init: {
        // `decode_chunk` turns the parquet crate's asserts on malformed files into errors with
        // `catch_unwind`; the hook libfuzzer-sys installs would abort before that. A panic that
        // escapes the body still aborts: libfuzzer-sys catches it and reports the crash.
        std::panic::set_hook(Box::new(|_| {}));
    },
    |data: &[u8]| tier_fuzz::chunk_decode(data)
);
