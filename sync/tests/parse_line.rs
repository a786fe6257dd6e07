//! Table-driven tests of the line-protocol parser: each case is an input and the exact rendering
//! of what it parses to (measurement, key, tags, ts, typed fields), or of the error.

use sync::Value;
use sync::parse::{
    FIELDS_MAX, LINE_BYTES_MAX, LineRecord, ParseOptions, TAGS_MAX, parse_line_protocol,
};

fn render_value(v: &Value) -> String {
    match v {
        Value::F64(f) => format!("{f:?}"),
        Value::I64(i) => format!("{i}i"),
        Value::Bool(b) => b.to_string(),
        Value::Str(s) => format!("{s:?}"),
        Value::Bytes(b) => format!("{b:?}"),
    }
}

fn render(records: &[LineRecord]) -> String {
    let lines: Vec<String> = records
        .iter()
        .map(|lr| {
            let r = &lr.record;
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
            format!(
                "[{}] {}{tags} @{} {}",
                lr.measurement,
                r.key,
                r.ts,
                fields.join(" ")
            )
        })
        .collect();
    lines.join("\n")
}

fn run(input: &str, opts: &ParseOptions) -> String {
    match parse_line_protocol(input, opts) {
        Ok(records) => render(&records),
        Err(e) => e.to_string(),
    }
}

/// Runs every case and reports all mismatches at once.
fn check_all(cases: &[(&str, &str)], opts: &ParseOptions) {
    let mut mismatches = Vec::new();
    for (input, expected) in cases {
        let actual = run(input, opts);
        if actual != *expected {
            mismatches.push(format!(
                "input:    {input:?}\nexpected: {expected}\nactual:   {actual}"
            ));
        }
    }
    assert!(mismatches.is_empty(), "{}", mismatches.join("\n\n"));
}

