//! Configuration tests: a good file, every bad key, defaults and environment overrides.
//!
//! Each bad key must produce a `ConfigError` that names that key, because the operator reading
//! the message has only the file in front of them. The environment is always passed explicitly
//! so these tests never touch the process environment.

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use edge_agent::config::{
    ConfigError, EdgeConfig, MqttUnmatched, PayloadFormat, SourceConfig, parse_bytes,
};
use edge_agent::log::{FsyncPolicy, OnFull};

const FULL: &str = r#"
data_dir = "/var/lib/tributary"
[hub]
addr = "hub.example.net:7400"
server_name = "hub.example.net"
[tls]
ca = "ca.pem"
cert = "device.pem"
key = "/etc/tributary/device.key"
[http]
listen = "127.0.0.1:7401"
body_bytes_max = "1MiB"
token = "s3cret"
[storage]
fsync = "interval:10ms"
disk_bytes_max = "2GiB"
on_full = "drop-oldest"
segment_bytes_max = "64MiB"
block_records_max = 500
block_bytes_max = "256KiB"
block_linger = "5ms"
block_version = 2
queue_batches_max = 64
[[streams]]
name = "telemetry"
[[streams]]
name = "status"
priority = 10
[[sources]]
kind = "mqtt"
url = "mqtt://127.0.0.1:1883"
topics = ["sensors/#"]
stream = "telemetry"
format = "json"
[[sources]]
kind = "http"
"#;

const MINIMAL: &str = "data_dir = \"data\"\n[[streams]]\nname = \"telemetry\"\n";

fn parse(text: &str) -> Result<EdgeConfig, ConfigError> {
    parse_env(text, &[])
}

fn parse_env(text: &str, env: &[(&str, &str)]) -> Result<EdgeConfig, ConfigError> {
    let env: HashMap<String, String> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    EdgeConfig::from_toml(text, Path::new("/etc/tributary"), Some(env))
}

/// Parses `text`, expects a failure naming `key`, and returns the message.
fn expect_bad(text: &str, key: &str) -> String {
    match parse(text) {
        Ok(c) => panic!("expected an error for {key}, parsed {c:?}"),
        Err(e) => {
            let message = e.to_string();
            assert_eq!(e.key(), Some(key), "wrong key in {message:?}");
            assert!(message.starts_with(&format!("{key}: ")), "{message:?}");
            message
        }
    }
}

/// MINIMAL with one extra line in the given section.
fn with(section: &str, line: &str) -> String {
    format!("data_dir = \"data\"\n[[streams]]\nname = \"telemetry\"\n[{section}]\n{line}\n")
}

#[test]
fn full_config_parses_into_types() {
    let c = parse(FULL).unwrap();
    assert_eq!(c.data_dir, Path::new("/var/lib/tributary"));
    let hub = c.hub.as_ref().unwrap();
    assert_eq!(hub.addr, "hub.example.net:7400");
    assert_eq!(hub.server_name, "hub.example.net");
    let tls = c.tls.as_ref().unwrap();
    assert_eq!(tls.ca, Path::new("/etc/tributary/ca.pem"));
    assert_eq!(tls.key, Path::new("/etc/tributary/device.key"));
    assert_eq!(c.http.listen, "127.0.0.1:7401".parse().unwrap());
    assert_eq!(c.http.body_bytes_max, 1 << 20);
    assert_eq!(c.http.token.as_deref(), Some("s3cret"));
    assert_eq!(
        c.storage.fsync,
        FsyncPolicy::Interval(Duration::from_millis(10))
    );
    assert_eq!(c.storage.disk_bytes_max, 2 << 30);
    assert!(matches!(c.storage.on_full, OnFull::DropOldest));
    assert_eq!(c.storage.segment_bytes_max, 64 << 20);
    assert_eq!(c.storage.block_records_max, 500);
    assert_eq!(c.storage.block_bytes_max, 256 << 10);
    assert_eq!(c.storage.block_linger, Duration::from_millis(5));
    assert_eq!(c.storage.block_version, 2);
    assert_eq!(c.storage.queue_batches_max, 64);
    let names: Vec<_> = c
        .streams
        .iter()
        .map(|s| (s.name.as_str(), s.priority))
        .collect();
    assert_eq!(names, [("telemetry", 0), ("status", 10)]);
    assert_eq!(
        c.sources.len(),
        1,
        "kind = \"http\" is always on and adds no source"
    );
    let SourceConfig::Mqtt(m) = &c.sources[0] else {
        panic!("expected an mqtt source: {:?}", c.sources[0])
    };
    assert_eq!(m.url, "mqtt://127.0.0.1:1883");
    assert_eq!(m.topics, ["sensors/#"]);
    assert_eq!(m.stream, "telemetry");
    assert_eq!(m.format, PayloadFormat::Json);

    let log = c.log_config();
    assert_eq!(log.streams, ["telemetry", "status"]);
    assert_eq!(log.block_records_max, 500);
    assert_eq!(log.data_dir, Path::new("/var/lib/tributary"));
}

