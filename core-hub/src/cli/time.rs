//! Times on the command line (`--from`, `--to`): the one parser shared by both binaries and
//! the API ([`sync::time`]), so a time means the same instant wherever it is given. Relative
//! times (`-1h`, `now`) are resolved here, against this machine's clock, before a request.

use anyhow::{Result, anyhow};
use sync::time::{TimeUnit, parse_instant_with};

/// ns since the Unix epoch of `value`, given for `flag`; a bare integer is nanoseconds.
pub fn parse(flag: &str, value: &str) -> Result<i64> {
    parse_instant_with(value, now_ns(), Some(TimeUnit::Ns)).map_err(|e| {
        anyhow!(
            "{flag} `{value}`: {e}; use RFC 3339 (2026-11-29T00:00:00Z, +01:00 offsets too), \
             a relative time (-1h, now) or ns since the Unix epoch"
        )
    })
}

/// This machine's clock, ns since the Unix epoch.
pub fn now_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
}
