//! `core-hub pki` as an operator runs it: the binary, its exit status and what it prints.
//!
//! - `pki revoke --serial` with a serial the PKI never issued to that device fails, says why,
//!   names the issuance record, and writes nothing; the same serial in `openssl x509 -text`
//!   form is accepted and written normalised.
//! - `pki issue` refuses to replace an existing device key without `--force`.

use std::path::Path;
use std::process::{Command, Output};

fn core_hub(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_core-hub"))
        .args(args)
        .env("NO_COLOR", "1")
        .output()
        .expect("run core-hub")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn issue(pki: &str, device: &str, out: &Path) -> Output {
    let out = out.display().to_string();
    core_hub(&[
        "pki", "issue", "--dir", pki, "--device", device, "--out", &out,
    ])
}

/// The serial `pki issue` printed: `... (serial 42bb...)`.
fn printed_serial(o: &Output) -> String {
    let s = String::from_utf8_lossy(&o.stdout);
    let at = s.find("(serial ").expect("the serial is printed") + "(serial ".len();
    s[at..].trim_end().trim_end_matches(')').to_string()
}

/// `openssl x509 -text` style: uppercase pairs between colons.
fn colon_form(serial: &str) -> String {
    let even = if serial.len() % 2 == 1 {
        format!("0{serial}")
    } else {
        serial.to_string()
    };
    let pairs: Vec<String> = even
        .as_bytes()
        .chunks(2)
        .map(|p| String::from_utf8_lossy(p).to_uppercase())
        .collect();
    pairs.join(":")
}

#[test]
fn revoke_refuses_a_serial_the_pki_never_issued_to_the_device() {
    let dir = tempfile::tempdir().unwrap();
    let pki_dir = dir.path().join("pki");
    let pki = pki_dir.display().to_string();
    assert!(core_hub(&["pki", "init", "--dir", &pki]).status.success());
    let d1 = issue(&pki, "truck-1", &dir.path().join("truck-1"));
    let d2 = issue(&pki, "truck-2", &dir.path().join("truck-2"));
    assert!(d1.status.success() && d2.status.success(), "{}", text(&d1));
    let (s1, s2) = (printed_serial(&d1), printed_serial(&d2));

    let revoke = |device: &str, serial: &str| {
        core_hub(&[
            "pki", "revoke", "--dir", &pki, "--device", device, "--serial", serial,
        ])
    };
    // truck-2's serial is no certificate of truck-1.
    let refused = revoke("truck-1", &colon_form(&s2));
    assert!(!refused.status.success(), "an unknown serial was accepted");
    let msg = text(&refused);
    println!("pki revoke with another device's serial: {}", msg.trim());
    assert!(msg.contains(&s2), "the message names the serial: {msg}");
    assert!(
        msg.contains("truck-1"),
        "the message names the device: {msg}"
    );
    assert!(
        msg.contains("issued.txt"),
        "the message names the record: {msg}"
    );
    assert!(
        msg.contains(&s1),
        "the message lists the device's own serials: {msg}"
    );
    // A serial that is not hex at all.
    let garbage = revoke("truck-1", "42:zz:57");
    assert!(!garbage.status.success());
    assert!(text(&garbage).contains("`zz`"), "{}", text(&garbage));
    assert!(
        !pki_dir.join("revoked.txt").exists(),
        "a refused revocation wrote the list"
    );

    // The device's own serial in colon form is accepted and written normalised.
    let ok = revoke("truck-1", &colon_form(&s1));
    assert!(ok.status.success(), "{}", text(&ok));
    let list = std::fs::read_to_string(pki_dir.join("revoked.txt")).unwrap();
    assert_eq!(list, format!("truck-1 {s1}\n"));
}

#[test]
fn issue_refuses_to_replace_a_device_key_without_force() {
    let dir = tempfile::tempdir().unwrap();
    let pki = dir.path().join("pki").display().to_string();
    assert!(core_hub(&["pki", "init", "--dir", &pki]).status.success());
    let out = dir.path().join("truck-1");
    assert!(issue(&pki, "truck-1", &out).status.success());
    let key = std::fs::read(out.join("device.key")).unwrap();
    let again = issue(&pki, "truck-1", &out);
    assert!(
        !again.status.success(),
        "the key was replaced without --force"
    );
    assert!(text(&again).contains("--force"), "{}", text(&again));
    assert_eq!(std::fs::read(out.join("device.key")).unwrap(), key);
    let outs = out.display().to_string();
    let forced = core_hub(&[
        "pki", "issue", "--dir", &pki, "--device", "truck-1", "--out", &outs, "--force",
    ]);
    assert!(forced.status.success(), "{}", text(&forced));
    assert_ne!(std::fs::read(out.join("device.key")).unwrap(), key);
}
