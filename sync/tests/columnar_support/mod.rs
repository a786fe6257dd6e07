//! Record sets shared by the columnar (format version 2) tests, the fixture writer and the fuzz
//! corpus seeds, plus an exact NDJSON form for expected records (floats as raw bits, so NaN
//! payloads and -0.0 survive the text).

#![allow(dead_code)]

use serde_json::{Value as Json, json};
use sync::{Record, Value};

/// Smooth per-device telemetry the way `gen_telemetry.py` shapes it: interleaved keys, short
/// decimals, a counter, flags.
pub fn telemetry(keys: usize, rows: usize) -> Vec<Record> {
    let mut out = Vec::with_capacity(keys * rows);
    for t in 0..rows {
        for k in 0..keys {
            let x = (t as f64 / 10.0 + k as f64).sin();
            out.push(Record {
                tags: Vec::new(),
                key: format!("truck-{k:04}/engine"),
                ts: 1_764_374_400_000_000_000 + t as i64 * 1_000_000_000 + k as i64 * 1_000_003,
                fields: vec![
                    (
                        "engine_temp_c".into(),
                        Value::F64(((70.0 + x * 5.0) * 100.0).round() / 100.0),
                    ),
                    (
                        "oil_bar".into(),
                        Value::F64(((3.0 + x) * 1000.0).round() / 1000.0),
                    ),
                    (
                        "odometer_m".into(),
                        Value::I64(100_000 + (t * (k + 3)) as i64),
                    ),
                    (
                        "lat".into(),
                        Value::F64(((45.0 + x / 100.0) * 1e6).round() / 1e6),
                    ),
                    ("ignition".into(), Value::Bool(t % 17 != 0)),
                ],
            });
        }
    }
    out
}

/// Floats that scaled decimals cannot hold and that must still come back bit for bit.
pub fn odd_floats() -> Vec<f64> {
    vec![
        -0.0,
        0.0,
        f64::NAN,
        f64::from_bits(0x7ff8_dead_beef_0001),
        f64::from_bits(0xfff0_0000_0000_0001),
        f64::INFINITY,
        f64::NEG_INFINITY,
        f64::MIN_POSITIVE / 3.0,
        f64::from_bits(1),
        f64::MAX,
        f64::MIN,
        0.1 + 0.2,
        std::f64::consts::PI,
        1e300,
        -123.456,
    ]
}

/// Records with odd floats, missing fields, a field whose type changes, strings and bytes,
/// unusual field orders and keys.
pub fn odd_records() -> Vec<Record> {
    let mut out = Vec::new();
    for (i, f) in odd_floats().into_iter().enumerate() {
        let i64v = i as i64;
        let mut fields = vec![("v".to_string(), Value::F64(f))];
        if i % 2 == 0 {
            fields.push(("note".into(), Value::Str(format!("état-{}", i % 3))));
        }
        if i % 3 == 0 {
            fields.insert(0, ("raw".into(), Value::Bytes(vec![0, 255, i as u8])));
        }
        // `mode` is an integer in some records and a string or float in others.
        fields.push((
            "mode".into(),
            match i % 3 {
                0 => Value::I64(i64v * 1_000_000_007),
                1 => Value::Str("auto".into()),
                _ => Value::F64(i as f64 / 4.0),
            },
        ));
        out.push(Record {
            tags: Vec::new(),
            key: ["", "a", "ключ/🙂"][i % 3].into(),
            ts: i64::MIN + i64v * 7,
            fields,
        });
    }
    out.push(Record {
        tags: Vec::new(),
        key: "a".into(),
        ts: i64::MAX,
        fields: vec![],
    });
    out.push(Record {
        tags: Vec::new(),
        key: "a".into(),
        ts: 0,
        fields: vec![
            ("on".into(), Value::Bool(true)),
            ("big".into(), Value::I64(i64::MIN)),
        ],
    });
    out
}

