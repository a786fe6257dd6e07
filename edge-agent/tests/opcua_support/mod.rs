//! The asyncua server of the OPC UA tests (`opcua_server.py`, pinned in `.ci/test`), and the
//! metric reader they share.

#![allow(dead_code)] // each test binary uses its own part

use std::ffi::OsStr;
use std::process::{Child, Command, Stdio};

/// The asyncua server, killed on drop.
pub struct Server(Child);

impl Server {
    /// Starts `opcua_server.py PORT BASE [extra...]` and waits for its "ready" line.
    pub fn start(port: u16, base: i64, extra: &[&OsStr]) -> Server {
        let check = Command::new("python3")
            .args(["-c", "import asyncua"])
            .status()
            .expect("python3 is needed for the OPC UA tests");
        assert!(
            check.success(),
            "asyncua is not installed: pip install asyncua==1.1.5 (as .ci/test does)"
        );
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/opcua_server.py");
        let mut child = Command::new("python3")
            .arg(script)
            .arg(port.to_string())
            .arg(base.to_string())
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        std::io::BufRead::read_line(&mut out, &mut line).unwrap();
        assert_eq!(
            line.trim(),
            "ready",
            "the OPC UA server did not start: {extra:?}"
        );
        Server(child)
    }

    pub fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The value of the metric line starting with `prefix` (name and labels), if present.
pub fn metric(text: &str, prefix: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}
