//! Table-driven tests of each filter stage: predicates, deadband, downsampling, tumbling windows
//! and projection, with window boundaries, out-of-order timestamps, missing fields and type
//! mismatches. Bad data must be counted, never panic.

use std::sync::atomic::Ordering;

use edge_agent::filters::{Agg, CompileError, DownsampleMode, Pipeline, StageSpec, predicate};
use sync::{Record, Value};

fn rec(key: &str, ts: i64, fields: &[(&str, Value)]) -> Record {
    Record {
        tags: Vec::new(),
        key: key.into(),
        ts,
        fields: fields
            .iter()
            .map(|(n, v)| ((*n).to_owned(), v.clone()))
            .collect(),
    }
}

fn f(x: f64) -> Value {
    Value::F64(x)
}

fn run(specs: &[StageSpec], input: Vec<Record>) -> (Vec<Record>, Pipeline) {
    let mut p = Pipeline::compile(specs).unwrap();
    let mut out = Vec::new();
    for r in input {
        p.push(r, &mut out);
    }
    (out, p)
}

fn stat(p: &Pipeline) -> (u64, u64, u64) {
    let s = p.stats();
    (
        s.missing_fields.load(Ordering::Relaxed),
        s.type_mismatches.load(Ordering::Relaxed),
        s.late_records.load(Ordering::Relaxed),
    )
}

#[test]
fn predicates() {
    let r = rec(
        "k",
        0,
        &[
            ("temp", f(4.0)),
            ("n", Value::I64(3)),
            ("site", Value::Str("x".into())),
            ("on", Value::Bool(true)),
        ],
    );
    // (expression, expected, missing, mismatches)
    let cases = [
        ("temp > 3.5", true, 0, 0),
        ("temp >= 4", true, 0, 0),
        ("temp < 4", false, 0, 0),
        ("n == 3", true, 0, 0),
        ("n != 3", false, 0, 0),
        ("site == \"x\"", true, 0, 0),
        ("on == true", true, 0, 0),
        ("exists(temp) and not exists(humidity)", true, 0, 0),
        ("temp > 10 or (site == \"x\" and n <= 3)", true, 0, 0),
        ("not (temp > 3.5)", false, 0, 0),
        ("humidity > 1", false, 1, 0),
        ("site > 1", false, 0, 1),
        ("temp == \"4\"", false, 0, 1),
        ("not humidity > 1", true, 1, 0),
        ("temp > -1e3", true, 0, 0),
    ];
    for (text, want, missing, mismatch) in cases {
        let p = predicate::compile(text).unwrap_or_else(|e| panic!("{text}: {e}"));
        let stats = edge_agent::filters::FilterStats::default();
        assert_eq!(p.eval(&r, &stats), want, "{text}");
        assert_eq!(
            stats.missing_fields.load(Ordering::Relaxed),
            missing,
            "{text}"
        );
        assert_eq!(
            stats.type_mismatches.load(Ordering::Relaxed),
            mismatch,
            "{text}"
        );
    }
    for bad in [
        "",
        "temp >",
        "temp = 3",
        "(temp > 1",
        "temp > 1 extra",
        "\"x\" == temp",
        "a > \"x",
        "exists(1)",
    ] {
        assert!(predicate::compile(bad).is_err(), "{bad:?} should not parse");
    }
    let e = Pipeline::compile(&[StageSpec::Where("temp >".into())]).unwrap_err();
    assert!(matches!(e, CompileError::Stage { stage: 0, .. }));
}

#[test]
fn deadband() {
    let spec = [StageSpec::Deadband {
        field: "v".into(),
        threshold: 1.0,
    }];
    // (key, value or None for a missing field, kept)
    let cases: [(&str, Option<Value>, bool); 8] = [
        ("a", Some(f(10.0)), true),
        ("a", Some(f(10.5)), false),
        ("a", Some(f(11.0)), true), // exactly the threshold from the last kept value
        ("b", Some(f(10.4)), true), // per key
        ("a", Some(Value::I64(9)), true),
        ("a", None, true),                         // missing: passes, counted
        ("a", Some(Value::Str("x".into())), true), // mismatch: passes, counted
        ("a", Some(f(9.5)), false),
    ];
    let input: Vec<Record> = cases
        .iter()
        .enumerate()
        .map(|(i, (k, v, _))| match v {
            Some(v) => rec(k, i as i64, &[("v", v.clone())]),
            None => rec(k, i as i64, &[("w", f(0.0))]),
        })
        .collect();
    let (out, p) = run(&spec, input);
    let kept: Vec<i64> = out.iter().map(|r| r.ts).collect();
    let want: Vec<i64> = cases
        .iter()
        .enumerate()
        .filter(|(_, c)| c.2)
        .map(|(i, _)| i as i64)
        .collect();
    assert_eq!(kept, want);
    assert_eq!(stat(&p), (1, 1, 0));
    assert!(
        Pipeline::compile(&[StageSpec::Deadband {
            field: "v".into(),
            threshold: f64::NAN
        }])
        .is_err()
    );
}

