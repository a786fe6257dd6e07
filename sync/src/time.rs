//! The one time parser: every place that accepts a time (the agent's HTTP ingest and MQTT
//! source, the hub's completeness and export, the CLI flags) goes through here, so a time
//! means the same instant everywhere.
//!
//! Accepted forms ([`parse_instant`]):
//! - RFC 3339 with `Z` or a numeric offset and any fraction of a second:
//!   `2025-12-01T12:00:00Z`, `2025-12-01T12:00:00.5+01:00`, `2025-12-01 12:00:00-05:30`.
//!   A time without a zone is refused (it would mean another instant on every machine);
//!   a bare date (`2025-12-01`) is midnight UTC.
//! - An integer since the Unix epoch with an explicit unit: `1764590400s`,
//!   `1764590400000ms`, `1764590400000000us`, `1764590400000000000ns`. A bare integer needs a
//!   unit from its context ([`parse_instant_with`]), such as the HTTP `precision` parameter.
//! - `now`, and times relative to it: `-1h`, `+15m`, `now-1h30m`, `2h ago` (durations as
//!   humantime reads them: `90s`, `1h 30m`, `2days`).
//!
//! Instants are `i64` nanoseconds since the Unix epoch (years 1677 to 2262). Nothing here
//! reads the clock: the caller passes `now`.
//!
//! Plausibility ([`plausible`]): event times before [`PLAUSIBLE_FROM_NS`] (2000-01-01) or
//! more than [`FUTURE_SLACK_NS`] (one day) ahead of the clock are implausible. That window,
//! not the build date, judges a device's clock, so honest backfill of old data is not flagged.
//! [`likely_unit`] names the unit under which an implausible integer would be plausible: a
//! millisecond value read as nanoseconds lands in 1970, and read as milliseconds, today.

use chrono::{DateTime, NaiveDate};
use thiserror::Error;

/// 2000-01-01T00:00:00Z in nanoseconds: event times before it are implausible.
pub const PLAUSIBLE_FROM_NS: i64 = 946_684_800_000_000_000;
/// How far ahead of the clock an event time may be before it is implausible: one day.
pub const FUTURE_SLACK_NS: i64 = 86_400_000_000_000;

/// The unit of an integer epoch timestamp.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TimeUnit {
    S,
    Ms,
    Us,
    Ns,
}

impl TimeUnit {
    /// Every unit, coarsest first.
    pub const ALL: [TimeUnit; 4] = [TimeUnit::S, TimeUnit::Ms, TimeUnit::Us, TimeUnit::Ns];

    /// Reads `s`, `ms`, `us` or `ns` (as Influx's `precision` parameter spells them).
    pub fn parse(s: &str) -> Result<Self, TimeError> {
        match s.trim() {
            "s" => Ok(TimeUnit::S),
            "ms" => Ok(TimeUnit::Ms),
            "us" | "µs" => Ok(TimeUnit::Us),
            "ns" => Ok(TimeUnit::Ns),
            other => Err(TimeError::BadUnit(other.to_owned())),
        }
    }

    /// The unit's short name: `s`, `ms`, `us` or `ns`.
    pub fn name(self) -> &'static str {
        match self {
            TimeUnit::S => "s",
            TimeUnit::Ms => "ms",
            TimeUnit::Us => "us",
            TimeUnit::Ns => "ns",
        }
    }

    /// Nanoseconds in one of this unit.
    pub fn nanos(self) -> i64 {
        match self {
            TimeUnit::S => 1_000_000_000,
            TimeUnit::Ms => 1_000_000,
            TimeUnit::Us => 1_000,
            TimeUnit::Ns => 1,
        }
    }
}

