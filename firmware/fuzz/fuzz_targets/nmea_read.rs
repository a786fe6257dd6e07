//! Fuzz target `nmea_read`: arbitrary bytes as a serial GPS stream (`nmea::NmeaReader`).
//! The body is `firmware_fuzz::nmea_read` (`firmware/fuzz/bodies.rs`), which `firmware/tests/fuzz_corpus.rs` also runs
//! over `corpus/nmea_read/` on stable.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| firmware_fuzz::nmea_read(data));