#[test]
fn minimal_config_gets_documented_defaults() {
    let c = parse(MINIMAL).unwrap();
    assert_eq!(
        c.data_dir,
        Path::new("/etc/tributary/data"),
        "relative to the config's directory"
    );
    assert!(c.hub.is_none() && c.tls.is_none() && c.sources.is_empty());
    assert_eq!(c.http.listen, "127.0.0.1:7401".parse().unwrap());
    assert_eq!(c.http.body_bytes_max, 16 << 20);
    assert_eq!(c.http.token, None);
    assert_eq!(
        c.storage.fsync,
        FsyncPolicy::Interval(Duration::from_millis(10))
    );
    assert_eq!(c.storage.disk_bytes_max, 2 << 30);
    assert!(matches!(c.storage.on_full, OnFull::DropOldest));
    assert_eq!(c.storage.segment_bytes_max, 64 << 20);
    assert_eq!(c.streams[0].priority, 0);
}

#[test]
fn example_config_in_repository_parses() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/edge.toml");
    let c = EdgeConfig::load_with_env(&path, Some(HashMap::new())).unwrap();
    assert!(c.data_dir.ends_with("data/edge"));
    assert!(c.stream("telemetry").is_some());
    assert_eq!(c.http.listen, "127.0.0.1:7401".parse().unwrap());
}

#[test]
fn fsync_policies() {
    for (text, want) in [
        ("always", FsyncPolicy::Always),
        ("never", FsyncPolicy::Never),
        (
            "interval:10ms",
            FsyncPolicy::Interval(Duration::from_millis(10)),
        ),
        ("interval:1s", FsyncPolicy::Interval(Duration::from_secs(1))),
    ] {
        let c = parse(&with("storage", &format!("fsync = \"{text}\""))).unwrap();
        assert_eq!(c.storage.fsync, want, "{text}");
    }
    let m = expect_bad(&with("storage", "fsync = \"sometimes\""), "storage.fsync");
    assert_eq!(
        m,
        "storage.fsync: expected always | interval:<N>ms | never, found \"sometimes\""
    );
    expect_bad(
        &with("storage", "fsync = \"interval:0ms\""),
        "storage.fsync",
    );
    expect_bad(&with("storage", "fsync = \"interval:10\""), "storage.fsync");
}

#[test]
fn byte_sizes() {
    let cases: &[(&str, u64)] = &[
        ("4096", 4096),
        ("4096B", 4096),
        ("10 bytes", 10),
        ("1KB", 1_000),
        ("1kB", 1_000),
        ("3MB", 3_000_000),
        ("2GB", 2_000_000_000),
        ("512KiB", 512 << 10),
        ("64MiB", 64 << 20),
        ("2GiB", 2 << 30),
    ];
    for (text, want) in cases {
        assert_eq!(parse_bytes("k", text).unwrap(), *want, "{text}");
    }
    for bad in [
        "",
        "MiB",
        "2 TiB",
        "-1",
        "1.5GiB",
        "99999999999999999999GiB",
        "2gib",
    ] {
        assert!(parse_bytes("k", bad).is_err(), "{bad:?} should be rejected");
    }
    let c = parse(&with("storage", "disk_bytes_max = 1048576")).unwrap();
    assert_eq!(
        c.storage.disk_bytes_max,
        1 << 20,
        "a TOML integer is a number of bytes"
    );
}