impl std::fmt::Display for TimeUnit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a text or number is not a time. Each message says what was found and what to write.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum TimeError {
    #[error(
        "{0:?} is not a time: expected RFC 3339 with Z or an offset \
         (2025-12-01T12:00:00+01:00), an epoch number with a unit (1764590400s, \
         1764590400000ms, ..us, ..ns), now, or a relative time (-1h, now-30m)"
    )]
    Unrecognised(String),
    #[error(
        "{0:?} has no time zone: add Z for UTC or an offset such as +01:00 \
         (2025-12-01T12:00:00Z)"
    )]
    NoZone(String),
    #[error("{found:?} is not a valid RFC 3339 time: {reason}")]
    BadRfc3339 { found: String, reason: String },
    #[error(
        "{0:?} is an epoch number without a unit: write it with one (1764590400s, \
         1764590400000ms, 1764590400000000us, 1764590400000000000ns)"
    )]
    NoUnit(String),
    #[error("unknown time unit {0:?}: expected ns, us, ms or s")]
    BadUnit(String),
    #[error(
        "{value} {unit} is outside the range of nanosecond timestamps \
         (1677-09-21 to 2262-04-11)"
    )]
    OutOfRange { value: String, unit: TimeUnit },
    #[error("{found:?} is not a relative time: {reason} (expected -1h, +15m, now-1h30m or 2h ago)")]
    BadRelative { found: String, reason: String },
}

/// An integer `value` in `unit` as nanoseconds since the epoch.
pub fn parse_epoch_number(value: i64, unit: TimeUnit) -> Result<i64, TimeError> {
    value
        .checked_mul(unit.nanos())
        .ok_or_else(|| TimeError::OutOfRange {
            value: value.to_string(),
            unit,
        })
}

/// A decimal `value` in `unit` (`1764590400.5` seconds) as nanoseconds since the epoch,
/// rounded to the nearest nanosecond an f64 can tell.
pub fn parse_epoch_f64(value: f64, unit: TimeUnit) -> Result<i64, TimeError> {
    let ns = value * unit.nanos() as f64;
    // i64::MAX as f64 rounds up to 2^63, so the bound is exclusive.
    if ns.is_finite() && ns.abs() < 9.223_372_036_854_775e18 {
        Ok(ns.round() as i64)
    } else {
        Err(TimeError::OutOfRange {
            value: value.to_string(),
            unit,
        })
    }
}

/// RFC 3339 with `Z` or a numeric offset (see the module docs), or a bare date (midnight UTC).
pub fn parse_rfc3339(s: &str) -> Result<i64, TimeError> {
    let t = s.trim();
    if let Ok(d) = NaiveDate::parse_from_str(t, "%Y-%m-%d")
        && t.len() == 10
    {
        let midnight = d.and_hms_opt(0, 0, 0).expect("midnight exists").and_utc();
        return to_ns(midnight.timestamp(), 0, t);
    }
    match DateTime::parse_from_rfc3339(t) {
        Ok(dt) => to_ns(dt.timestamp(), dt.timestamp_subsec_nanos(), t),
        Err(e) => {
            // chrono says "premature end of input" for a missing zone: name the fix instead.
            let naive = chrono::NaiveDateTime::parse_from_str(t, "%Y-%m-%dT%H:%M:%S%.f")
                .or_else(|_| chrono::NaiveDateTime::parse_from_str(t, "%Y-%m-%d %H:%M:%S%.f"));
            if naive.is_ok() {
                return Err(TimeError::NoZone(t.to_owned()));
            }
            Err(TimeError::BadRfc3339 {
                found: t.to_owned(),
                reason: e.to_string(),
            })
        }
    }
}

fn to_ns(secs: i64, subsec: u32, found: &str) -> Result<i64, TimeError> {
    secs.checked_mul(1_000_000_000)
        .and_then(|n| n.checked_add(i64::from(subsec)))
        .ok_or_else(|| TimeError::OutOfRange {
            value: found.to_owned(),
            unit: TimeUnit::Ns,
        })
}

/// Any accepted form (see the module docs) as nanoseconds since the epoch; `now_ns` is the
/// clock for `now` and relative times. A bare integer is refused: its unit is unknown.
pub fn parse_instant(s: &str, now_ns: i64) -> Result<i64, TimeError> {
    parse_instant_with(s, now_ns, None)
}

