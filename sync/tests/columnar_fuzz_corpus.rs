//! Replays the `columnar_decode` fuzz corpus (`sync/fuzz/corpus/columnar_decode/`) through
//! the same function the fuzz target calls, so every input the fuzzer kept is checked on stable
//! in `cargo test`.
//!
//! `TRIBUTARY_WRITE_FIXTURES=1` (re)writes the seed inputs (`seed-*`): valid bodies of varied
//! record sets, each prefixed with its record count, plus damaged copies. Seeds named
//! `seed-valid-*` must decode; everything must at least not panic.

mod columnar_support;

use std::path::{Path, PathBuf};

use columnar_support::{odd_records, telemetry, write_fixtures};
use sync::columnar::{self, FloatChoice, Tuning};
use sync::{Record, Value};

fn corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/columnar_decode")
}

fn framed(records: &[Record], tuning: &Tuning) -> Vec<u8> {
    let mut out = u16::try_from(records.len())
        .expect("seed sets are small")
        .to_le_bytes()
        .to_vec();
    out.extend(columnar::encode_with(records, tuning).expect("encode"));
    out
}

fn seeds() -> Vec<(String, Vec<u8>)> {
    let strings: Vec<Record> = (0..40)
        .map(|i| Record {
            tags: Vec::new(),
            key: format!("k{}", i % 4),
            ts: i * 1000,
            fields: vec![
                (
                    "state".into(),
                    Value::Str(["idle", "run", "fault"][i as usize % 3].into()),
                ),
                ("blob".into(), Value::Bytes(vec![i as u8; (i % 5) as usize])),
            ],
        })
        .collect();
    let sets = [
        ("telemetry", telemetry(4, 12)),
        ("odd", odd_records()),
        ("strings", strings),
    ];
    let tunings = [
        ("auto", Tuning::default()),
        (
            "gorilla",
            Tuning {
                floats: FloatChoice::Gorilla,
                ..Tuning::default()
            },
        ),
        (
            "raw",
            Tuning {
                floats: FloatChoice::Raw,
                ..Tuning::default()
            },
        ),
        (
            "global",
            Tuning {
                per_key: false,
                ..Tuning::default()
            },
        ),
    ];
    let mut out = Vec::new();
    for (set, records) in &sets {
        for (mode, tuning) in &tunings {
            let bytes = framed(records, tuning);
            let cut = bytes[..bytes.len() * 2 / 3].to_vec();
            out.push((format!("seed-valid-{set}-{mode}"), bytes));
            out.push((format!("seed-truncated-{set}-{mode}"), cut));
        }
    }
    out
}

#[test]
fn corpus_replays_without_panics() {
    let dir = corpus_dir();
    if write_fixtures() {
        std::fs::create_dir_all(&dir).unwrap();
        for (name, bytes) in seeds() {
            std::fs::write(dir.join(name), bytes).unwrap();
        }
    }
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert!(
        files.len() >= 20,
        "corpus at {} has only {} inputs",
        dir.display(),
        files.len()
    );
    for path in &files {
        let data = std::fs::read(path).unwrap();
        columnar::fuzz_decode(&data);
        let name = path.file_name().unwrap().to_string_lossy();
        if name.starts_with("seed-valid-") {
            let count = u32::from(u16::from_le_bytes([data[0], data[1]]));
            assert!(
                columnar::decode(&data[2..], count).is_ok(),
                "{name} must decode"
            );
        }
    }
}

#[test]
fn seeds_on_disk_match_the_current_encoder_or_still_decode() {
    // Seeds are inputs, not golden outputs: an improved encoder may write different bytes, but
    // every checked-in valid seed must keep decoding to the records it was made from.
    for (name, bytes) in seeds()
        .into_iter()
        .filter(|(n, _)| n.starts_with("seed-valid-"))
    {
        let path = corpus_dir().join(&name);
        let Ok(on_disk) = std::fs::read(&path) else {
            panic!(
                "missing seed {}; run with TRIBUTARY_WRITE_FIXTURES=1",
                path.display()
            );
        };
        let count = u32::from(u16::from_le_bytes([bytes[0], bytes[1]]));
        let want = columnar::decode(&bytes[2..], count).unwrap();
        assert_eq!(
            columnar::decode(&on_disk[2..], count).unwrap(),
            want,
            "{name}"
        );
    }
}

/// A valid body whose decoded size is over the fuzz limit: 2,100 records sharing one 4,000-byte
/// key and one 4,000-byte dictionary string, a few KiB encoded and about 17 MB decoded.
fn bomb() -> Vec<u8> {
    let s = "s".repeat(4000);
    let records: Vec<Record> = (0..2100)
        .map(|i| Record {
            tags: Vec::new(),
            key: "k".repeat(4000),
            ts: i,
            fields: vec![("s".into(), Value::Str(s.clone()))],
        })
        .collect();
    framed(&records, &Tuning::default())
}

#[test]
fn the_bomb_seed_is_sized_over_the_limit_and_passes_the_target() {
    let path = corpus_dir().join("seed-bomb-shared-key");
    if write_fixtures() {
        std::fs::write(&path, bomb()).unwrap();
    }
    let data = std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; run with TRIBUTARY_WRITE_FIXTURES=1",
            path.display()
        )
    });
    let count = u32::from(u16::from_le_bytes([data[0], data[1]]));
    let size = columnar::decoded_size(&data[2..], count).unwrap();
    let limit = sync::fuzzing::fuzz_limits().decoded_bytes_max;
    assert!(
        size > limit,
        "the bomb seed decodes to {size} bytes, not over {limit}"
    );
    assert!(data.len() < 64 << 10, "the bomb seed is small on the wire");
    // The target takes the refusal path on it: the block decoder refuses it as too large.
    columnar::fuzz_decode(&data);
}