#[test]
fn every_bad_storage_key_is_named() {
    let cases = [
        ("disk_bytes_max = \"lots\"", "storage.disk_bytes_max"),
        ("disk_bytes_max = \"0\"", "storage.disk_bytes_max"),
        ("on_full = \"panic\"", "storage.on_full"),
        (
            "segment_bytes_max = \"64 parsecs\"",
            "storage.segment_bytes_max",
        ),
        ("block_records_max = 0", "storage.block_records_max"),
        ("block_records_max = \"many\"", "storage.block_records_max"),
        ("block_bytes_max = \"x\"", "storage.block_bytes_max"),
        ("block_linger = \"2\"", "storage.block_linger"),
        ("block_version = 3", "storage.block_version"),
        ("queue_batches_max = -1", "storage.queue_batches_max"),
    ];
    for (line, key) in cases {
        expect_bad(&with("storage", line), key);
    }
    let m = expect_bad(&with("storage", "on_full = \"panic\""), "storage.on_full");
    assert!(m.contains("drop-oldest | block"), "{m}");
}

#[test]
fn every_bad_http_key_is_named() {
    let m = expect_bad(&with("http", "listen = \"localhost\""), "http.listen");
    assert!(
        m.contains("127.0.0.1:7401"),
        "the message shows the expected shape: {m}"
    );
    expect_bad(&with("http", "listen = \"127.0.0.1:99999\""), "http.listen");
    expect_bad(
        &with("http", "body_bytes_max = \"big\""),
        "http.body_bytes_max",
    );
    expect_bad(&with("http", "body_bytes_max = 0"), "http.body_bytes_max");
    let c = parse(&with("http", "token = \"\"")).unwrap();
    assert_eq!(c.http.token, None, "an empty token disables authentication");
}

#[test]
fn hub_and_tls_are_validated_when_present() {
    let tls = "[tls]\nca = \"a\"\ncert = \"b\"\nkey = \"c\"\n";
    let base = "data_dir = \"d\"\n[[streams]]\nname = \"t\"\n";
    expect_bad(
        &format!("{base}[hub]\naddr = \"hub.example.net\"\n{tls}"),
        "hub.addr",
    );
    expect_bad(
        &format!("{base}[hub]\naddr = \"hub:port\"\n{tls}"),
        "hub.addr",
    );
    expect_bad(
        &format!("{base}[hub]\nserver_name = \"x\"\n{tls}"),
        "hub.addr",
    );
    expect_bad(
        &format!("{base}[hub]\naddr = \"h:1\"\nserver_name = \"\"\n{tls}"),
        "hub.server_name",
    );
    let m = expect_bad(&format!("{base}[hub]\naddr = \"h:1\"\n"), "tls");
    assert!(m.contains("pki issue"), "{m}");
    expect_bad(
        &format!("{base}[hub]\naddr = \"h:1\"\n[tls]\nca = \"a\"\ncert = \"b\"\n"),
        "tls.key",
    );
    expect_bad(
        &format!("{base}[tls]\nca = \"\"\ncert = \"b\"\nkey = \"c\"\n"),
        "tls.ca",
    );

    let c = parse(&format!("{base}[hub]\naddr = \"[::1]:7400\"\n{tls}")).unwrap();
    assert_eq!(
        c.hub.unwrap().server_name,
        "::1",
        "server_name defaults to the addr's host"
    );
}

#[test]
fn bad_streams_are_named() {
    expect_bad("data_dir = \"d\"\n", "streams");
    expect_bad(
        "data_dir = \"d\"\n[[streams]]\npriority = 1\n",
        "streams[0].name",
    );
    expect_bad(
        "data_dir = \"d\"\n[[streams]]\nname = \"a/b\"\n",
        "streams[0].name",
    );
    expect_bad(
        "data_dir = \"d\"\n[[streams]]\nname = \"\"\n",
        "streams[0].name",
    );
    let m = expect_bad(
        "data_dir = \"d\"\n[[streams]]\nname = \"a\"\n[[streams]]\nname = \"a\"\n",
        "streams[1].name",
    );
    assert!(m.contains("declared twice"), "{m}");
    expect_bad(
        "data_dir = \"d\"\n[[streams]]\nname = \"a\"\npriority = 300\n",
        "streams[0].priority",
    );
}

