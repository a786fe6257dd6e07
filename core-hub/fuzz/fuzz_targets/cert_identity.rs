//! Fuzz target `cert_identity`: arbitrary bytes as a device's client certificate (`pki::cert_identity`).
//! The body is `core_hub_fuzz::cert_identity` (`core-hub/fuzz/bodies.rs`), which `core-hub/tests/fuzz_corpus.rs` also runs
//! over `corpus/cert_identity/` on stable.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| core_hub_fuzz::cert_identity(data));
