//! Replays the committed corpus of every cargo-fuzz target in `firmware/fuzz/` on stable Rust,
//! through the same function the target calls (`firmware/fuzz/bodies.rs`, compiled here by
//! path), so the corpora are regression tests in `cargo test` even where nightly and libFuzzer
//! are absent. A crash `cargo fuzz` finds is fixed, then its input goes into the target's
//! corpus, where this test keeps it fixed. See docs/fuzzing.md.
//!
//! `TRIBUTARY_WRITE_FIXTURES=1` (re)writes the hand-made seeds (`seed-*`); without it, the test
//! checks that they are all present.

#[path = "../fuzz/bodies.rs"]
mod bodies;
#[path = "../../sync/fuzz/replay.rs"]
mod replay;

use std::path::PathBuf;

use replay::Target;

const TARGETS: [(&str, Target); 1] = [("nmea_read", bodies::nmea_read)];

fn seeds() -> Vec<(&'static str, &'static str, Vec<u8>)> {
    let track =
        std::fs::read(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/track.nmea"))
            .unwrap();
    let gga = b"$GPGGA,123519,4807.038,N,01131.000,E,1,08,0.9,545.4,M,46.9,M,,*47\r\n".to_vec();
    let mut long = b"$GPGGA,".to_vec();
    long.resize(400, b'9');
    long.extend_from_slice(b"*00\n");
    vec![
        ("nmea_read", "seed-track.nmea", track),
        ("nmea_read", "seed-gga-crlf.nmea", gga),
        (
            "nmea_read",
            "seed-bad-checksum.nmea",
            b"$GPGGA,123519,4807.038,N,01131.000,E,1,08,0.9,545.4,M,46.9,M,,*48\n".to_vec(),
        ),
        (
            "nmea_read",
            "seed-rmc-no-date.nmea",
            b"$GNRMC,235959.99,V,,,,,,,,,,N*00\n$GPGGA,,,,,,0,,,,,,,,*66\n".to_vec(),
        ),
        ("nmea_read", "seed-too-long.nmea", long),
        (
            "nmea_read",
            "seed-garbage.nmea",
            b"\x00\xff garbage\n$\n*\n$GPGSV,1*\n\n$GPRMC,1,2,3*zz".to_vec(),
        ),
    ]
}

#[test]
fn every_corpus_file_passes_its_target() {
    replay::replay(env!("CARGO_MANIFEST_DIR"), &TARGETS);
}

#[test]
fn seeds_are_on_disk() {
    replay::seeds_on_disk(env!("CARGO_MANIFEST_DIR"), seeds());
}

#[test]
fn checksum_repair_reaches_the_sentence_parser() {
    // The fuzz body recomputes checksums so that mutated sentences reach the `nmea` parser;
    // a sentence with a wrong checksum must come out with the right one.
    let fixed = bodies::with_valid_checksums(
        b"$GPGGA,123519,4807.038,N,01131.000,E,1,08,0.9,545.4,M,46.9,M,,*48\r\nx\n$A",
    );
    assert_eq!(
        fixed,
        b"$GPGGA,123519,4807.038,N,01131.000,E,1,08,0.9,545.4,M,46.9,M,,*47\r\nx\n$A*41"
    );
}