#[test]
fn bad_sources_are_named() {
    let base = "data_dir = \"d\"\n[[streams]]\nname = \"telemetry\"\n[[sources]]\n";
    let mqtt = |rest: &str| format!("{base}kind = \"mqtt\"\n{rest}");
    let m = expect_bad(&format!("{base}kind = \"kafka\"\n"), "sources[0].kind");
    assert!(
        m.contains("mqtt | hwmon | iio | nmea | simulator | modbus | opcua | http"),
        "{m}"
    );
    expect_bad(&format!("{base}url = \"mqtt://h:1\"\n"), "sources[0].kind");
    let ok = "url = \"mqtt://127.0.0.1:1883\"\ntopics = [\"a/#\"]\nstream = \"telemetry\"\n";
    parse(&mqtt(ok)).unwrap();
    expect_bad(
        &mqtt("topics = [\"a\"]\nstream = \"telemetry\"\n"),
        "sources[0].url",
    );
    expect_bad(
        &mqtt("url = \"http://h:1\"\ntopics = [\"a\"]\nstream = \"telemetry\"\n"),
        "sources[0].url",
    );
    expect_bad(
        &mqtt("url = \"mqtt://h:1\"\ntopics = []\nstream = \"telemetry\"\n"),
        "sources[0].topics",
    );
    expect_bad(
        &mqtt("url = \"mqtt://h:1\"\ntopics = [\"a\"]\n"),
        "sources[0].stream",
    );
    let m = expect_bad(
        &mqtt("url = \"mqtt://h:1\"\ntopics = [\"a\"]\nstream = \"nope\"\n"),
        "sources[0].stream",
    );
    assert!(m.contains("\"nope\""), "{m}");
    expect_bad(
        &mqtt(&format!("{ok}format = \"xml\"\n")),
        "sources[0].format",
    );
    let c = parse(&mqtt(&format!("{ok}format = \"line\"\n"))).unwrap();
    let SourceConfig::Mqtt(m) = &c.sources[0] else {
        panic!("expected an mqtt source: {:?}", c.sources[0])
    };
    assert_eq!(m.format, PayloadFormat::Line);
}

#[test]
fn mqtt_mapping_keys_are_typed() {
    let base = "data_dir = \"d\"\n[[streams]]\nname = \"telemetry\"\n[[sources]]\nkind = \"mqtt\"\n\
                url = \"mqtt://127.0.0.1:1883\"\ntopics = [\"a/#\"]\nstream = \"telemetry\"\n";
    let mqtt = |rest: &str| {
        let c = parse(&format!("{base}{rest}")).unwrap();
        let SourceConfig::Mqtt(m) = &c.sources[0] else {
            panic!("expected an mqtt source: {:?}", c.sources[0])
        };
        m.clone()
    };
    let d = mqtt("topic_template = \"a/{device}\"\n");
    assert_eq!(d.value_field, "value");
    assert_eq!(d.unmatched, MqttUnmatched::Drop);
    let s =
        mqtt("topic_template = \"a/{device}\"\nunmatched = \"store\"\nvalue_field = \"temp\"\n");
    assert_eq!(s.unmatched, MqttUnmatched::Store);
    assert_eq!(s.value_field, "temp");
    let bad = |rest: &str, key: &str| expect_bad(&format!("{base}{rest}"), key);
    let m = bad(
        "topic_template = \"a/{device}\"\nunmatched = \"keep\"\n",
        "sources[0].unmatched",
    );
    assert!(m.contains("expected drop | store, found \"keep\""), "{m}");
    bad("unmatched = \"store\"\n", "sources[0].unmatched");
    for v in ["\"\"", "\"_v\""] {
        bad(&format!("value_field = {v}\n"), "sources[0].value_field");
    }
    bad(
        "value_field = \"ts\"\nts_field = \"ts\"\n",
        "sources[0].value_field",
    );
    for t in ["a/{d}/{d}", "a/{_d}"] {
        bad(
            &format!("topic_template = \"{t}\"\n"),
            "sources[0].topic_template",
        );
    }
}

