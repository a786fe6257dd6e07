//! Replays the committed corpus of every cargo-fuzz target in `core-hub/fuzz/` on stable Rust,
//! through the same function the target calls (`core-hub/fuzz/bodies.rs`, compiled here by
//! path), so the corpora are regression tests in `cargo test` even where nightly and libFuzzer
//! are absent. A crash `cargo fuzz` finds is fixed, then its input goes into the target's
//! corpus, where this test keeps it fixed. See docs/fuzzing.md.
//!
//! `TRIBUTARY_WRITE_FIXTURES=1` (re)writes the hand-made seeds (`seed-*`); without it, the test
//! checks that they are all present (seeds are inputs, not golden outputs).

#[path = "../fuzz/bodies.rs"]
mod bodies;
#[path = "../../sync/fuzz/replay.rs"]
mod replay;

use std::collections::BTreeMap;

use core_hub::HubConfig;
use core_hub::streams::Cut;

use replay::Target;

const TARGETS: [(&str, Target); 4] = [
    ("hub_config", bodies::hub_config),
    ("cut_token", bodies::cut_token),
    ("api_params", bodies::api_params),
    ("cert_identity", bodies::cert_identity),
];

const FULL_CONFIG: &str = r#"data_dir = "/var/lib/hub"
[listen]
quic = "127.0.0.1:9000"
http = "[::1]:9001"
[tls]
ca = "pki/ca.pem"
cert = "pki/hub.pem"
key = "pki/hub.key"
[tier2]
url = "s3://bucket/prefix"
endpoint = "http://127.0.0.1:9000"
chunk_records_max = 5000
chunk_bytes_max = "8MiB"
chunk_age_max = "10s"
tier1_retention_bytes = "1GiB"
tier1_budget_bytes = "4GiB"
tier2_retention_time = "30days"
[wal]
segment_bytes_max = "64MiB"
group_commit_linger = "2ms"
[ingest]
memory_bytes_max = "1GiB"
block_bytes_max = "4MiB"
records_per_block_max = 5000
streams_per_connection_max = 8
[[streams]]
name = "telemetry"
scale = { target_records_per_s = 1000, window = "30s", min_segments = 1, max_segments = 8 }
[[streams]]
name = "status"
keys_prefixed_by_device = true
[devices.truck-1]
streams = ["status"]
[http]
reader_tokens = ["0123456789abcdef0123"]
[completeness]
clock_skew = "5s"
[republish]
url = "mqtt://127.0.0.1:1883"
streams = ["telemetry"]
topic_template = "tributary/{stream}/{device}/{key}"
"#;

/// A device certificate as `core-hub pki issue` writes it, in DER.
fn device_cert_der() -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    core_hub::pki::init(dir.path(), &[], false).unwrap();
    let out = core_hub::pki::issue(dir.path(), "truck-1", &dir.path().join("out")).unwrap();
    let certs = core_hub::pki::load_certs(&out.device_pem).unwrap();
    certs[0].as_ref().to_vec()
}

fn seeds() -> Vec<(&'static str, &'static str, Vec<u8>)> {
    let cut = Cut {
        stream: 3,
        positions: BTreeMap::from([(1, 10), (2, 20), (7, 0)]),
    };
    // The raw form `cut_token` also accepts: a token body, sealed by the target itself.
    let mut raw_body = vec![1u8, 3, 2, 1, 10, 2, 20];
    raw_body.extend([0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01]);
    let cert = device_cert_der();
    let mut cut_cert = cert.clone();
    cut_cert.truncate(cert.len() / 2);
    vec![
        (
            "hub_config",
            "seed-full.toml",
            FULL_CONFIG.as_bytes().to_vec(),
        ),
        (
            "hub_config",
            "seed-minimal.toml",
            b"data_dir = \"/d\"\n".to_vec(),
        ),
        (
            "hub_config",
            "seed-bad-key.toml",
            b"data_dir = \"/d\"\n[wal]\ngroup_commit_linger = \"soon\"\n".to_vec(),
        ),
        (
            "hub_config",
            "seed-not-toml.toml",
            b"[listen\nquic = ".to_vec(),
        ),
        ("cut_token", "seed-token.txt", cut.token().into_bytes()),
        ("cut_token", "seed-raw-body.bin", raw_body),
        (
            "cut_token",
            "seed-bad-crc.txt",
            b"AQMCAQoCFAcAAAAAAA".to_vec(),
        ),
        ("api_params", "seed-start.txt", b"start".to_vec()),
        (
            "api_params",
            "seed-offset.txt",
            b"18446744073709551615".to_vec(),
        ),
        (
            "api_params",
            "seed-time.txt",
            b"2026-11-29T10:00:00.123+01:00".to_vec(),
        ),
        (
            "api_params",
            "seed-positions.txt",
            b"1:5, 2:7,,3:0".to_vec(),
        ),
        (
            "api_params",
            "seed-url.txt",
            b"http://127.0.0.1:7480/prefix/".to_vec(),
        ),
        (
            "api_params",
            "seed-revocations.txt",
            b"truck-1\n# comment\ntruck-2 0A1b  # one certificate\n\n".to_vec(),
        ),
        (
            "api_params",
            "seed-template.txt",
            b"tributary/{stream}/{device}/{key}".to_vec(),
        ),
        ("cert_identity", "seed-device.der", cert),
        ("cert_identity", "seed-truncated.der", cut_cert),
        ("cert_identity", "seed-empty.der", Vec::new()),
    ]
}

#[test]
fn every_corpus_file_passes_its_target() {
    replay::replay(env!("CARGO_MANIFEST_DIR"), &TARGETS);
}

#[test]
fn seeds_are_on_disk() {
    replay::seeds_on_disk(env!("CARGO_MANIFEST_DIR"), seeds());
}

#[test]
fn the_seeds_reach_past_the_checks() {
    // Seeds only help the fuzzer if they are valid where they should be.
    assert!(HubConfig::from_toml(FULL_CONFIG).is_ok());
    let (device, _) = core_hub::pki::cert_identity(&device_cert_der().into()).unwrap();
    assert_eq!(device, "truck-1");
    let e = HubConfig::from_toml("data_dir = \"/d\"\n[wal]\ngroup_commit_linger = \"soon\"\n")
        .unwrap_err();
    assert!(
        e.to_string()
            .starts_with("config key `wal.group_commit_linger`"),
        "unclear error: {e}"
    );
}