#[test]
fn good_lines() {
    let cases = [
        (
            r#"telemetry,device=truck-0007,unit=engine engine_temp_c=71.28,odometer_m=12345i,ignition=true,note="x" 1764374400000000000"#,
            r#"[telemetry] device=truck-0007/unit=engine {device="truck-0007",unit="engine"} @1764374400000000000 engine_temp_c=71.28 odometer_m=12345i ignition=true note="x""#,
        ),
        ("cpu value=1 10", "[cpu] cpu @10 value=1.0"),
        (
            "m a=5u,b=-3i,c=9223372036854775807u 1",
            "[m] m @1 a=5i b=-3i c=9223372036854775807i",
        ),
        (
            "m a=t,b=F,c=TRUE,d=False 1",
            "[m] m @1 a=true b=false c=true d=false",
        ),
        (
            "m a=1e3,b=-1.5E-3,c=-0.0,d=0.1 -5",
            "[m] m @-5 a=1000.0 b=-0.0015 c=-0.0 d=0.1",
        ),
        (
            r#"m,host=a\ b,rack=r\,1 x="he said \"hi\"" 1"#,
            r#"[m] host=a b/rack=r,1 {host="a b",rack="r,1"} @1 x="he said \"hi\"""#,
        ),
        (r#"my\ meas,t=v x=1i 1"#, r#"[my meas] t=v {t="v"} @1 x=1i"#),
        // Tag order does not change the key; `/`, `=` and `%` in tags are escaped in it.
        ("m,b=2,a=1 x=1i 1", r#"[m] a=1/b=2 {b="2",a="1"} @1 x=1i"#),
        (
            r#"m,path=a/b,eq=x\=y,pct=5% x=1i 1"#,
            r#"[m] eq=x%3Dy/path=a%2Fb/pct=5%25 {path="a/b",eq="x=y",pct="5%"} @1 x=1i"#,
        ),
        // A tag and a field may share a name.
        ("m,x=t x=1i 1", r#"[m] x=t {x="t"} @1 x=1i"#),
        ("m x=\"\" 1", r#"[m] m @1 x="""#),
        // Comments, blank lines, leading blanks and CRLF.
        (
            "# a comment\n\n  m x=1i 1\r\n\t\nm x=2i 2\r\n",
            "[m] m @1 x=1i\n[m] m @2 x=2i",
        ),
        // A quoted string may hold a newline; line numbers keep counting physical lines.
        (
            "m s=\"a\nb\" 1\nm x=1i 2",
            "[m] m @1 s=\"a\\nb\"\n[m] m @2 x=1i",
        ),
        ("", ""),
    ];
    check_all(&cases, &ParseOptions::default());
}

#[test]
fn missing_timestamp_takes_the_default() {
    let cases = [
        ("m x=1i", "[m] m @99 x=1i"),
        ("m x=1i 5", "[m] m @5 x=1i"),
        ("m x=1i  ", "[m] m @99 x=1i"),
    ];
    check_all(
        &cases,
        &ParseOptions {
            default_ts: Some(99),
            ..ParseOptions::default()
        },
    );
}

#[test]
fn errors_name_line_column_expected_and_found() {
    let cases = [
        (
            "m x=1i",
            "line 1, column 7: expected a timestamp in nanoseconds after the fields, found end of line",
        ),
        (
            "m x=1i 1\nm x=1i 2\nm a=18446744073709551615u 3",
            "line 3, column 5: expected an unsigned integer at most 9223372036854775807 for field \"a\", found 18446744073709551615u",
        ),
        (
            "m a=99999999999999999999u 1",
            "line 1, column 5: expected an unsigned integer at most 18446744073709551615, ending in 'u', found 99999999999999999999u",
        ),
        (
            "m a=99999999999999999999i 1",
            "line 1, column 5: expected an integer from -9223372036854775808 to 9223372036854775807, ending in 'i', found 99999999999999999999i",
        ),
        (
            "m a=1,a=2 1",
            "line 1, column 7: expected a field name not already used in this line, found a=2",
        ),
        (
            "m,t=1,t=2 a=1 1",
            "line 1, column 7: expected each tag key at most once, found t=2",
        ),
        (
            "m a=abc 1",
            r#"line 1, column 3: expected a field name=value, where value is a float (1.5), an integer (2i), an unsigned integer (3u), a "string" or a bool, found a=abc"#,
        ),
        (
            "m a=1,b=abc 1",
            r#"line 1, column 7: expected a field name=value, where value is a float (1.5), an integer (2i), an unsigned integer (3u), a "string" or a bool, found b=abc"#,
        ),
        (
            "m a=1 abc",
            "line 1, column 7: expected a timestamp in nanoseconds (an integer), found abc",
        ),
        (
            "m a=1 1 extra",
            "line 1, column 9: expected end of line, found extra",
        ),
        (
            "m",
            r#"line 1, column 2: expected a space and then a field name=value, where value is a float (1.5), an integer (2i), an unsigned integer (3u), a "string" or a bool, found end of line"#,
        ),
        (
            "m, a=1 1",
            "line 1, column 3: expected tags as key=value pairs after ',', found a space",
        ),
        (
            "m a=1e999 1",
            "line 1, column 5: expected a finite float for field \"a\", found 1e999",
        ),
        (
            "m a=1 99999999999999999999",
            "line 1, column 7: expected a timestamp in nanoseconds within the i64 range, found 99999999999999999999",
        ),
        // Trailing blanks are trimmed before parsing; positions still point into the line.
        (
            "m a=1 1 x  ",
            "line 1, column 9: expected end of line, found x",
        ),
        (
            "m a=1 é  ",
            "line 1, column 7: expected a timestamp in nanoseconds (an integer), found é",
        ),
        (
            "# comment\n\nm,dev=é a=1 x",
            "line 3, column 13: expected a timestamp in nanoseconds (an integer), found x",
        ),
    ];
    check_all(&cases, &ParseOptions::default());
}

#[test]
fn limits_are_named_errors() {
    let long = format!("m s=\"{}\" 1", "x".repeat(LINE_BYTES_MAX));
    let e = parse_line_protocol(&long, &ParseOptions::default()).unwrap_err();
    assert_eq!((e.line, e.column), (1, LINE_BYTES_MAX + 1));

    let tags = |n: usize| (0..n).map(|i| format!(",t{i}=v{i}")).collect::<String>();
    let at_limit = format!("m{} x=1 1", tags(TAGS_MAX));
    let key = &parse_line_protocol(&at_limit, &ParseOptions::default()).unwrap()[0]
        .record
        .key;
    assert_eq!(key.split('/').count(), TAGS_MAX);
    let over = format!("m{} x=1 1", tags(TAGS_MAX + 1));
    let e = parse_line_protocol(&over, &ParseOptions::default()).unwrap_err();
    assert_eq!(e.expected, format!("at most {TAGS_MAX} tags in a line"));
    assert_eq!(e.column, over.find(&format!(",t{TAGS_MAX}=")).unwrap() + 2);

    let fields = |n: usize| {
        (0..n)
            .map(|i| format!("f{i}={i}i"))
            .collect::<Vec<_>>()
            .join(",")
    };
    let at_limit = format!("m {} 1", fields(FIELDS_MAX));
    assert_eq!(
        parse_line_protocol(&at_limit, &ParseOptions::default()).unwrap()[0]
            .record
            .fields
            .len(),
        FIELDS_MAX
    );
    let over = format!("m {} 1", fields(FIELDS_MAX + 1));
    let e = parse_line_protocol(&over, &ParseOptions::default()).unwrap_err();
    assert_eq!(
        e.expected,
        format!("at most {FIELDS_MAX} fields in a record")
    );
    assert_eq!(
        e.column,
        over.find(&format!(",f{FIELDS_MAX}=")).unwrap() + 2
    );
}

#[test]
fn generator_output_parses() {
    // One line exactly as `gen_telemetry.py --format line` emits it.
    let input = "telemetry,device=truck-0000,unit=engine engine_temp_c=71.28,oil_bar=3.105,battery_v=13.71,speed_kmh=44.9,fuel_pct=57.3,odometer_m=412873i,lat=50.129032,lon=3.771164,ignition=true,fault=false 1764374400000000000\n";
    let records = parse_line_protocol(input, &ParseOptions::default()).unwrap();
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].measurement, "telemetry");
    assert_eq!(records[0].record.key, "device=truck-0000/unit=engine");
    assert_eq!(records[0].record.tag("device"), Some("truck-0000"));
    assert_eq!(records[0].record.tag("unit"), Some("engine"));
    assert_eq!(
        records[0].record.field("engine_temp_c"),
        Some(&Value::F64(71.28))
    );
    assert_eq!(
        records[0].record.field("odometer_m"),
        Some(&Value::I64(412873))
    );
    assert_eq!(records[0].record.field("fault"), Some(&Value::Bool(false)));
}

#[test]
fn keys_and_field_names_longer_than_the_block_format_allows_are_refused() {
    use sync::parse::{FIELD_NAME_BYTES_MAX, KEY_BYTES_MAX};
    let opts = ParseOptions::default();
    // Two tags whose derived key (`a=..`, `/`, `b=..`) is one byte more than a key may hold.
    let half = (KEY_BYTES_MAX - 5) / 2;
    let long = format!(
        "m,a={},b={} x=1 1",
        "v".repeat(half),
        "w".repeat(KEY_BYTES_MAX - 5 - half + 1)
    );
    let e = parse_line_protocol(&long, &opts).unwrap_err();
    assert!(
        e.expected
            .contains(&format!("at most {KEY_BYTES_MAX} bytes")),
        "{e}"
    );
    let fits = format!("m,a={} x=1 1", "v".repeat(KEY_BYTES_MAX - 2));
    assert_eq!(
        parse_line_protocol(&fits, &opts).unwrap()[0]
            .record
            .key
            .len(),
        KEY_BYTES_MAX
    );
    let name = "n".repeat(FIELD_NAME_BYTES_MAX + 1);
    let e = parse_line_protocol(&format!("m {name}=1 1"), &opts).unwrap_err();
    assert_eq!(e.column, 3, "{e}");
    assert!(e.expected.starts_with("a field name of at most"), "{e}");
}