#[test]
fn unknown_keys_and_missing_data_dir_are_named() {
    expect_bad("[[streams]]\nname = \"a\"\n", "data_dir");
    let m = expect_bad(&with("storage", "fsnyc = \"always\""), "storage.fsnyc");
    assert!(m.contains("unknown key"), "{m}");
    expect_bad(&format!("colour = \"blue\"\n{MINIMAL}"), "colour");
}

#[test]
fn wrong_toml_type_names_the_key() {
    let e = parse(&with("storage", "fsync = [1, 2]")).unwrap_err();
    assert!(e.to_string().contains("storage.fsync"), "{e}");
    let e = parse("data_dir = \"d\"\n[[streams]]\nname = \"t\"\n[[sources]]\nkind = \"mqtt\"\ntopics = \"a\"\n")
        .unwrap_err();
    assert!(e.to_string().contains("topics"), "{e}");
}

#[test]
fn malformed_toml_is_a_read_error() {
    let e = parse("data_dir = \n").unwrap_err();
    assert!(matches!(e, ConfigError::Read { .. }), "{e:?}");
}

#[test]
fn environment_overrides_scalar_keys() {
    let env = [
        ("TRIBUTARY_EDGE__HUB__ADDR", "127.0.0.1:7400"),
        ("TRIBUTARY_EDGE__STORAGE__FSYNC", "always"),
        ("TRIBUTARY_EDGE__STORAGE__DISK_BYTES_MAX", "512MiB"),
        ("TRIBUTARY_EDGE__STORAGE__BLOCK_RECORDS_MAX", "7"),
        ("TRIBUTARY_EDGE__HTTP__LISTEN", "127.0.0.1:9999"),
        ("TRIBUTARY_EDGE__DATA_DIR", "/tmp/elsewhere"),
        ("UNRELATED__HUB__ADDR", "ignored:1"),
    ];
    let c = parse_env(FULL, &env).unwrap();
    let hub = c.hub.unwrap();
    assert_eq!(hub.addr, "127.0.0.1:7400");
    assert_eq!(
        hub.server_name, "hub.example.net",
        "keys not overridden keep the file's value"
    );
    assert_eq!(c.storage.fsync, FsyncPolicy::Always);
    assert_eq!(c.storage.disk_bytes_max, 512 << 20);
    assert_eq!(c.storage.block_records_max, 7);
    assert_eq!(c.http.listen, "127.0.0.1:9999".parse().unwrap());
    assert_eq!(c.data_dir, Path::new("/tmp/elsewhere"));
}

#[test]
fn environment_can_add_a_section_and_bad_values_name_the_key() {
    let env = [("TRIBUTARY_EDGE__HTTP__TOKEN", "t0k")];
    assert_eq!(
        parse_env(MINIMAL, &env).unwrap().http.token.as_deref(),
        Some("t0k")
    );
    let e = parse_env(MINIMAL, &[("TRIBUTARY_EDGE__STORAGE__FSYNC", "sometimes")]).unwrap_err();
    assert_eq!(e.key(), Some("storage.fsync"));
    let e = parse_env(MINIMAL, &[("TRIBUTARY_EDGE__HTTP__LISTEN", "nowhere")]).unwrap_err();
    assert_eq!(e.key(), Some("http.listen"));
}

#[test]
fn load_reports_a_missing_file_by_path() {
    let e = EdgeConfig::load_with_env(Path::new("/nonexistent/edge.toml"), Some(HashMap::new()))
        .unwrap_err();
    assert!(e.to_string().starts_with("/nonexistent/edge.toml: "), "{e}");
}