/// One record as exact JSON: fields are `[name, type, value]` with f64 as 16 hex digits of
/// its bits and bytes as hex.
pub fn exact_json(r: &Record) -> Json {
    let fields: Vec<Json> = r
        .fields
        .iter()
        .map(|(name, v)| match v {
            Value::F64(f) => json!([name, "f64", format!("{:016x}", f.to_bits())]),
            Value::I64(x) => json!([name, "i64", x]),
            Value::Bool(b) => json!([name, "bool", b]),
            Value::Str(s) => json!([name, "string", s]),
            Value::Bytes(b) => json!([name, "bytes", hex(b)]),
        })
        .collect();
    if r.tags.is_empty() {
        return json!({ "key": r.key, "ts": r.ts, "fields": fields });
    }
    json!({ "key": r.key, "tags": r.tags, "ts": r.ts, "fields": fields })
}

/// Parses what [`exact_json`] wrote.
pub fn from_exact_json(j: &Json) -> anyhow::Result<Record> {
    let field = |f: &Json| -> anyhow::Result<(String, Value)> {
        let name = f[0]
            .as_str()
            .ok_or_else(|| anyhow::anyhow!("field name"))?
            .to_string();
        let v = &f[2];
        let value = match f[1].as_str() {
            Some("f64") => Value::F64(f64::from_bits(u64::from_str_radix(
                v.as_str().unwrap_or(""),
                16,
            )?)),
            Some("i64") => Value::I64(v.as_i64().ok_or_else(|| anyhow::anyhow!("i64"))?),
            Some("bool") => Value::Bool(v.as_bool().ok_or_else(|| anyhow::anyhow!("bool"))?),
            Some("string") => {
                Value::Str(v.as_str().ok_or_else(|| anyhow::anyhow!("string"))?.into())
            }
            Some("bytes") => Value::Bytes(unhex(v.as_str().unwrap_or(""))?),
            other => anyhow::bail!("unknown field type {other:?}"),
        };
        Ok((name, value))
    };
    let fields = j["fields"]
        .as_array()
        .ok_or_else(|| anyhow::anyhow!("fields"))?;
    let tags = match j.get("tags") {
        None => Vec::new(),
        Some(t) => serde_json::from_value(t.clone())?,
    };
    Ok(Record {
        tags,
        key: j["key"]
            .as_str()
            .ok_or_else(|| anyhow::anyhow!("key"))?
            .into(),
        ts: j["ts"].as_i64().ok_or_else(|| anyhow::anyhow!("ts"))?,
        fields: fields.iter().map(field).collect::<anyhow::Result<_>>()?,
    })
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> anyhow::Result<Vec<u8>> {
    anyhow::ensure!(s.len().is_multiple_of(2), "odd hex length");
    (0..s.len())
        .step_by(2)
        .map(|i| Ok(u8::from_str_radix(&s[i..i + 2], 16)?))
        .collect()
}

/// Whether the fixture and corpus writers should (re)write their files.
pub fn write_fixtures() -> bool {
    std::env::var("TRIBUTARY_WRITE_FIXTURES").as_deref() == Ok("1")
}

/// Writes `blocks` as a fixture under `dir`: `blocks.seg`, a segment of blocks sealed with
/// `version` (epoch 3, seqs from 1), and `records.ndjson`, their records in exact form.
pub fn write_fixture(dir: &std::path::Path, blocks: Vec<Vec<Record>>, version: u8) {
    std::fs::create_dir_all(dir).unwrap();
    let mut seg = sync::segment::segment_header().to_vec();
    let mut ndjson = String::new();
    let mut seq = 1u64;
    for records in blocks {
        let b = sync::block::encode_block(version, 3, seq, &records).unwrap();
        seg.extend(sync::segment::encode_frame(&b));
        seq += records.len() as u64;
        for r in &records {
            ndjson.push_str(&exact_json(r).to_string());
            ndjson.push('\n');
        }
    }
    std::fs::write(dir.join("blocks.seg"), seg).unwrap();
    std::fs::write(dir.join("records.ndjson"), ndjson).unwrap();
}
