//! Table-driven tests of the NDJSON parser: each case is an input and the exact rendering of
//! what it parses to, or of the error (line, column, expected, found).
//!
//! The rendering is deliberately compact and type-explicit (`12i` is an i64, `12.0` an f64), so
//! a change in typing or in an error position shows up as a one-line diff.

use sync::parse::{
    FIELDS_MAX, LINE_BYTES_MAX, ParseOptions, parse_json_fields, parse_line_protocol, parse_ndjson,
    parse_ndjson_with, write_ndjson,
};
use sync::time::TimeUnit;
use sync::{Record, Value};

fn render_value(v: &Value) -> String {
    match v {
        Value::F64(f) => format!("{f:?}"),
        Value::I64(i) => format!("{i}i"),
        Value::Bool(b) => b.to_string(),
        Value::Str(s) => format!("{s:?}"),
        Value::Bytes(b) => format!(
            "0x{}",
            b.iter().map(|x| format!("{x:02x}")).collect::<String>()
        ),
    }
}

fn render(records: &[Record]) -> String {
    let lines: Vec<String> = records
        .iter()
        .map(|r| {
            let fields: Vec<String> = r
                .fields
                .iter()
                .map(|(n, v)| format!("{n}={}", render_value(v)))
                .collect();
            let tags: Vec<String> = r.tags.iter().map(|(n, v)| format!("{n}={v:?}")).collect();
            let tags = match tags.is_empty() {
                true => String::new(),
                false => format!(" {{{}}}", tags.join(",")),
            };
            format!("{}{tags} @{} {}", r.key, r.ts, fields.join(" "))
        })
        .collect();
    lines.join("\n")
}

fn check_with(input: &str, opts: &ParseOptions, expected: &str) {
    let actual = match parse_ndjson_with(input, opts) {
        Ok(records) => render(&records),
        Err(e) => format!("error: {e}"),
    };
    assert_eq!(actual, expected, "input: {input:?}");
}

fn check(input: &str, expected: &str) {
    check_with(input, &ParseOptions::default(), expected);
}

#[test]
fn canonical_shape() {
    check(
        r#"{"key":"truck-0007/engine","ts":1764374400000000000,"fields":{"engine_temp_c":71.28,"odometer_m":12345,"ignition":true,"note":"x"}}"#,
        r#"truck-0007/engine @1764374400000000000 engine_temp_c=71.28 odometer_m=12345i ignition=true note="x""#,
    );
}

#[test]
fn tags_give_the_key_unless_one_is_given() {
    let cases = [
        (
            r#"{"tags":{"unit":"engine","device":"truck-0007"},"ts":1,"fields":{"t":1.5}}"#,
            r#"device=truck-0007/unit=engine {unit="engine",device="truck-0007"} @1 t=1.5"#,
        ),
        (
            r#"{"key":"k","tags":{"host":"gw/1"},"ts":1,"fields":{"host":"x"}}"#,
            r#"k {host="gw/1"} @1 host="x""#,
        ),
        (
            r#"{"tags":{"p":"a/b=c%"},"ts":1,"fields":{}}"#,
            r#"p=a%2Fb%3Dc%25 {p="a/b=c%"} @1 "#,
        ),
    ];
    for (input, expected) in cases {
        check(input, expected);
        let records = parse_ndjson(input).unwrap();
        let again = parse_ndjson(&write_ndjson(&records).unwrap()).unwrap();
        assert_eq!(again, records, "write and parse again: {input}");
    }
}

#[test]
fn layout_is_free() {
    let cases = [
        // Member order, whitespace, CRLF and blank lines.
        (
            "\n  { \"fields\" : { \"a\" : -0.0 } , \"ts\" : -5 , \"key\" : \"k\" }\r\n\n\t\n",
            "k @-5 a=-0.0",
        ),
        (
            "{\"key\":\"a\",\"ts\":1,\"fields\":{\"x\":1}}\n{\"key\":\"b\",\"ts\":2,\"fields\":{\"x\":2}}",
            "a @1 x=1i\nb @2 x=2i",
        ),
        ("", ""),
        ("\n\r\n   \n", ""),
    ];
    for (input, expected) in cases {
        check(input, expected);
    }
}

