//! The hub's `[http]` keys: the limits with their defaults, the three kinds of token, and the
//! key named in every error.

use std::time::Duration;

use core_hub::config::HubConfig;

fn http(text: &str) -> Result<HubConfig, core_hub::config::ConfigError> {
    HubConfig::from_toml(&format!("data_dir = \"/d\"\n[http]\n{text}"))
}

#[test]
fn limits_and_tokens_parse_with_defaults() {
    let d = http("").unwrap().http;
    assert_eq!(d.limits.header_timeout, Duration::from_secs(10));
    assert_eq!(d.limits.body_timeout, Duration::from_secs(30));
    assert_eq!(d.limits.idle_timeout, Duration::from_secs(30));
    assert_eq!(
        (d.limits.connections_max, d.limits.requests_max),
        (1024, 256)
    );
    assert_eq!(
        d.limits.body_bytes_max,
        core_hub::http_limits::BODY_BYTES_MAX
    );
    assert!(d.reader_tokens.is_empty() && d.admin_tokens.is_empty() && d.metrics_token.is_none());

    let c = http(
        "reader_tokens = [\"reader-0123456789\"]\nadmin_tokens = [\"admin-0123456789a\"]\n\
         metrics_token = \"metrics-012345678\"\nheader_timeout = \"2s\"\nbody_timeout = \"3s\"\n\
         idle_timeout = \"4s\"\nconnections_max = 9\nrequests_max = 3\n\
         allowed_hosts = [\"hub.lan\"]",
    )
    .unwrap()
    .http;
    assert_eq!(c.reader_tokens, vec!["reader-0123456789".to_string()]);
    assert_eq!(c.admin_tokens, vec!["admin-0123456789a".to_string()]);
    assert_eq!(c.metrics_token.as_deref(), Some("metrics-012345678"));
    let l = &c.limits;
    assert_eq!(
        (l.header_timeout, l.body_timeout, l.idle_timeout),
        (
            Duration::from_secs(2),
            Duration::from_secs(3),
            Duration::from_secs(4)
        )
    );
    assert_eq!((l.connections_max, l.requests_max), (9, 3));
    assert_eq!(l.allowed_hosts, vec!["hub.lan".to_string()]);
}

#[test]
fn errors_name_the_key() {
    for (bad, key) in [
        ("admin_tokens = [\"short\"]", "http.admin_tokens[0]"),
        ("metrics_token = \"short\"", "http.metrics_token"),
        ("body_timeout = \"0s\"", "http.body_timeout"),
        ("header_timeout = \"later\"", "http.header_timeout"),
        ("requests_max = 0", "http.requests_max"),
        ("connection_max = 5", "connection_max"),
    ] {
        let e = http(bad).unwrap_err().to_string();
        assert!(e.contains(key), "{bad}: {e}");
    }
}
