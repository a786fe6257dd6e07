//! Fuzz target bodies for the firmware crate: its one decoder of outside input, the NMEA 0183
//! reader that a GPS receiver feeds over a serial line.
//!
//! This file is the `firmware/fuzz` crate's library, so each cargo-fuzz target is a one-line
//! wrapper, and `firmware/tests/fuzz_corpus.rs` compiles the very same file (by path) to replay
//! every committed corpus file on stable Rust. Each function must never panic on any input; it
//! asserts what must hold whenever decoding succeeds.

use firmware::nmea::{NmeaLineError, NmeaReader};
use sync::Value;

const DEVICE: &str = "dev7";

/// Arbitrary bytes as a serial GPS stream, read in small batches until the end. The input is
/// read twice: as it is, and with every `$...` line's checksum recomputed, because a fuzzer
/// rarely guesses a checksum and the sentence parser behind it is the interesting part.
pub fn nmea_read(data: &[u8]) {
    read_all(data);
    read_all(&with_valid_checksums(data));
}

fn read_all(data: &[u8]) {
    let mut reader = NmeaReader::new(data, DEVICE);
    let mut clock = 0i64;
    let (mut records, mut errors) = (0u64, 0u64);
    // Each batch reads at least one line or ends the input; the bound is only a backstop.
    for _ in 0..=data.len() + 1 {
        let batch = reader
            .read_batch(7, || {
                clock += 1_000_000;
                clock
            })
            .expect("reading a byte slice never fails");
        for r in &batch.records {
            assert_eq!(
                r.key,
                format!("{DEVICE}/gps"),
                "records are keyed by device"
            );
            assert!(!r.fields.is_empty(), "a position record has fields");
            for (name, v) in &r.fields {
                if let Value::F64(x) = v {
                    assert!(x.is_finite(), "field {name} is not finite: {x}");
                }
            }
        }
        for e in &batch.errors {
            let text = e.to_string();
            assert!(
                text.starts_with("NMEA line "),
                "errors name the line: {text}"
            );
            if let NmeaLineError::Garbage { reason, .. } = e {
                assert!(!reason.is_empty(), "garbage errors say why");
            }
        }
        records += batch.records.len() as u64;
        errors += batch.errors.len() as u64;
        if batch.eof {
            let s = reader.stats();
            assert_eq!(s.records, records, "every record is counted");
            assert_eq!(
                s.checksum_errors + s.garbage,
                errors,
                "every bad line is counted"
            );
            assert!(
                s.sentences + s.ignored + s.checksum_errors + s.garbage <= s.lines,
                "no line is counted twice: {s:?}"
            );
            return;
        }
    }
    panic!("the reader never reached the end of {} bytes", data.len());
}

/// The input with each line that starts with `$` given a correct `*XX` checksum.
pub fn with_valid_checksums(data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(data.len() + 8);
    for line in data.split_inclusive(|&b| b == b'\n') {
        let (body, eol) = match line.strip_suffix(b"\r\n") {
            Some(b) => (b, &b"\r\n"[..]),
            None => match line.strip_suffix(b"\n") {
                Some(b) => (b, &b"\n"[..]),
                None => (line, &b""[..]),
            },
        };
        match body.strip_prefix(b"$") {
            Some(rest) => {
                let payload = match rest.iter().rposition(|&b| b == b'*') {
                    Some(i) => &rest[..i],
                    None => rest,
                };
                let sum = payload.iter().fold(0u8, |a, b| a ^ b);
                out.push(b'$');
                out.extend_from_slice(payload);
                out.extend_from_slice(format!("*{sum:02X}").as_bytes());
            }
            None => out.extend_from_slice(body),
        }
        out.extend_from_slice(eol);
    }
    out
}