#[test]
fn hub_link_controls_parse_and_are_validated() {
    let base = "data_dir = \"/d\"\n[tls]\nca = \"ca.pem\"\ncert = \"d.pem\"\nkey = \"d.key\"\n[[streams]]\nname = \"t\"\n[hub]\naddr = \"h:7400\"\n";
    let cfg = parse(base).unwrap();
    let hub = cfg.hub.unwrap();
    assert_eq!(hub.backoff_max, Duration::from_secs(30));
    assert_eq!(hub.storage_full_retry, Duration::from_secs(5));
    assert_eq!(hub.bandwidth_bytes_per_s, None);
    let cfg = parse(&format!(
        "{base}backoff_max = \"5s\"\nbandwidth_bytes_per_s = \"64KiB\"\nstorage_full_retry = \"2s\"\n"
    ))
    .unwrap();
    let hub = cfg.hub.unwrap();
    assert_eq!(hub.backoff_max, Duration::from_secs(5));
    assert_eq!(hub.storage_full_retry, Duration::from_secs(2));
    assert_eq!(hub.bandwidth_bytes_per_s, Some(64 << 10));
    let cfg = parse(&format!("{base}bandwidth_bytes_per_s = 1000\n")).unwrap();
    assert_eq!(cfg.hub.unwrap().bandwidth_bytes_per_s, Some(1000));
    assert!(
        expect_bad(&format!("{base}backoff_max = \"0s\"\n"), "hub.backoff_max")
            .contains("above zero")
    );
    expect_bad(
        &format!("{base}backoff_max = \"soon\"\n"),
        "hub.backoff_max",
    );
    assert!(
        expect_bad(
            &format!("{base}storage_full_retry = \"0s\"\n"),
            "hub.storage_full_retry"
        )
        .contains("above zero")
    );
    expect_bad(
        &format!("{base}bandwidth_bytes_per_s = \"0\"\n"),
        "hub.bandwidth_bytes_per_s",
    );
    let cfg = parse_env(base, &[("TRIBUTARY_EDGE__HUB__BACKOFF_MAX", "2s")]).unwrap();
    assert_eq!(cfg.hub.unwrap().backoff_max, Duration::from_secs(2));
}

#[test]
fn hardened_device_config_parses_with_safe_settings() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../firmware/config/edge.toml");
    let c = EdgeConfig::load_with_env(&path, Some(HashMap::new())).unwrap();
    assert_eq!(c.data_dir, Path::new("/var/lib/tributary"));
    assert!(
        c.http.listen.ip().is_loopback(),
        "the device API listens on localhost only"
    );
    assert!(
        c.hub.is_some() && c.tls.is_some(),
        "the device config replicates over mutual TLS"
    );
    assert!(
        !matches!(c.storage.fsync, FsyncPolicy::Never),
        "never is unsafe on power loss"
    );
}

#[test]
fn sensor_sources_parse_and_bad_keys_are_named() {
    let base = "data_dir = \"d\"\n[[streams]]\nname = \"telemetry\"\n[[sources]]\n";
    let c = parse(&format!("{base}kind = \"hwmon\"\nstream = \"telemetry\"\ninterval = \"5s\"\nkey_prefix = \"truck-1\"\n")).unwrap();
    let SourceConfig::Sensor(s) = &c.sources[0] else {
        panic!("expected a sensor source: {:?}", c.sources[0])
    };
    assert_eq!(
        (s.interval, s.key_prefix.as_str()),
        (Duration::from_secs(5), "truck-1")
    );
    let c = parse(&format!(
        "{base}kind = \"simulator\"\nstream = \"telemetry\"\nsim = \"industrial\"\nunits = 4\n"
    ))
    .unwrap();
    let SourceConfig::Sensor(s) = &c.sources[0] else {
        panic!()
    };
    assert_eq!(s.interval, Duration::from_secs(1));
    expect_bad(
        &format!("{base}kind = \"nmea\"\nstream = \"telemetry\"\n"),
        "sources[0].path",
    );
    expect_bad(
        &format!("{base}kind = \"simulator\"\nstream = \"telemetry\"\nsim = \"boat\"\n"),
        "sources[0].sim",
    );
    expect_bad(
        &format!("{base}kind = \"simulator\"\nstream = \"telemetry\"\nhz = \"-1\"\n"),
        "sources[0].hz",
    );
    expect_bad(
        &format!("{base}kind = \"hwmon\"\nstream = \"nope\"\n"),
        "sources[0].stream",
    );
    expect_bad(
        &format!("{base}kind = \"iio\"\nstream = \"telemetry\"\ninterval = \"0s\"\n"),
        "sources[0].interval",
    );
}

