//! NMEA 0183 against the committed fixture `tests/fixtures/track.nmea`: GGA and RMC merged per
//! fix epoch, timestamps from RMC date and time or else the receive time, and a bad checksum
//! and a garbage line counted and reported without stopping the stream.

use std::io::Cursor;
use std::path::PathBuf;

use firmware::nmea::{LINE_BYTES_MAX, NmeaLineError, NmeaParser, NmeaReader, NmeaStats};
use sync::{Record, Value};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/track.nmea")
}

/// 2024-03-15T12:35:19Z in nanoseconds.
const EPOCH_1_NS: i64 = 1_710_506_119_000_000_000;

fn f(r: &Record, name: &str) -> Option<Value> {
    r.field(name).cloned()
}

#[test]
fn fixture_track_parses_into_merged_fixes() {
    let mut reader = NmeaReader::open(&fixture(), "truck-9").unwrap();
    let mut line = 0;
    // Receive time: line n arrives at n microseconds.
    let batch = reader
        .read_batch(1000, || {
            line += 1;
            line * 1000
        })
        .unwrap();
    assert!(batch.eof);
    let r = &batch.records;
    assert_eq!(r.len(), 5, "{r:#?}");
    assert!(r.iter().all(|r| r.key == "truck-9/gps"));

    // Epoch 1: RMC + GGA, timestamped from the sentences.
    assert_eq!(r[0].ts, EPOCH_1_NS);
    assert_eq!(
        r[0].fields,
        vec![
            ("lat".to_owned(), Value::F64(48.1173)),
            ("lon".to_owned(), Value::F64(11.5166667)),
            ("alt_m".to_owned(), Value::F64(545.4)),
            ("speed_kmh".to_owned(), Value::F64(41.48)),
            ("course_deg".to_owned(), Value::F64(84.4)),
            ("fix_quality".to_owned(), Value::I64(1)),
            ("satellites".to_owned(), Value::I64(8)),
            ("hdop".to_owned(), Value::F64(0.9)),
            ("fix_valid".to_owned(), Value::Bool(true)),
        ]
    );
    // Epoch 2: a DGPS fix one second later.
    assert_eq!(r[1].ts, EPOCH_1_NS + 1_000_000_000);
    assert_eq!(f(&r[1], "fix_quality"), Some(Value::I64(2)));
    assert_eq!(f(&r[1], "satellites"), Some(Value::I64(9)));
    // Epoch 3: its RMC had a bad checksum, so only the GGA (line 7) remains: no date, so the
    // receive time, and no speed or course.
    assert_eq!(r[2].ts, 7_000);
    assert_eq!(f(&r[2], "alt_m"), Some(Value::F64(546.2)));
    assert_eq!(f(&r[2], "speed_kmh"), None);
    // Epoch 4: an RMC without a fix still carries date and time.
    assert_eq!(r[3].ts, EPOCH_1_NS + 3_000_000_000);
    assert_eq!(f(&r[3], "fix_valid"), Some(Value::Bool(false)));
    assert_eq!(f(&r[3], "lat"), None);
    // Epoch 5: GGA only, southern and western hemisphere, flushed at the end of the file.
    assert_eq!(r[4].ts, 10_000);
    assert_eq!(f(&r[4], "lat"), Some(Value::F64(-48.1177)));
    assert_eq!(f(&r[4], "lon"), Some(Value::F64(-11.5178667)));

    assert_eq!(batch.errors.len(), 2);
    assert!(matches!(
        batch.errors[0],
        NmeaLineError::Checksum {
            line: 6,
            found: 0x00,
            ..
        }
    ));
    assert!(matches!(
        &batch.errors[1],
        NmeaLineError::Garbage { line: 8, .. }
    ));
    assert_eq!(
        reader.stats(),
        NmeaStats {
            lines: 10,
            sentences: 7,
            ignored: 1,
            checksum_errors: 1,
            garbage: 1,
            records: 5
        }
    );
}

#[test]
fn batches_of_any_size_give_the_same_records() {
    let all = NmeaReader::open(&fixture(), "d")
        .unwrap()
        .read_batch(usize::MAX, || 0)
        .unwrap();
    let mut reader = NmeaReader::open(&fixture(), "d").unwrap();
    let mut records = Vec::new();
    let mut errors = 0;
    for _ in 0..100 {
        let batch = reader.read_batch(3, || 0).unwrap();
        records.extend(batch.records);
        errors += batch.errors.len();
        if batch.eof {
            break;
        }
    }
    assert_eq!(records, all.records);
    assert_eq!(errors, all.errors.len());
}

#[test]
fn endless_garbage_is_bounded_and_counted() {
    // A serial port at the wrong baud rate: no newlines for a long time, then binary noise.
    let mut input = vec![b'~'; LINE_BYTES_MAX * 50];
    input.extend_from_slice(b"\n\xff\xfe\x00garbage\n");
    input.extend_from_slice(b"$GPGGA,123519,4807.038,N,01131.000,E,1,08,0.9,545.4,M,46.9,M,,*47\n");
    let mut reader = NmeaReader::new(Cursor::new(input), "d");
    let batch = reader.read_batch(10, || 5).unwrap();
    assert_eq!(batch.errors.len(), 2);
    assert!(
        batch
            .errors
            .iter()
            .all(|e| matches!(e, NmeaLineError::Garbage { .. }))
    );
    assert!(
        batch.errors.iter().all(|e| e.to_string().len() < 200),
        "errors quote a bounded excerpt"
    );
    assert_eq!(batch.records.len(), 1);
    assert_eq!(batch.records[0].ts, 5);
    assert_eq!(reader.stats().garbage, 2);
}

#[test]
fn malformed_fields_with_a_valid_checksum_are_garbage() {
    let mut parser = NmeaParser::new("d");
    // Latitude "48x7.038" is not a number; the checksum is right for this content.
    let body = "GPGGA,123519,48x7.038,N,01131.000,E,1,08,0.9,545.4,M,46.9,M,,";
    let checksum = body.bytes().fold(0u8, |c, b| c ^ b);
    let line = format!("${body}*{checksum:02X}");
    let err = parser.push_line(&line, 0).unwrap_err();
    assert!(
        matches!(err, NmeaLineError::Garbage { line: 1, .. }),
        "{err}"
    );
    assert_eq!(parser.stats().garbage, 1);
    assert_eq!(parser.flush(), None);
}

#[test]
fn a_repeated_sentence_closes_the_epoch() {
    // Some receivers send GGA only; each GGA then closes the previous one even at equal times.
    let mut parser = NmeaParser::new("d");
    let gga = "$GPGGA,123519,4807.038,N,01131.000,E,1,08,0.9,545.4,M,46.9,M,,*47";
    assert_eq!(parser.push_line(gga, 1).unwrap(), None);
    let first = parser
        .push_line(gga, 2)
        .unwrap()
        .expect("the second GGA closes the first epoch");
    assert_eq!(first.ts, 1);
    assert_eq!(parser.flush().map(|r| r.ts), Some(2));
}

#[test]
fn opening_a_missing_device_names_it() {
    let err = NmeaReader::open(std::path::Path::new("/nonexistent/ttyUSB9"), "d").unwrap_err();
    assert!(err.to_string().contains("/nonexistent/ttyUSB9"), "{err}");
}
