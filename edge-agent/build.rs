//! Records the build time, so the agent can check TLS validity against `max(now, build time)`:
//! a board without an RTC that boots at 1970 still connects. `SOURCE_DATE_EPOCH` wins when set,
//! which keeps reproducible builds reproducible.
use std::time::{SystemTime, UNIX_EPOCH};

fn main() {
    let secs = std::env::var("SOURCE_DATE_EPOCH")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or_else(|| {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0)
        });
    println!("cargo:rustc-env=TRIBUTARY_BUILD_UNIX={secs}");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=SOURCE_DATE_EPOCH");
}
