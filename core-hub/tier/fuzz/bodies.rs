//! Fuzz target bodies for the tier crate: the decoders of what comes back from object storage,
//! where a bit flip, a truncated upload or a foreign file can land.
//!
//! This file is the `tier/fuzz` crate's library, so each cargo-fuzz target is a one-line
//! wrapper, and `tier/tests/fuzz_corpus.rs` compiles the very same file (by path) to replay
//! every committed corpus file on stable Rust. Each function must never panic on any input; it
//! asserts what must hold whenever decoding succeeds.

use bytes::Bytes;
use sync::record::Value;
use tier::{
    EncodeOptions, FieldRegistry, Manifest, TierRecord, ValueKind, decode_chunk, encode_chunk,
};

/// Arbitrary bytes as a tier-2 chunk file (`tier::decode_chunk`). Whatever decodes must
/// re-encode, and decode again to the same records.
pub fn chunk_decode(data: &[u8]) {
    let records = match decode_chunk(Bytes::copy_from_slice(data)) {
        Ok(records) => records,
        Err(e) => {
            assert!(!e.to_string().is_empty(), "errors say what is wrong");
            return;
        }
    };
    if records.is_empty() {
        return;
    }
    let mut registry = FieldRegistry::new();
    registry.observe_records(&records);
    // A foreign file may hold what this crate never writes (two columns for one field); the
    // encoder refuses that with an error, which is fine. What it accepts must round-trip.
    let options = EncodeOptions {
        zstd_level: 1,
        ..EncodeOptions::default()
    };
    let Ok((again, summary)) = encode_chunk(&records, &registry, &options) else {
        return;
    };
    assert_eq!(
        summary.rows,
        records.len() as u64,
        "summary counts every row"
    );
    let back = decode_chunk(again).expect("a chunk this crate encoded decodes");
    assert_eq!(back.len(), records.len(), "same number of rows");
    for (a, b) in records.iter().zip(&back) {
        let a = &as_stored(a, &registry);
        assert!(
            same_record(a, b),
            "round trip changed a record:\n{a:?}\n{b:?}"
        );
    }
}

/// Equality with NaN equal to itself (a float field may hold any bit pattern).
/// `r` as a chunk encoded with `registry` stores it: integers of a field whose number column
/// is DOUBLE read back as doubles.
fn as_stored(r: &TierRecord, registry: &FieldRegistry) -> TierRecord {
    let mut r = r.clone();
    for (name, value) in r.fields.iter_mut() {
        if let Value::I64(v) = *value {
            let col = registry.column_of(name, ValueKind::I64);
            if col.is_some_and(|c| registry.columns()[c].kind == ValueKind::F64) {
                *value = Value::F64(v as f64);
            }
        }
    }
    r
}

fn same_record(a: &TierRecord, b: &TierRecord) -> bool {
    let mut fa = a.fields.clone();
    let mut fb = b.fields.clone();
    // Decoded fields come in column order, which the re-encode may have changed.
    fa.sort_by(|x, y| format!("{x:?}").cmp(&format!("{y:?}")));
    fb.sort_by(|x, y| format!("{x:?}").cmp(&format!("{y:?}")));
    (
        &a.device,
        a.epoch,
        a.seq,
        a.offset,
        &a.key,
        a.ts_ns,
        a.ingest_ts_ns,
    ) == (
        &b.device,
        b.epoch,
        b.seq,
        b.offset,
        &b.key,
        b.ts_ns,
        b.ingest_ts_ns,
    ) && format!("{fa:?}") == format!("{fb:?}")
}

/// Arbitrary bytes as a manifest object (`_tributary/.../*.json`), as recovery from tier 2
/// reads it, plus the field registry rebuilt from its columns.
pub fn manifest_decode(data: &[u8]) {
    let Ok(m) = serde_json::from_slice::<Manifest>(data) else {
        return;
    };
    let _ = m.path();
    match FieldRegistry::from_columns(m.columns.clone()) {
        Ok(reg) => assert_eq!(
            reg.columns(),
            &m.columns[..],
            "a valid registry keeps its order"
        ),
        Err(e) => assert!(!e.to_string().is_empty(), "errors say what is wrong"),
    }
    let text = serde_json::to_vec(&m).expect("a decoded manifest serializes");
    serde_json::from_slice::<Manifest>(&text).expect("a serialized manifest decodes");
}
