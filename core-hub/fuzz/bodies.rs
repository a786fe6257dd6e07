//! Fuzz target bodies for the hub: its decoders of text and bytes from outside the process
//! (configuration, stream-cut tokens and the other request parameters, the revocation list,
//! client certificates). Frames and blocks from devices are fuzzed in `sync/fuzz`, tier-2
//! chunks in `core-hub/tier/fuzz`.
//!
//! This file is the `core-hub/fuzz` crate's library, so each cargo-fuzz target is a one-line
//! wrapper, and `core-hub/tests/fuzz_corpus.rs` compiles the very same file (by path) to replay
//! every committed corpus file on stable Rust. Each function must never panic on any input; it
//! asserts what must hold whenever parsing succeeds, and that errors say what is wrong.

use core_hub::HubConfig;
use core_hub::client::ApiTarget;
use core_hub::completeness::{format_time, parse_time};
use core_hub::config::valid_device_id;
use core_hub::pki::RevocationList;
use core_hub::republish::topic::{TOPIC_BYTES_LIMIT, Template, Values, check_topic};
use core_hub::streams::Cut;
use core_hub::streams::api::{format_positions, parse_positions};
use core_hub::streams::reader::{Start, StartError};
use rustls::pki_types::CertificateDer;

/// Arbitrary text as the hub's `hub.toml` (`HubConfig::from_toml`, no environment).
pub fn hub_config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match HubConfig::from_toml(text) {
        Ok(config) => {
            let limits = config.decode_limits();
            assert!(
                limits.records_max > 0,
                "a valid config decodes some records"
            );
            let _ = (config.catalog_path(), config.wal_dir());
        }
        Err(e) => {
            let msg = e.to_string();
            assert!(
                msg.starts_with("cannot read the configuration: ")
                    || msg.starts_with("config key `"),
                "errors name the file or the key: {msg}"
            );
        }
    }
}

/// Arbitrary text as a stream-cut token (`Cut::parse`). Tokens carry a CRC a fuzzer rarely
/// guesses, so the input is also used as the token's body: sealed with a valid CRC and
/// encoded, it reaches the varint decoding behind the check. Valid cuts round-trip.
pub fn cut_token(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data) {
        check_cut(text);
    }
    let mut body = data.to_vec();
    body.extend_from_slice(&crc32c::crc32c(&body).to_le_bytes());
    check_cut(&base64url(&body));
}

fn check_cut(token: &str) {
    match Cut::parse(token) {
        Ok(cut) => {
            let again = cut.token();
            assert_eq!(
                Cut::parse(&again).as_ref(),
                Ok(&cut),
                "token(cut) parses back"
            );
            assert!(again.starts_with('A'), "tokens start with the version");
            // Digits or an RFC 3339 time win over the cut reading, by design.
            if let Ok(Start::Cut(c)) = Start::parse(token) {
                assert_eq!(c, cut, "a start from a cut is that cut");
            }
        }
        Err(e) => assert!(!e.to_string().is_empty(), "errors say what is wrong"),
    }
}

/// Arbitrary text through the hub's small parsers of request parameters and files: a reader's
/// `from`, a group's `S:O,S:O` positions, completeness query times, the CLI's API URL, the
/// revocation list and the republish topic template.
pub fn api_params(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match Start::parse(text) {
        Ok(Start::Offset(o)) => assert_eq!(text.parse::<u64>().ok(), Some(o)),
        Ok(_) => {}
        Err(StartError::Unrecognised(s)) | Err(StartError::BadCut(s, _)) => {
            assert_eq!(s, text, "the error quotes the input")
        }
    }
    if let Some(positions) = parse_positions(text) {
        let formatted = format_positions(&positions);
        assert_eq!(
            parse_positions(&formatted),
            Some(positions),
            "format_positions parses back"
        );
    }
    if let Ok(ns) = parse_time(text) {
        let shown = format_time(ns);
        // Shown times are RFC 3339 to the millisecond: they parse back to the same millisecond.
        let back = parse_time(&shown).expect("a formatted time parses");
        assert_eq!(
            back.div_euclid(1_000_000),
            ns.div_euclid(1_000_000),
            "{shown}"
        );
    }
    if let Ok(t) = ApiTarget::parse(text, None) {
        assert!(t.authority.contains(':'), "an API target has a port");
        assert!(!t.base_path.ends_with('/'), "no trailing slash");
    }
    let revoked = RevocationList::parse(text);
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or("").trim();
        let mut parts = line.split_whitespace();
        if let (Some(device), None) = (parts.next(), parts.next()) {
            assert!(revoked.is_revoked(device), "a listed device is revoked");
        }
    }
    // A template that parses renders hostile values into a checked topic with as many
    // levels as the template has: a value never adds a level or a wildcard.
    if let Ok(template) = Template::parse(text) {
        let levels = |t: &str| t.split('/').count();
        let topic = template.render(Values {
            stream: "telemetry",
            device: "dev/+",
            key: "$SYS/#\0",
        });
        let probe = template.render(Values {
            stream: "s",
            device: "d",
            key: "k",
        });
        assert_eq!(levels(&topic), levels(&probe), "{text:?} -> {topic:?}");
        assert!(check_topic(&topic, TOPIC_BYTES_LIMIT).is_ok() || topic.len() > 60_000);
    }
}

/// Arbitrary bytes as a device's client certificate (DER), as the QUIC listener sees it.
pub fn cert_identity(data: &[u8]) {
    let cert = CertificateDer::from(data);
    match core_hub::pki::cert_identity(&cert) {
        Ok((device, serial)) => {
            assert!(
                valid_device_id(&device),
                "device ids are validated: {device:?}"
            );
            assert!(
                serial
                    .bytes()
                    .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()),
                "serials are lowercase hex: {serial}"
            );
            assert!(!RevocationList::default().is_cert_revoked(&cert));
        }
        Err(e) => {
            assert!(!e.to_string().is_empty(), "errors say what is wrong");
            // Revocation fails closed: a certificate without an identity counts as revoked.
            assert!(RevocationList::default().is_cert_revoked(&cert));
        }
    }
}

fn base64url(b: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b)
}
