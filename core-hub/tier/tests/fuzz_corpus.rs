//! Replays the committed corpus of every cargo-fuzz target in `tier/fuzz/` on stable Rust,
//! through the same function the target calls (`tier/fuzz/bodies.rs`, compiled here by path),
//! so the corpora are regression tests in `cargo test` even where nightly and libFuzzer are
//! absent. A crash `cargo fuzz` finds is fixed, then its input goes into the target's corpus,
//! where this test keeps it fixed. See docs/fuzzing.md.
//!
//! `TRIBUTARY_WRITE_FIXTURES=1` (re)writes the hand-made seeds (`seed-*`); without it, the test
//! checks that they are all present. Seeds are inputs, not golden outputs, so a newer Parquet
//! writer producing other bytes does not fail anything.

#[path = "../fuzz/bodies.rs"]
mod bodies;
#[path = "../../../sync/fuzz/replay.rs"]
mod replay;

use sync::record::Value;
use tier::{
    ChunkSummary, ColumnSpec, EncodeOptions, FieldRegistry, Manifest, SeqRange, TierRecord,
    ValueKind, encode_chunk,
};

use replay::Target;

const TARGETS: [(&str, Target); 2] = [
    ("chunk_decode", bodies::chunk_decode),
    ("manifest_decode", bodies::manifest_decode),
];

fn records() -> Vec<TierRecord> {
    (0..12u64)
        .map(|i| TierRecord {
            tags: Vec::new(),
            device: format!("dev-{}", i % 2),
            epoch: 1,
            seq: i / 2 + 1,
            offset: i,
            key: format!("truck-{}/engine", i % 3),
            ts_ns: 1_700_000_000_000_000_000 + i as i64 * 1_000_000_007,
            ingest_ts_ns: 1_700_000_001_000_000_000 + i as i64 * 1_000,
            fields: match i % 3 {
                0 => vec![
                    ("temp".into(), Value::F64(20.5 + i as f64)),
                    ("rpm".into(), Value::I64(1000 + i as i64)),
                ],
                1 => vec![
                    ("ok".into(), Value::Bool(i % 2 == 0)),
                    ("note".into(), Value::Str(format!("n{i}"))),
                ],
                _ => vec![
                    ("blob".into(), Value::Bytes(vec![i as u8; 3])),
                    // The same field with another type gets its own column.
                    ("temp".into(), Value::I64(i as i64)),
                ],
            },
        })
        .collect()
}

fn chunk(options: &EncodeOptions) -> Vec<u8> {
    let records = records();
    let mut registry = FieldRegistry::new();
    registry.observe_records(&records);
    encode_chunk(&records, &registry, options)
        .unwrap()
        .0
        .to_vec()
}

fn manifest() -> Manifest {
    Manifest {
        version: 1,
        stream: "telemetry".into(),
        segment: 3,
        first_offset: 100,
        end_offset: 112,
        path: "streams/telemetry/ingest_date=2026-11-29/seg-3-100.parquet".into(),
        summary: ChunkSummary {
            rows: 12,
            bytes: 4096,
            min_offset: 100,
            max_offset: 111,
            min_ts_ns: 1,
            max_ts_ns: 2,
            min_ingest_ts_ns: 3,
            max_ingest_ts_ns: 4,
            seq_ranges: vec![SeqRange {
                device: "dev-0".into(),
                epoch: 1,
                min_seq: 1,
                max_seq: 6,
                count: 6,
            }],
        },
        columns: vec![
            ColumnSpec {
                name: "temp".into(),
                field: "temp".into(),
                kind: ValueKind::F64,
            },
            ColumnSpec {
                name: "temp__i64".into(),
                field: "temp".into(),
                kind: ValueKind::I64,
            },
        ],
        hash_lo: i64::MIN,
        hash_hi: 0,
        segment_start: 90,
        preds: vec![1, 2],
        committed_ns: 1_700_000_000_000_000_000,
        extra: serde_json::json!({"note": "x"}),
    }
}

fn seeds() -> Vec<(&'static str, &'static str, Vec<u8>)> {
    let plain = chunk(&EncodeOptions {
        zstd_level: 1,
        ..EncodeOptions::default()
    });
    let tuned = chunk(&EncodeOptions {
        zstd_level: 1,
        row_group_rows: 5,
        key_bloom_filter: false,
        float_byte_stream_split: true,
        metadata: vec![("stream".into(), "telemetry".into())],
    });
    let mut flipped = plain.clone();
    let mid = flipped.len() / 2;
    flipped[mid] ^= 0x10;
    let manifest_json = serde_json::to_vec_pretty(&manifest()).unwrap();
    let mut dup_columns = manifest();
    dup_columns.columns.push(dup_columns.columns[0].clone());
    vec![
        ("chunk_decode", "seed-chunk.parquet", plain.clone()),
        ("chunk_decode", "seed-chunk-tuned.parquet", tuned),
        (
            "chunk_decode",
            "seed-chunk-truncated.parquet",
            plain[..plain.len() - 9].to_vec(),
        ),
        ("chunk_decode", "seed-chunk-flipped.parquet", flipped),
        (
            "chunk_decode",
            "seed-magic-only.parquet",
            b"PAR1PAR1".to_vec(),
        ),
        ("manifest_decode", "seed-manifest.json", manifest_json),
        (
            "manifest_decode",
            "seed-manifest-dup-columns.json",
            serde_json::to_vec(&dup_columns).unwrap(),
        ),
        (
            "manifest_decode",
            "seed-not-json.json",
            b"{\"version\":".to_vec(),
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
fn damaged_chunks_fail_with_a_reason() {
    let plain = chunk(&EncodeOptions::default());
    for bad in [&plain[..plain.len() / 2], &b"PAR1"[..], &[][..]] {
        let e = tier::decode_chunk(bytes::Bytes::copy_from_slice(bad)).unwrap_err();
        assert!(
            e.to_string().starts_with("reading parquet: "),
            "unclear error: {e}"
        );
    }
}