/// As [`parse_instant`], reading a bare integer in `bare_unit` when there is one.
pub fn parse_instant_with(
    s: &str,
    now_ns: i64,
    bare_unit: Option<TimeUnit>,
) -> Result<i64, TimeError> {
    let t = s.trim();
    if t.is_empty() {
        return Err(TimeError::Unrecognised(s.to_owned()));
    }
    if let Some(r) = relative(t, now_ns) {
        return r;
    }
    if let Some(r) = epoch_text(t, bare_unit) {
        return r;
    }
    if t.as_bytes()[0].is_ascii_digit() && t.contains('-') {
        return parse_rfc3339(t);
    }
    Err(TimeError::Unrecognised(t.to_owned()))
}

/// `now`, `now±D`, `±D` and `D ago`; `None` when `t` is none of them.
fn relative(t: &str, now_ns: i64) -> Option<Result<i64, TimeError>> {
    let lower = t.to_ascii_lowercase();
    if lower == "now" {
        return Some(Ok(now_ns));
    }
    let rest = lower.strip_prefix("now").unwrap_or(&lower).trim_start();
    let (sign, dur) = if let Some(d) = rest.strip_prefix('-') {
        (-1, d)
    } else if let Some(d) = rest.strip_prefix('+') {
        (1, d)
    } else if let Some(d) = rest.strip_suffix("ago") {
        (-1, d)
    } else {
        return None;
    };
    let bad = |reason: String| TimeError::BadRelative {
        found: t.to_owned(),
        reason,
    };
    let d = match humantime::parse_duration(dur.trim()) {
        Ok(d) => d,
        Err(e) => return Some(Err(bad(e.to_string()))),
    };
    let offset = i64::try_from(d.as_nanos()).ok();
    Some(
        offset
            .and_then(|o| now_ns.checked_add(sign * o))
            .ok_or_else(|| bad("too far from now".into())),
    )
}

/// `123`, `123s`, `123ms`, `123us`, `123ns` (optionally signed); `None` when `t` is not one.
fn epoch_text(t: &str, bare_unit: Option<TimeUnit>) -> Option<Result<i64, TimeError>> {
    let digits_end = t
        .char_indices()
        .find(|&(i, c)| !(c.is_ascii_digit() || (i == 0 && c == '-')))
        .map_or(t.len(), |(i, _)| i);
    let (number, suffix) = t.split_at(digits_end);
    if number.is_empty() || number == "-" {
        return None;
    }
    let unit = match suffix.trim() {
        "" => match bare_unit {
            Some(u) => u,
            None => return Some(Err(TimeError::NoUnit(t.to_owned()))),
        },
        u => match TimeUnit::parse(u) {
            Ok(u) => u,
            Err(_) => return None,
        },
    };
    let out_of_range = || TimeError::OutOfRange {
        value: number.to_owned(),
        unit,
    };
    Some(
        number
            .parse::<i64>()
            .map_err(|_| out_of_range())
            .and_then(|v| parse_epoch_number(v, unit)),
    )
}

/// Whether an event time is plausible for a clock reading `now_ns` (see the module docs).
/// A clock behind [`PLAUSIBLE_FROM_NS`] is itself wrong: the future is then judged from there.
pub fn plausible(ts_ns: i64, now_ns: i64) -> bool {
    let horizon = now_ns
        .max(PLAUSIBLE_FROM_NS)
        .saturating_add(FUTURE_SLACK_NS);
    (PLAUSIBLE_FROM_NS..=horizon).contains(&ts_ns)
}

/// For an integer read in `given` that is implausible, the unit under which it would be
/// plausible; `None` when it is plausible as given or under no unit.
pub fn likely_unit(value: i64, given: TimeUnit, now_ns: i64) -> Option<TimeUnit> {
    let as_given = parse_epoch_number(value, given);
    if as_given.is_ok_and(|ns| plausible(ns, now_ns)) {
        return None;
    }
    TimeUnit::ALL
        .into_iter()
        .find(|&u| u != given && parse_epoch_number(value, u).is_ok_and(|ns| plausible(ns, now_ns)))
}