#[test]
fn numbers_are_typed_and_exact() {
    let cases = [
        ("0", "0i"),
        ("-12", "-12i"),
        ("9223372036854775807", "9223372036854775807i"),
        ("-9223372036854775808", "-9223372036854775808i"),
        ("12.0", "12.0"),
        ("1e3", "1000.0"),
        ("-1.5E-3", "-0.0015"),
        ("2E+2", "200.0"),
        ("71.28", "71.28"),
        ("0.1", "0.1"),
        ("5e-324", "5e-324"),
        ("2.2250738585072011e-308", "2.225073858507201e-308"),
        ("1.7976931348623157e308", "1.7976931348623157e308"),
        ("-0.0", "-0.0"),
        ("1e-400", "0.0"),
    ];
    for (number, expected) in cases {
        let input = format!(r#"{{"key":"k","ts":1,"fields":{{"v":{number}}}}}"#);
        check(&input, &format!("k @1 v={expected}"));
    }
    // Correct rounding: the parsed value is the f64 nearest to the decimal.
    let records = parse_ndjson(r#"{"key":"k","ts":1,"fields":{"v":71.28}}"#).unwrap();
    assert_eq!(records[0].field("v"), Some(&Value::F64(71.28)));
}

#[test]
fn strings_bytes_and_bools() {
    let cases = [
        (
            r#""a\"b\\c\/d\n\t\u00e9\ud83d\ude00""#,
            r#"s="a\"b\\c/d\n\té😀""#,
        ),
        (r#""""#, r#"s="""#),
        (r#""ünï""#, r#"s="ünï""#),
        (r#"{"$bytes":"AQID"}"#, "s=0x010203"),
        (r#"{ "$bytes" : "AQ==" }"#, "s=0x01"),
        (r#"{"$bytes":"AQ"}"#, "s=0x01"),
        (r#"{"$bytes":""}"#, "s=0x"),
        ("true", "s=true"),
        ("false", "s=false"),
    ];
    for (value, expected) in cases {
        let input = format!(r#"{{"key":"k","ts":1,"fields":{{"s":{value}}}}}"#);
        check(&input, &format!("k @1 {expected}"));
    }
}

#[test]
fn default_timestamp_applies_only_when_ts_is_missing_or_null() {
    let opts = ParseOptions {
        default_ts: Some(77),
        ..ParseOptions::default()
    };
    check_with(r#"{"key":"k","fields":{"a":1}}"#, &opts, "k @77 a=1i");
    check_with(
        r#"{"key":"k","ts":null,"fields":{"a":1}}"#,
        &opts,
        "k @77 a=1i",
    );
    check_with(r#"{"key":"k","ts":5,"fields":{"a":1}}"#, &opts, "k @5 a=1i");
    // A record may carry no fields at all: an event marker.
    check_with(r#"{"key":"k","fields":{ }}"#, &opts, "k @77 ");
}

#[test]
fn errors_name_line_column_expected_and_found() {
    let ok = r#"{"key":"k","ts":1,"fields":{"a":1}}"#;
    let cases = [
        // The example from the docs: the third line's "ts" is a string.
        (
            format!(
                "{ok}\n{ok}\n{}",
                r#"{"key":"k","ts":"abc","fields":{"a":1}}"#
            ),
            r#"line 3, column 17: expected an RFC 3339 time for "ts" such as "2025-12-01T12:00:00.5+01:00" (premature end of input), found "abc""#,
        ),
        (
            r#"{"key":"k","fields":{"a":1}}"#.into(),
            r#"line 1, column 28: expected a "ts" member (an integer in the precision, or an RFC 3339 string), found }"#,
        ),
        (
            r#"{"ts":1,"fields":{"a":1}}"#.into(),
            r#"line 1, column 25: expected a "key" member (or "tags"), found }"#,
        ),
        (
            r#"{"key":"k","ts":1}"#.into(),
            r#"line 1, column 18: expected a "fields" member, found }"#,
        ),
        (
            r#"{"key":"k","ts":1,"fields":{"gps":{"lat":1}}}"#.into(),
            // Nested objects and arrays flatten; null is no field (the MQTT mapping too).
            "k @1 gps.lat=1i",
        ),
        (
            r#"{"key":"k","ts":1,"fields":{"v":[1,2]}}"#.into(),
            "k @1 v.0=1i v.1=2i",
        ),
        (r#"{"key":"k","ts":1,"fields":{"v":null}}"#.into(), "k @1 "),
        (
            r#"{"key":"k","ts":1,"fields":{"a":1,"a":2}}"#.into(),
            r#"line 1, column 35: expected a field name not already used in this record, found "a""#,
        ),
        (
            r#"{"key":"k","key":"j","ts":1,"fields":{"a":1}}"#.into(),
            r#"line 1, column 12: expected each member at most once, found "key""#,
        ),
        (
            r#"{"key":"k","tag":{},"ts":1,"fields":{"a":1}}"#.into(),
            r#"line 1, column 12: expected one of the members "key", "tags", "ts" or "fields", found "tag""#,
        ),
        (
            r#"{"tags":{"a":1},"ts":1,"fields":{}}"#.into(),
            r#"line 1, column 14: expected a non-empty string for tag "a", found 1"#,
        ),
        (
            r#"{"tags":{"a":"x","a":"y"},"ts":1,"fields":{}}"#.into(),
            r#"line 1, column 18: expected a non-empty tag name not already used, found "a""#,
        ),
        (
            r#"{"tags":{"a":""},"ts":1,"fields":{}}"#.into(),
            r#"line 1, column 14: expected a non-empty string for tag "a", found """#,
        ),
        (
            r#"{"tags":{},"ts":1,"fields":{}}"#.into(),
            r#"line 1, column 30: expected a "key" member (or "tags"), found }"#,
        ),
        (
            r#"{"key":"k","ts":1,"fields":{"a":9223372036854775808}}"#.into(),
            r#"line 1, column 33: expected an integer within the i64 range for field "a" (or a number with a decimal point), found 9223372036854775808"#,
        ),
        (
            r#"{"key":"k","ts":1,"fields":{"a":1e400}}"#.into(),
            r#"line 1, column 33: expected a finite number for field "a", found 1e400"#,
        ),
        (
            r#"{"key":"k","ts":1.5,"fields":{"a":1}}"#.into(),
            r#"line 1, column 17: expected an integer (in the precision, ns by default) or an RFC 3339 string for "ts", found 1.5"#,
        ),
        (
            r#"{"key":"k","ts":99999999999999999999,"fields":{"a":1}}"#.into(),
            r#"line 1, column 17: expected an integer within the i64 range for "ts", found 99999999999999999999"#,
        ),
        (
            r#"{"key":"k","ts":1,"fields":{"a":012}}"#.into(),
            r#"line 1, column 33: expected a number without leading zeros, found 012"#,
        ),
        (
            r#"{"key":"k","ts":1,"fields":{"a":1.}}"#.into(),
            r#"line 1, column 33: expected digits after the decimal point, found 1."#,
        ),
        (
            r#"{"key":"k","ts":1,"fields":{"a":1e}}"#.into(),
            r#"line 1, column 33: expected digits in the exponent, found 1e"#,
        ),
        (
            r#"{"key":"k","ts":1,"fields":{"a":12abc}}"#.into(),
            r#"line 1, column 33: expected a number, found 12abc"#,
        ),
        (
            r#"{"key":"k","ts":1,"fields":{"a":-}}"#.into(),
            r#"line 1, column 33: expected a number, found -"#,
        ),
        (
            r#"{"key":"k","ts":1,"fields":{"a":tru}}"#.into(),
            r#"line 1, column 33: expected a number, string, bool or {"$bytes":"<base64>"} for field "a", found tru"#,
        ),
        (
            r#"{"key":"k\x","ts":1,"fields":{"a":1}}"#.into(),
            r#"line 1, column 10: expected a JSON escape (\" \\ \/ \b \f \n \r \t or \uXXXX), found \x""#,
        ),
        (
            r#"{"key":"k\ud800","ts":1,"fields":{"a":1}}"#.into(),
            r#"line 1, column 10: expected a \uXXXX escape of a valid character, found \ud800""#,
        ),
        (
            r#"{"key":"k\u12","ts":1,"fields":{"a":1}}"#.into(),
            r#"line 1, column 10: expected a \uXXXX escape of a valid character, found \u12""#,
        ),
        (
            r#"{"key":"k"#.into(),
            r#"line 1, column 10: expected a closing '"' ending the string, found end of line"#,
        ),
        (
            "{\"key\":\"a\tb\",\"ts\":1,\"fields\":{\"a\":1}}".into(),
            r#"line 1, column 10: expected a control character escaped as \u00XX, found the control character U+0009"#,
        ),
        (
            format!("{ok} x"),
            "line 1, column 37: expected end of line after the object, found x",
        ),
        (
            "[1]".into(),
            r#"line 1, column 1: expected a JSON object {"key":..,"ts":..,"fields":{..}}, found an array"#,
        ),
        (
            r#"{"key":"","ts":1,"fields":{"a":1}}"#.into(),
            r#"line 1, column 8: expected a non-empty string for "key", found """#,
        ),
        (
            r#"{"key":7,"ts":1,"fields":{"a":1}}"#.into(),
            r#"line 1, column 8: expected a string for "key", found 7"#,
        ),
        (
            r#"{"key":"k","ts":1,"fields":{"b":{"$bytes":"AQJ"}}}"#.into(),
            r#"line 1, column 43: expected standard base64 for field "b", found "AQJ""#,
        ),
        (
            r#"{"key":"k","ts":1,"fields":{"b":{"$bytes":"AQ==","x":1}}}"#.into(),
            r#"line 1, column 49: expected '}' closing the "$bytes" object, found ,"#,
        ),
        (
            r#"{"key":"k" "ts":1}"#.into(),
            r#"line 1, column 12: expected ',' or '}', found "ts""#,
        ),
        (
            r#"{"key":"k","ts":1,"fields":[1]}"#.into(),
            r#"line 1, column 28: expected an object for "fields", found an array"#,
        ),
        (
            r#"{"key":"k","ts":1,"fields":{"":1}}"#.into(),
            r#"line 1, column 29: expected a non-empty field name, found """#,
        ),
        (
            r#"{"key":"k","ts":1,"fields":{"a":1 "b":2}}"#.into(),
            r#"line 1, column 35: expected ',' or '}' in "fields", found "b""#,
        ),
        (
            r#"{key:1}"#.into(),
            r#"line 1, column 2: expected a member name ("key", "tags", "ts" or "fields"), found key"#,
        ),
        (
            // Columns count characters, not bytes.
            r#"{"key":"ééé","ts":"x","fields":{"a":1}}"#.into(),
            r#"line 1, column 19: expected an RFC 3339 time for "ts" such as "2025-12-01T12:00:00.5+01:00" (premature end of input), found "x""#,
        ),
        (
            format!(
                "{ok}\r\n\r\n{}",
                r#"{"key":"k","ts":1,"fields":{"a":true,"b":fals}}"#
            ),
            r#"line 3, column 42: expected a number, string, bool or {"$bytes":"<base64>"} for field "b", found fals"#,
        ),
    ];
    let mut mismatches = Vec::new();
    for (input, expected) in cases {
        let actual = match parse_ndjson(&input) {
            Ok(records) => render(&records),
            Err(e) => e.to_string(),
        };
        if actual != expected {
            mismatches.push(format!(
                "input:    {input}\nexpected: {expected}\nactual:   {actual}"
            ));
        }
    }
    assert!(mismatches.is_empty(), "{}", mismatches.join("\n\n"));
}

#[test]
fn limits_are_named_errors() {
    let long = format!(
        r#"{{"key":"k","ts":1,"fields":{{"s":"{}"}}}}"#,
        "x".repeat(LINE_BYTES_MAX)
    );
    let e = parse_ndjson(&long).unwrap_err();
    assert_eq!((e.line, e.column), (1, LINE_BYTES_MAX + 1));
    assert_eq!(
        e.expected,
        format!("a line of at most {LINE_BYTES_MAX} bytes")
    );

    let fields = |n: usize| {
        (0..n)
            .map(|i| format!(r#""f{i}":{i}"#))
            .collect::<Vec<_>>()
            .join(",")
    };
    let at_limit = format!(
        r#"{{"key":"k","ts":1,"fields":{{{}}}}}"#,
        fields(FIELDS_MAX)
    );
    assert_eq!(parse_ndjson(&at_limit).unwrap()[0].fields.len(), FIELDS_MAX);
    let over = format!(
        r#"{{"key":"k","ts":1,"fields":{{{}}}}}"#,
        fields(FIELDS_MAX + 1)
    );
    let e = parse_ndjson(&over).unwrap_err();
    assert_eq!(
        e.expected,
        format!("at most {FIELDS_MAX} fields in a record")
    );
    assert_eq!(
        e.column,
        over.find(&format!(r#""f{FIELDS_MAX}""#)).unwrap() + 1
    );
}

#[test]
fn error_serialises_as_json() {
    let e = parse_ndjson(r#"{"key":"k","ts":true,"fields":{"a":1}}"#).unwrap_err();
    let json = e.to_json();
    assert_eq!(json["line"], 1);
    assert_eq!(json["column"], 17);
    let expected = r#"an integer (in the precision, ns by default) or an RFC 3339 string for "ts""#;
    assert_eq!(json["expected"], expected);
    assert_eq!(json["found"], "true");
    assert_eq!(
        json["error"],
        format!("line 1, column 17: expected {expected}, found true")
    );
    let derived = serde_json::to_value(&e).unwrap();
    assert_eq!(derived["column"], 17);
}

#[test]
fn writer_is_the_inverse_of_the_parser() {
    let records = vec![Record {
        tags: Vec::new(),
        key: "truck-0001/engine \"quoted\" ü\n".into(),
        ts: i64::MIN,
        fields: vec![
            ("f".into(), Value::F64(-0.0)),
            ("whole".into(), Value::F64(12.0)),
            ("tiny".into(), Value::F64(f64::from_bits(1))),
            ("big".into(), Value::F64(f64::MAX)),
            ("i".into(), Value::I64(i64::MAX)),
            ("b".into(), Value::Bool(false)),
            ("s".into(), Value::Str("\u{1}\t\\".into())),
            ("bytes".into(), Value::Bytes(vec![0, 255, 7])),
            ("empty".into(), Value::Bytes(vec![])),
        ],
    }];
    let text = write_ndjson(&records).unwrap();
    assert_eq!(parse_ndjson(&text).unwrap(), records);
    let nan = vec![Record {
        tags: Vec::new(),
        key: "k".into(),
        ts: 0,
        fields: vec![("x".into(), Value::F64(f64::NAN))],
    }];
    assert!(write_ndjson(&nan).is_err());
}

#[test]
fn generator_output_parses() {
    // Two lines exactly as /work/shared/data/gen_telemetry.py emits them.
    let input = concat!(
        r#"{"key":"truck-0000/engine","ts":1764374400000000000,"fields":{"engine_temp_c":71.28,"oil_bar":3.105,"battery_v":13.71,"speed_kmh":44.9,"fuel_pct":57.3,"odometer_m":412873,"lat":50.129032,"lon":3.771164,"ignition":true,"fault":false}}"#,
        "\n",
        r#"{"key":"truck-0001/engine","ts":1764374400001000003,"fields":{"engine_temp_c":88.07,"oil_bar":2.48,"battery_v":12.9,"speed_kmh":0.0,"fuel_pct":99.1,"odometer_m":10442,"lat":46.5,"lon":-4.25,"ignition":false,"fault":false}}"#,
        "\n",
    );
    let records = parse_ndjson(input).unwrap();
    assert_eq!(records.len(), 2);
    assert_eq!(records[1].field("speed_kmh"), Some(&Value::F64(0.0)));
    assert_eq!(records[0].field("odometer_m"), Some(&Value::I64(412873)));
    assert_eq!(records[0].fields.len(), 10);
}

#[test]
fn keys_and_field_names_longer_than_the_block_format_allows_are_refused() {
    use sync::parse::{FIELD_NAME_BYTES_MAX, KEY_BYTES_MAX};
    let line =
        |key: &str, name: &str| format!(r#"{{"key":"{key}","ts":1,"fields":{{"{name}":1}}}}"#);
    let (key, name) = ("k".repeat(KEY_BYTES_MAX), "n".repeat(FIELD_NAME_BYTES_MAX));
    let ok = parse_ndjson(&line(&key, &name)).unwrap();
    assert_eq!(
        (ok[0].key.len(), ok[0].fields[0].0.len()),
        (KEY_BYTES_MAX, FIELD_NAME_BYTES_MAX)
    );
    let e = parse_ndjson(&line(&format!("{key}k"), "n")).unwrap_err();
    assert_eq!(e.column, 8, "{e}");
    assert!(
        e.expected
            .contains(&format!("at most {KEY_BYTES_MAX} bytes")),
        "{e}"
    );
    let e = parse_ndjson(&line("k", &format!("{name}n"))).unwrap_err();
    assert!(e.expected.starts_with("a field name of at most"), "{e}");
    // What parses can always be sealed.
    sync::block::encode_block(sync::block::VERSION_COLUMNAR, 1, 1, &ok).unwrap();
}

#[test]
fn the_field_limit_comes_from_the_options() {
    let opts = ParseOptions {
        fields_max: 2,
        ..ParseOptions::default()
    };
    let two = r#"{"key":"k","ts":1,"fields":{"a":1,"b":2}}"#;
    assert_eq!(parse_ndjson_with(two, &opts).unwrap()[0].fields.len(), 2);
    let three = format!(
        "{two}\n{}",
        r#"{"key":"k","ts":1,"fields":{"a":1,"b":2,"c":3}}"#
    );
    let e = parse_ndjson_with(&three, &opts).unwrap_err();
    let second = three.lines().nth(1).unwrap();
    assert_eq!((e.line, e.column), (2, second.find(r#""c""#).unwrap() + 1));
    assert_eq!(e.expected, "at most 2 fields in a record");
    assert_eq!(e.found, "field number 3");
    let lp = "m,t=a a=1,b=2,c=3 1\n";
    let e = sync::parse::parse_line_protocol(lp, &opts).unwrap_err();
    assert_eq!(e.expected, "at most 2 fields in a record");
}

/// 2025-12-01T12:00:00Z in nanoseconds.
const NOON_NS: i64 = 1_764_590_400_000_000_000;

#[test]
fn ts_as_rfc3339_with_an_offset_is_the_right_instant() {
    let hour = 3_600_000_000_000;
    let cases = [
        ("2025-12-01T12:00:00Z", NOON_NS),
        ("2025-12-01T12:00:00+01:00", NOON_NS - hour),
        ("2025-12-01T12:00:00.5+01:00", NOON_NS - hour + 500_000_000),
        ("2025-12-01T07:00:00.000001-05:00", NOON_NS + 1_000),
    ];
    for (text, want) in cases {
        let line = format!(r#"{{"key":"k","ts":"{text}","fields":{{"a":1}}}}"#);
        assert_eq!(parse_ndjson(&line).unwrap()[0].ts, want, "{text}");
    }
    let e = parse_ndjson(r#"{"key":"k","ts":"2025-12-01T12:00:00","fields":{}}"#).unwrap_err();
    assert!(e.expected.contains("add Z for UTC"), "{e}");
}

#[test]
fn integer_ts_follows_the_precision_and_an_implausible_unit_is_named() {
    let ms = NOON_NS / 1_000_000;
    let line = format!(r#"{{"key":"k","ts":{ms},"fields":{{"a":1}}}}"#);
    let opts = |unit, check: bool| ParseOptions {
        ts_unit: unit,
        plausible_at: check.then_some(NOON_NS),
        ..ParseOptions::default()
    };
    let got = parse_ndjson_with(&line, &opts(TimeUnit::Ms, true)).unwrap();
    assert_eq!(got[0].ts, NOON_NS, "precision=ms scales to nanoseconds");
    let e = parse_ndjson_with(&line, &opts(TimeUnit::Ns, true)).unwrap_err();
    assert_eq!((e.line, e.column), (1, 17));
    assert!(e.expected.contains("looks like ms"), "{e}");
    assert!(e.expected.contains("precision=ms"), "{e}");
    assert!(e.found.contains("1970-01-01T00:29:24"), "{e}");
    // Without the check (the parser alone), the integer is taken as given.
    assert_eq!(
        parse_ndjson_with(&line, &opts(TimeUnit::Ns, false)).unwrap()[0].ts,
        ms
    );
    // A value implausible in every unit is stored as given: the check names units, it does
    // not judge clocks.
    let small = r#"{"key":"k","ts":5,"fields":{"a":1}}"#;
    assert_eq!(
        parse_ndjson_with(small, &opts(TimeUnit::Ns, true)).unwrap()[0].ts,
        5
    );
    let lp = format!("m,d=a x=1 {ms}\n");
    let e = parse_line_protocol(&lp, &opts(TimeUnit::Ns, true)).unwrap_err();
    assert_eq!(e.column, 11, "{e}");
    assert!(e.expected.contains("precision=ms"), "{e}");
    let lines = parse_line_protocol(&lp, &opts(TimeUnit::Ms, true)).unwrap();
    assert_eq!(lines[0].record.ts, NOON_NS);
}

#[test]
fn http_and_mqtt_json_share_one_field_mapping() {
    let doc = r#"{"t":21.5,"gps":{"lat":1.5,"fix":{"ok":true}},"xyz":[1,null,{"k":"v"}],"gone":null,"e":[],"b":{"$bytes":"AAE="}}"#;
    let want = "gps.lat=1.5 gps.fix.ok=true xyz.0=1i xyz.2.k=\"v\" t=21.5 b=0x0001";
    let line = format!(r#"{{"key":"k","ts":1,"fields":{doc}}}"#);
    let record = &parse_ndjson(&line).unwrap()[0];
    let mut got: Vec<String> = record
        .fields
        .iter()
        .map(|(n, v)| format!("{n}={}", render_value(v)))
        .collect();
    let mqtt = parse_json_fields(&doc.replace(',', ",\n  "), FIELDS_MAX).unwrap();
    assert_eq!(
        mqtt, record.fields,
        "a pretty-printed payload maps the same"
    );
    got.sort();
    let mut want: Vec<&str> = want.split(' ').collect();
    want.sort();
    assert_eq!(got, want);
    let e = parse_json_fields(r#"{"a":{"b":1},"a.b":2}"#, FIELDS_MAX).unwrap_err();
    assert!(
        e.to_string()
            .contains(r#"not already used in this record, found "a.b""#),
        "{e}"
    );
    assert!(parse_json_fields("[1]", FIELDS_MAX).is_err());
    assert!(parse_json_fields(r#"{"$bytes":"AA=="}"#, FIELDS_MAX).is_err());
    let deep = format!("{}1{}", r#"{"a":"#.repeat(200), "}".repeat(200));
    let e = parse_json_fields(&format!("{{\"x\":{deep}}}"), FIELDS_MAX).unwrap_err();
    assert!(e.expected.contains("levels of nested"), "{e}");
    let e = parse_json_fields(r#"{"a":[1,2,3]}"#, 2).unwrap_err();
    assert!(e.expected.contains("at most 2 fields"), "{e}");
}