#[test]
fn windows() {
    let spec = [StageSpec::Window {
        interval_ns: 10,
        field: "v".into(),
        aggs: vec![Agg::Count, Agg::Min, Agg::Max, Agg::Mean, Agg::Last],
    }];
    let input = vec![
        rec("a", 0, &[("v", f(1.0))]),
        rec("a", 9, &[("v", f(3.0))]), // last ns of window [0, 10)
        rec("b", 5, &[("v", f(100.0))]),
        rec("a", 4, &[("v", f(2.0))]), // out of order, same window: counted in
        rec("a", 10, &[("v", f(7.0))]), // first ns of the next window: closes [0, 10)
        rec("a", 3, &[("v", f(5.0))]), // late: its window already closed
        rec("a", 15, &[("x", f(5.0))]), // missing field
        rec("a", 16, &[("v", Value::Str("hot".into()))]), // type mismatch
        rec("a", -5, &[("v", f(0.0))]), // before the epoch, late
        rec("a", 35, &[("v", Value::I64(1))]), // skips a window: closes [10, 20)
    ];
    let (out, p) = run(&spec, input);
    assert_eq!(out.len(), 2, "{out:?}");
    assert_eq!(out[0].key, "a");
    assert_eq!(out[0].ts, 0);
    let names: Vec<&str> = out[0].fields.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["v.count", "v.min", "v.max", "v.mean", "v.last"]);
    assert_eq!(out[0].fields[0].1, Value::I64(3));
    assert_eq!(out[0].fields[1].1, f(1.0));
    assert_eq!(out[0].fields[2].1, f(3.0));
    assert_eq!(out[0].fields[3].1, f(2.0));
    assert_eq!(out[0].fields[4].1, f(2.0)); // last by arrival
    assert_eq!(out[1].ts, 10);
    assert_eq!(out[1].fields[0].1, Value::I64(1));
    assert_eq!(stat(&p), (1, 1, 2));
    // Negative timestamps fall into the window below them.
    let (out, _) = run(
        &spec,
        vec![
            rec("n", -1, &[("v", f(1.0))]),
            rec("n", 0, &[("v", f(2.0))]),
        ],
    );
    assert_eq!(out[0].ts, -10);
}

#[test]
fn downsampling() {
    for (mode, want) in [
        (DownsampleMode::Last, vec![(7, 3.0)]),
        (DownsampleMode::Mean, vec![(0, 2.0)]),
    ] {
        let spec = [StageSpec::Downsample {
            interval_ns: 10,
            mode,
        }];
        let input = vec![
            rec("a", 1, &[("v", f(1.0)), ("s", Value::Str("x".into()))]),
            rec("a", 7, &[("v", f(3.0))]),
            rec("a", 12, &[("v", f(9.0))]),
            rec("a", 2, &[("v", f(0.0))]), // late
        ];
        let (out, p) = run(&spec, input);
        let got: Vec<(i64, f64)> = out
            .iter()
            .map(|r| {
                let v = r.fields.iter().find(|(n, _)| n == "v").unwrap();
                match v.1 {
                    Value::F64(x) => (r.ts, x),
                    _ => panic!("{r:?}"),
                }
            })
            .collect();
        assert_eq!(got, want, "{mode:?}");
        assert_eq!(stat(&p).2, 1);
    }
}

#[test]
fn projection_and_chaining() {
    let spec = [
        StageSpec::Where("exists(temp)".into()),
        StageSpec::Project(vec![
            ("temp".into(), Some("t".into())),
            ("site".into(), None),
        ]),
    ];
    let input = vec![
        rec(
            "a",
            1,
            &[
                ("temp", f(1.0)),
                ("x", f(2.0)),
                ("site", Value::Str("s".into())),
            ],
        ),
        rec("a", 2, &[("x", f(2.0))]),
    ];
    let (out, _) = run(&spec, input);
    assert_eq!(out.len(), 1);
    assert_eq!(
        out[0].fields,
        vec![
            ("t".into(), f(1.0)),
            ("site".into(), Value::Str("s".into()))
        ]
    );
    // A record with none of the projected fields is dropped.
    let (out, _) = run(
        &[StageSpec::Project(vec![("zzz".into(), None)])],
        vec![rec("a", 1, &[("x", f(1.0))])],
    );
    assert!(out.is_empty());
    // The empty pipeline passes records through.
    let (out, _) = run(&[], vec![rec("a", 1, &[("x", f(1.0))])]);
    assert_eq!(out.len(), 1);
}