/// `ns` as RFC 3339 in UTC with as many fraction digits as it needs
/// (`2025-12-01T11:00:00.5Z`).
pub fn format_rfc3339(ns: i64) -> String {
    let t = DateTime::from_timestamp_nanos(ns);
    t.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true)
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOON_UTC: i64 = 1_764_590_400_000_000_000; // 2025-12-01T12:00:00Z
    const HOUR: i64 = 3_600_000_000_000;

    #[test]
    fn rfc3339_with_offsets_and_fractions() {
        let cases = [
            ("2025-12-01T12:00:00Z", NOON_UTC),
            ("2025-12-01t12:00:00z", NOON_UTC),
            ("2025-12-01 12:00:00Z", NOON_UTC),
            ("2025-12-01T12:00:00+01:00", NOON_UTC - HOUR),
            ("2025-12-01T12:00:00.5+01:00", NOON_UTC - HOUR + 500_000_000),
            ("2025-12-01T12:00:00-05:30", NOON_UTC + 5 * HOUR + HOUR / 2),
            ("2025-12-01T12:00:00.123456789Z", NOON_UTC + 123_456_789),
            ("2025-12-01T12:00:00.000001+00:00", NOON_UTC + 1_000),
            ("2025-12-01", NOON_UTC - 12 * HOUR),
            ("  2025-12-01T12:00:00Z ", NOON_UTC),
        ];
        for (text, want) in cases {
            assert_eq!(parse_rfc3339(text), Ok(want), "{text}");
            assert_eq!(parse_instant(text, 0), Ok(want), "{text}");
        }
    }

    #[test]
    fn rfc3339_errors_say_what_to_fix() {
        let e = parse_instant("2025-12-01T12:00:00", 0).unwrap_err();
        assert!(matches!(e, TimeError::NoZone(_)), "{e}");
        assert!(e.to_string().contains("add Z for UTC"), "{e}");
        let e = parse_instant("2026-13-01T12:00:00Z", 0).unwrap_err();
        assert!(matches!(e, TimeError::BadRfc3339 { .. }), "{e}");
        assert!(e.to_string().contains("2026-13-01"), "{e}");
        let e = parse_instant("yesterday", 0).unwrap_err();
        assert!(matches!(e, TimeError::Unrecognised(_)), "{e}");
        assert!(e.to_string().contains("RFC 3339"), "{e}");
        assert!(parse_instant("", 0).is_err());
        assert!(
            parse_instant("9999-12-31T00:00:00Z", 0).is_err(),
            "past 2262"
        );
    }

    #[test]
    fn epoch_numbers_with_units() {
        let secs = 1_764_590_400_i64;
        assert_eq!(parse_instant("1764590400s", 0), Ok(NOON_UTC));
        assert_eq!(parse_instant("1764590400000ms", 0), Ok(NOON_UTC));
        assert_eq!(parse_instant("1764590400000000us", 0), Ok(NOON_UTC));
        assert_eq!(parse_instant("1764590400000000000ns", 0), Ok(NOON_UTC));
        assert_eq!(parse_instant("-1s", 0), Ok(-1_000_000_000), "signed epoch");
        for unit in TimeUnit::ALL {
            let v = NOON_UTC / unit.nanos();
            assert_eq!(parse_epoch_number(v, unit), Ok(NOON_UTC), "{unit}");
            assert_eq!(TimeUnit::parse(unit.name()), Ok(unit));
        }
        assert_eq!(parse_epoch_number(secs, TimeUnit::S), Ok(NOON_UTC));
        assert_eq!(parse_epoch_f64(1.5, TimeUnit::S), Ok(1_500_000_000));
        assert_eq!(parse_epoch_f64(1500.25, TimeUnit::Ms), Ok(1_500_250_000));
        let e = parse_epoch_number(i64::MAX, TimeUnit::S).unwrap_err();
        assert!(e.to_string().contains("outside the range"), "{e}");
        assert!(parse_epoch_f64(f64::NAN, TimeUnit::Ns).is_err());
        assert!(parse_epoch_f64(1e30, TimeUnit::Ns).is_err());
        let e = parse_instant("99999999999999999999ns", 0).unwrap_err();
        assert!(matches!(e, TimeError::OutOfRange { .. }), "{e}");
        let e = TimeUnit::parse("min").unwrap_err();
        assert!(e.to_string().contains("expected ns, us, ms or s"), "{e}");
    }

    #[test]
    fn bare_integers_need_a_unit_from_the_context() {
        let e = parse_instant("1764590400", 0).unwrap_err();
        assert!(matches!(e, TimeError::NoUnit(_)), "{e}");
        assert!(e.to_string().contains("1764590400s"), "{e}");
        assert_eq!(
            parse_instant_with("1764590400000", 0, Some(TimeUnit::Ms)),
            Ok(NOON_UTC)
        );
        // An explicit suffix wins over the context's unit.
        assert_eq!(
            parse_instant_with("1764590400s", 0, Some(TimeUnit::Ns)),
            Ok(NOON_UTC)
        );
    }

    #[test]
    fn relative_times() {
        let now = NOON_UTC;
        assert_eq!(parse_instant("now", now), Ok(now));
        assert_eq!(parse_instant("NOW", now), Ok(now));
        assert_eq!(parse_instant("-1h", now), Ok(now - HOUR));
        assert_eq!(parse_instant("+15m", now), Ok(now + HOUR / 4));
        assert_eq!(parse_instant("now-1h30m", now), Ok(now - HOUR * 3 / 2));
        assert_eq!(parse_instant("now - 2h", now), Ok(now - 2 * HOUR));
        assert_eq!(parse_instant("2h ago", now), Ok(now - 2 * HOUR));
        assert_eq!(parse_instant("-1day", now), Ok(now - 24 * HOUR));
        let e = parse_instant("-1parsec", now).unwrap_err();
        assert!(matches!(e, TimeError::BadRelative { .. }), "{e}");
        assert!(e.to_string().contains("-1parsec"), "{e}");
    }

    #[test]
    fn plausibility_is_a_fixed_window_not_the_build_date() {
        let now = NOON_UTC;
        // Backfill from 2001 is honest; 1970 and next week are not.
        assert!(plausible(
            parse_rfc3339("2001-06-01T00:00:00Z").unwrap(),
            now
        ));
        assert!(plausible(PLAUSIBLE_FROM_NS, now));
        assert!(!plausible(PLAUSIBLE_FROM_NS - 1, now));
        assert!(plausible(now + FUTURE_SLACK_NS, now));
        assert!(!plausible(now + FUTURE_SLACK_NS + 1, now));
        assert!(!plausible(1_764_590_400_000, now), "ms read as ns is 1970");
    }

    #[test]
    fn the_likely_unit_of_an_implausible_integer() {
        let now = NOON_UTC;
        let ms = NOON_UTC / 1_000_000;
        assert_eq!(likely_unit(ms, TimeUnit::Ns, now), Some(TimeUnit::Ms));
        assert_eq!(likely_unit(ms / 1000, TimeUnit::Ns, now), Some(TimeUnit::S));
        assert_eq!(
            likely_unit(ms * 1000, TimeUnit::Ns, now),
            Some(TimeUnit::Us)
        );
        assert_eq!(likely_unit(NOON_UTC, TimeUnit::S, now), Some(TimeUnit::Ns));
        assert_eq!(
            likely_unit(ms, TimeUnit::Ms, now),
            None,
            "plausible as given"
        );
        assert_eq!(
            likely_unit(5, TimeUnit::Ns, now),
            None,
            "no unit makes 5 plausible"
        );
    }

    #[test]
    fn formats_round_trip() {
        assert_eq!(format_rfc3339(NOON_UTC), "2025-12-01T12:00:00Z");
        assert_eq!(
            format_rfc3339(NOON_UTC - HOUR + 500_000_000),
            "2025-12-01T11:00:00.500Z"
        );
        let t = NOON_UTC + 123_456_789;
        assert_eq!(parse_rfc3339(&format_rfc3339(t)), Ok(t));
    }
}