#[test]
fn ingest_field_limit_is_typed_bounded_and_reaches_the_log() {
    let minimal = "data_dir = \"data\"\n[[streams]]\nname = \"telemetry\"\n";
    let c = parse(minimal).unwrap();
    assert_eq!(c.ingest.fields_per_record_max, 1000);
    assert_eq!(c.log_config().fields_per_record_max, 1000);
    let c = parse(&with("ingest", "fields_per_record_max = 10")).unwrap();
    assert_eq!(c.log_config().fields_per_record_max, 10);
    let c = parse_env(
        minimal,
        &[("TRIBUTARY_EDGE__INGEST__FIELDS_PER_RECORD_MAX", "7")],
    )
    .unwrap();
    assert_eq!(c.ingest.fields_per_record_max, 7);
    let key = "ingest.fields_per_record_max";
    let m = expect_bad(&with("ingest", "fields_per_record_max = 65529"), key);
    assert!(m.contains("65528"), "{m}");
    expect_bad(&with("ingest", "fields_per_record_max = 0"), key);
    assert!(
        parse(&with("ingest", "fields_max = 3")).is_err(),
        "unknown keys are refused"
    );
}

#[test]
fn sparkplug_source() {
    let base = format!(
        "{MINIMAL}[[sources]]\nkind = \"mqtt\"\nurl = \"mqtt://127.0.0.1:1883\"\nstream = \"telemetry\"\n"
    );
    let c = parse(&format!(
        "{base}format = \"sparkplug\"\nhost_id = \"h1\"\ngroups = [\"plant\", \"yard\"]\nrebirth_interval = \"2s\"\n"
    ))
    .unwrap();
    let edge_agent::config::SourceConfig::Mqtt(m) = &c.sources[0] else {
        panic!("not mqtt: {c:?}");
    };
    assert_eq!(m.topics, ["spBv1.0/plant/#", "spBv1.0/yard/#"]);
    let spb = m.sparkplug.as_ref().unwrap();
    assert_eq!(spb.host_id, "h1");
    assert_eq!(spb.rebirth_interval, std::time::Duration::from_secs(2));
    // Defaults: every group, 10 s between rebirth requests.
    let c = parse(&format!("{base}format = \"sparkplug\"\nhost_id = \"h1\"\n")).unwrap();
    let edge_agent::config::SourceConfig::Mqtt(m) = &c.sources[0] else {
        panic!("not mqtt");
    };
    assert_eq!(m.topics, ["spBv1.0/+/#"]);
    assert_eq!(
        m.sparkplug.as_ref().unwrap().rebirth_interval,
        std::time::Duration::from_secs(10)
    );
    expect_bad(
        &format!("{base}format = \"sparkplug\"\n"),
        "sources[0].host_id",
    );
    expect_bad(
        &format!("{base}format = \"sparkplug\"\nhost_id = \"a/b\"\n"),
        "sources[0].host_id",
    );
    expect_bad(
        &format!("{base}format = \"sparkplug\"\nhost_id = \"h\"\ngroups = []\n"),
        "sources[0].groups",
    );
    expect_bad(
        &format!("{base}format = \"sparkplug\"\nhost_id = \"h\"\ntopics = [\"x\"]\n"),
        "sources[0].topics",
    );
    expect_bad(
        &format!("{base}topics = [\"x\"]\nhost_id = \"h\"\n"),
        "sources[0].host_id",
    );
    let m = expect_bad(
        &format!("{base}topics = [\"x\"]\nformat = \"xml\"\n"),
        "sources[0].format",
    );
    assert!(m.contains("json | line | sparkplug"), "{m}");
}
