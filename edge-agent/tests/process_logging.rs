//! The agent's own log as an operator meets it: a log file holds no ANSI colour codes and no
//! `Debug` text; `log.format = "json"` writes one JSON object per line; a config error names
//! the environment variable that set the bad value.

mod process_support;

use edge_agent::config::EdgeConfig;
use process_support::Setup;
use std::collections::HashMap;
use std::path::Path;

fn assert_plain(log: &str) {
    for line in log.lines() {
        assert!(
            !line.contains('\u{1b}'),
            "an ANSI escape in the log file: {line:?}"
        );
        for debug in ["Pos {", " { ", "Some(", "[\""] {
            assert!(!line.contains(debug), "Debug text {debug:?} in: {line}");
        }
    }
}

#[test]
fn a_log_file_is_plain_text() {
    let setup = Setup::new("fsync = \"always\"");
    let mut agent = setup.start();
    agent.terminate();
    let log = agent.log_text();
    assert!(log.contains("INFO"), "{log}");
    assert_plain(&log);
}

#[test]
fn json_log_lines_parse() {
    let setup = Setup::new("fsync = \"always\"\n[log]\nformat = \"json\"");
    let mut agent = setup.start();
    agent.terminate();
    let log = agent.log_text();
    let lines: Vec<&str> = log.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(lines.len() >= 2, "too few lines: {log}");
    for line in lines {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not a JSON line ({e}): {line}"));
        assert!(v["level"].is_string() && v["message"].is_string(), "{line}");
    }
}

#[test]
fn config_errors_name_the_environment_variable() {
    let text = "data_dir = \"data\"\n[[streams]]\nname = \"telemetry\"\n";
    let env = HashMap::from([(
        "TRIBUTARY_EDGE__HTTP__LISTEN".to_string(),
        "nowhere".to_string(),
    )]);
    let err = EdgeConfig::from_toml(text, Path::new("/tmp"), Some(env))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("http.listen") && err.contains("TRIBUTARY_EDGE__HTTP__LISTEN"),
        "the key and the variable are not both named: {err}"
    );
    let bad = "data_dir = \"data\"\n[log]\nformat = \"xml\"\n[[streams]]\nname = \"telemetry\"\n";
    let err = EdgeConfig::from_toml(bad, Path::new("/tmp"), None)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("log.format") && err.contains("\"json\""),
        "{err}"
    );
}
