//! A field that arrives as integers and as decimals in one stream is one tier-2 column:
//! INT64 while only integers arrived, DOUBLE from the first decimal on (integers written as
//! doubles; files already written keep INT64), or DOUBLE from the start when the stream's
//! config pins it (`[[streams]] types = { temp = "float" }`). The hub ingests, tiers to local
//! Parquet files, and DuckDB reads one numeric `temp` column holding every value, with no
//! `temp__i64`/`temp__f64` second column. A field changing kind (number to string) still gets
//! a column of its own and is counted (docs/format/parquet.md).
//!
//! Needs `python3 -c 'import duckdb'` to work (CI: `pip install duckdb`).

mod tier_support;

use core_hub::tiering::{Tiering, store};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use sync::block::{VERSION_ROWS, encode_block};
use sync::{Record, Value};
use tier_support::*;

/// Records `first..=last` of `dev-1` with one field `temp` from `value(seq)`.
fn records(first: u64, last: u64, value: fn(u64) -> Value) -> Vec<Record> {
    (first..=last)
        .map(|s| Record {
            tags: Vec::new(),
            key: "dev-1/engine".into(),
            ts: 1_764_374_400_000_000_000 + s as i64 * 1_000_000,
            fields: vec![("temp".into(), value(s))],
        })
        .collect()
}

fn int(s: u64) -> Value {
    Value::I64(60 + s as i64)
}

fn dec(s: u64) -> Value {
    Value::F64(70.25 + s as f64)
}

fn text(s: u64) -> Value {
    Value::Str(format!("t{s}"))
}

fn as_f64(v: &Value) -> f64 {
    match v {
        Value::I64(x) => *x as f64,
        Value::F64(x) => *x,
        other => panic!("not a number: {other:?}"),
    }
}

/// A hub with local tier 2 under `dir`, tiering each batch on its own.
async fn hub(
    dir: &Path,
    types: &[(&str, tier::ValueKind)],
) -> (Arc<core_hub::ingest::Hub>, Arc<Tiering>) {
    let root = dir.join("tier2");
    let cfg = common::config(&dir.join("hub"), |c| {
        let t = &mut c.tier2;
        t.url = format!("file://{}", root.display());
        t.chunk_records_max = 1_000;
        t.chunk_age_max = Duration::from_secs(3600);
        t.tier1_budget_bytes = 1 << 40;
        let pins = types.iter().map(|(f, k)| ((*f).to_owned(), *k)).collect();
        t.field_types = BTreeMap::from([("telemetry".to_owned(), pins)]);
    });
    let hub = reopen(&cfg).await;
    let tiering = Tiering::open(hub.clone(), &cfg, None).await.unwrap();
    (hub, tiering)
}

/// Ships each batch as one block and tiers it before the next (one file per batch).
async fn ship(hub: &core_hub::ingest::Hub, t: &Tiering, batches: &[Vec<Record>]) {
    let mut seq = 1;
    for recs in batches {
        let block = encode_block(VERSION_ROWS, 1, seq, recs).unwrap();
        hub.commit_block("dev-1", "telemetry", &block)
            .await
            .unwrap();
        seq += recs.len() as u64;
        flush(t).await;
    }
}

/// DuckDB over the stream's files: the `temp*` columns with their types, and `temp` in seq
/// order.
fn duckdb_temp(root: &Path, union_by_name: bool) -> (Vec<String>, Vec<f64>) {
    let glob = root.join("tier2/streams/telemetry/**/*.parquet");
    let opts = if union_by_name {
        ", union_by_name=true"
    } else {
        ""
    };
    let script = format!(
        r#"
import duckdb, json
g = {glob:?}
c = duckdb.connect()
cols = c.execute(f"SELECT column_name || ' ' || column_type FROM (DESCRIBE SELECT * FROM read_parquet('{{g}}'{opts})) WHERE column_name LIKE 'temp%'").fetchall()
vals = c.execute(f"SELECT temp FROM read_parquet('{{g}}'{opts}) ORDER BY seq").fetchall()
print(json.dumps([[r[0] for r in cols], [r[0] for r in vals]]))
"#,
        glob = glob.display().to_string()
    );
    let v = duckdb_json(&script);
    let cols = v[0]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_str().unwrap().to_owned())
        .collect();
    let vals = v[1]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    (cols, vals)
}

fn expected(batches: &[Vec<Record>]) -> Vec<f64> {
    batches
        .iter()
        .flatten()
        .map(|r| as_f64(&r.fields[0].1))
        .collect()
}

fn catalog_columns(hub: &core_hub::ingest::Hub) -> Vec<(String, tier::ValueKind)> {
    let stream = hub.stream_id("telemetry").expect("stream");
    store::fields(hub.catalog(), stream)
        .unwrap()
        .into_iter()
        .map(|c| (c.name, c.kind))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn integers_then_decimals_read_as_one_column() {
    let dir = tempfile::tempdir().unwrap();
    let (hub, t) = hub(dir.path(), &[]).await;
    let batches = [
        records(1, 20, int),
        records(21, 40, dec),
        records(41, 60, int),
    ];
    ship(&hub, &t, &batches).await;
    assert_eq!(
        catalog_columns(&hub),
        [("temp".to_owned(), tier::ValueKind::F64)]
    );
    let (cols, vals) = duckdb_temp(dir.path(), true);
    assert_eq!(cols, ["temp DOUBLE"]);
    assert_eq!(vals, expected(&batches));
    assert_eq!(t.stats().field_kind_changes.load(Ordering::Relaxed), 0);
    hub.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decimals_then_integers_read_as_one_column() {
    let dir = tempfile::tempdir().unwrap();
    let (hub, t) = hub(dir.path(), &[]).await;
    let batches = [records(1, 20, dec), records(21, 40, int)];
    ship(&hub, &t, &batches).await;
    // The first file is DOUBLE already: the plain glob reads every value too.
    for union_by_name in [false, true] {
        let (cols, vals) = duckdb_temp(dir.path(), union_by_name);
        assert_eq!(cols, ["temp DOUBLE"], "union_by_name {union_by_name}");
        assert_eq!(vals, expected(&batches), "union_by_name {union_by_name}");
    }
    hub.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pinned_field_is_double_from_the_first_file() {
    let dir = tempfile::tempdir().unwrap();
    let (hub, t) = hub(dir.path(), &[("temp", tier::ValueKind::F64)]).await;
    let batches = [records(1, 20, int), records(21, 40, dec)];
    ship(&hub, &t, &batches).await;
    for union_by_name in [false, true] {
        let (cols, vals) = duckdb_temp(dir.path(), union_by_name);
        assert_eq!(cols, ["temp DOUBLE"], "union_by_name {union_by_name}");
        assert_eq!(vals, expected(&batches), "union_by_name {union_by_name}");
    }
    hub.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kind_change_gets_its_own_column_and_is_counted() {
    let dir = tempfile::tempdir().unwrap();
    let (hub, t) = hub(dir.path(), &[]).await;
    ship(&hub, &t, &[records(1, 20, int), records(21, 30, text)]).await;
    assert_eq!(
        catalog_columns(&hub),
        [
            ("temp".to_owned(), tier::ValueKind::I64),
            ("temp__str".to_owned(), tier::ValueKind::Str)
        ]
    );
    assert_eq!(t.stats().field_kind_changes.load(Ordering::Relaxed), 1);
    hub.shutdown();
}
