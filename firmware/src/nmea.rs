//! GPS positions from NMEA 0183 sentences (GGA, RMC), read from a serial device or a file.
//!
//! Sentence parsing is the `nmea` crate's (AeroRust/nmea, built with only its GGA and RMC
//! parsers). This module frames lines, checks each checksum itself (so a corrupted line is
//! counted as a checksum error and never half-parsed), and merges the sentences of one fix
//! epoch into one record keyed `{device_id}/gps`:
//!
//! | field         | type | from       | meaning                                           |
//! |---------------|------|------------|---------------------------------------------------|
//! | `lat`, `lon`  | f64  | GGA or RMC | degrees, WGS84, south and west negative           |
//! | `alt_m`       | f64  | GGA        | altitude above mean sea level, metres             |
//! | `speed_kmh`   | f64  | RMC        | speed over ground                                 |
//! | `course_deg`  | f64  | RMC        | true course over ground                           |
//! | `fix_quality` | i64  | GGA        | 0 invalid, 1 GPS, 2 DGPS, 3 PPS, 4 RTK, 5 float RTK, 6 estimated, 7 manual, 8 simulation |
//! | `satellites`  | i64  | GGA        | satellites used in the fix                        |
//! | `hdop`        | f64  | GGA        | horizontal dilution of precision                  |
//! | `fix_valid`   | bool | GGA or RMC | the receiver reports a usable fix                 |
//!
//! Fields the epoch's sentences do not carry are left out. Receivers send the sentences of one
//! epoch back to back with the same UTC time, so a record is emitted when an epoch has both
//! GGA and RMC, when a sentence with another time arrives, or at the end of the input.
//!
//! The record's timestamp is the sentence's UTC date and time when the epoch has an RMC with a
//! date; otherwise (GGA only: time of day, no date) it is the caller's receive time of the
//! epoch's first sentence. Bad lines (checksum mismatch, garbage) are counted in
//! [`NmeaStats`] and reported as [`NmeaLineError`]s; they never stop the stream. Valid
//! sentences of other types (GSV, GSA, VTG, ...) are counted as ignored.
//!
//! A serial device is read as a plain file: set its line speed first (for example
//! `stty -F /dev/ttyUSB0 9600 raw -echo`, or a udev rule); this crate does not touch termios.

use std::fs::File;
use std::io::{self, BufRead, BufReader};
use std::path::{Path, PathBuf};

use ::nmea::ParseResult;
use ::nmea::sentences::rmc::RmcStatusOfFix;
use ::nmea::sentences::{FixType, GgaData, RmcData};
use chrono::{NaiveDate, NaiveTime};
use sync::{Record, Value};
use thiserror::Error;

/// NMEA 0183 allows 82 characters; some receivers send longer proprietary lines. Anything
/// past this is not a sentence, and is discarded up to the next newline without buffering.
pub const LINE_BYTES_MAX: usize = 256;
/// Garbage is quoted in errors, but only this much of it.
const QUOTE_CHARS_MAX: usize = 48;

/// Counters over everything a parser has seen.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NmeaStats {
    /// Non-empty lines read.
    pub lines: u64,
    /// GGA and RMC sentences parsed and merged.
    pub sentences: u64,
    /// Valid sentences of other types, skipped.
    pub ignored: u64,
    /// Lines whose checksum did not match.
    pub checksum_errors: u64,
    /// Lines that are not NMEA sentences, or GGA/RMC sentences with malformed fields.
    pub garbage: u64,
    /// Records produced.
    pub records: u64,
}

/// Why one line was not used. Counted in [`NmeaStats`]; never fatal.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum NmeaLineError {
    /// The sentence's checksum does not match its content.
    #[error(
        "NMEA line {line}: checksum mismatch: computed {computed:02X}, sentence says {found:02X}"
    )]
    Checksum { line: u64, computed: u8, found: u8 },
    /// The line is not an NMEA sentence, or a GGA/RMC sentence has malformed fields.
    #[error("NMEA line {line}: {reason}: {text:?}")]
    Garbage {
        line: u64,
        reason: String,
        text: String,
    },
}

/// Opening the NMEA input failed.
#[derive(Debug, Error)]
#[error("opening NMEA input {}: {source}", path.display())]
pub struct NmeaOpenError {
    pub path: PathBuf,
    #[source]
    pub source: io::Error,
}

/// Reading the NMEA input failed (for example a USB receiver was unplugged).
#[derive(Debug, Error)]
#[error("reading NMEA input: {0}")]
pub struct NmeaReadError(#[from] pub io::Error);

/// What one [`NmeaReader::read_batch`] call produced.
#[derive(Debug, Default)]
pub struct NmeaBatch {
    pub records: Vec<Record>,
    pub errors: Vec<NmeaLineError>,
    /// The input ended (end of file, or a serial device hung up). Pending data was flushed.
    pub eof: bool,
}

/// Turns NMEA lines into position records. Pure: no IO, no clock.
#[derive(Debug)]
pub struct NmeaParser {
    key: String,
    pending: Option<Epoch>,
    stats: NmeaStats,
}

/// The sentences of one fix epoch merged so far.
#[derive(Debug)]
struct Epoch {
    time: Option<NaiveTime>,
    recv_ns: i64,
    gga: Option<GgaData>,
    rmc: Option<RmcData>,
}

impl NmeaParser {
    /// Records are keyed `{device_id}/gps`.
    pub fn new(device_id: &str) -> Self {
        NmeaParser {
            key: format!("{device_id}/gps"),
            pending: None,
            stats: NmeaStats::default(),
        }
    }

    /// Feeds one line (a trailing `\r\n` is fine). `recv_ns` is when it was received; it
    /// becomes the timestamp only if the epoch's sentences carry no date. Returns the previous
    /// epoch's record when this line completes or closes it.
    pub fn push_line(&mut self, line: &str, recv_ns: i64) -> Result<Option<Record>, NmeaLineError> {
        let line = line.trim();
        if line.is_empty() {
            return Ok(None);
        }
        self.stats.lines += 1;
        let parsed = match check_frame(line, self.stats.lines) {
            Ok(Some(kind)) => parse_known(line, kind, self.stats.lines),
            Ok(None) => {
                self.stats.ignored += 1;
                return Ok(None);
            }
            Err(e) => Err(e),
        };
        match parsed {
            Ok(sentence) => {
                self.stats.sentences += 1;
                Ok(self.merge(sentence, recv_ns))
            }
            Err(e) => {
                match e {
                    NmeaLineError::Checksum { .. } => self.stats.checksum_errors += 1,
                    NmeaLineError::Garbage { .. } => self.stats.garbage += 1,
                }
                Err(e)
            }
        }
    }

    /// Emits the pending epoch, if any (at the end of the input).
    pub fn flush(&mut self) -> Option<Record> {
        let epoch = self.pending.take()?;
        self.stats.records += 1;
        Some(epoch.into_record(&self.key))
    }

    /// Counters so far.
    pub fn stats(&self) -> NmeaStats {
        self.stats
    }

    /// Counts a line longer than [`LINE_BYTES_MAX`] as garbage.
    fn reject_too_long(&mut self, text: &str) -> NmeaLineError {
        self.stats.lines += 1;
        self.stats.garbage += 1;
        NmeaLineError::Garbage {
            line: self.stats.lines,
            reason: format!("longer than {LINE_BYTES_MAX} bytes"),
            text: text.chars().take(QUOTE_CHARS_MAX).collect(),
        }
    }

    /// Adds a sentence to the pending epoch, emitting the epoch it closes or completes.
    fn merge(&mut self, sentence: ParseResult, recv_ns: i64) -> Option<Record> {
        let time = match &sentence {
            ParseResult::GGA(g) => g.fix_time,
            ParseResult::RMC(r) => r.fix_time,
            _ => return None,
        };
        let is_gga = matches!(sentence, ParseResult::GGA(_));
        let closes = self.pending.as_ref().is_some_and(|p| {
            p.time != time || (is_gga && p.gga.is_some()) || (!is_gga && p.rmc.is_some())
        });
        let mut emitted = if closes { self.flush() } else { None };
        let epoch = self.pending.get_or_insert(Epoch {
            time,
            recv_ns,
            gga: None,
            rmc: None,
        });
        match sentence {
            ParseResult::GGA(g) => epoch.gga = Some(g),
            ParseResult::RMC(r) => epoch.rmc = Some(r),
            _ => {}
        }
        if epoch.gga.is_some() && epoch.rmc.is_some() {
            // Only one of the two can be emitted per line: a closed epoch leaves a new one
            // holding a single sentence, which cannot be complete yet.
            emitted = emitted.or_else(|| self.flush());
        }
        emitted
    }
}

/// The sentence types this module reads.
#[derive(Debug, Clone, Copy)]
enum Known {
    Gga,
    Rmc,
}

/// Checks `$<address>,<data>*<hh>` and its checksum. `Ok(None)` is a valid sentence of a type
/// this module does not read.
fn check_frame(line: &str, line_no: u64) -> Result<Option<Known>, NmeaLineError> {
    let garbage = |reason: &str| NmeaLineError::Garbage {
        line: line_no,
        reason: reason.to_owned(),
        text: line.chars().take(QUOTE_CHARS_MAX).collect(),
    };
    let body = line
        .strip_prefix('$')
        .ok_or_else(|| garbage("does not start with '$'"))?;
    let (content, hex) = body
        .rsplit_once('*')
        .ok_or_else(|| garbage("no '*' checksum"))?;
    let found = (hex.len() == 2)
        .then(|| u8::from_str_radix(hex, 16).ok())
        .flatten()
        .ok_or_else(|| garbage("checksum is not two hex digits"))?;
    if !content.is_ascii() {
        return Err(garbage("not ASCII"));
    }
    let computed = content.bytes().fold(0u8, |c, b| c ^ b);
    if computed != found {
        return Err(NmeaLineError::Checksum {
            line: line_no,
            computed,
            found,
        });
    }
    let address = content.split(',').next().unwrap_or_default();
    Ok(match address.get(2..).filter(|_| address.len() == 5) {
        Some("GGA") => Some(Known::Gga),
        Some("RMC") => Some(Known::Rmc),
        _ => None,
    })
}

/// Parses a checksummed GGA or RMC sentence with the `nmea` crate.
fn parse_known(line: &str, kind: Known, line_no: u64) -> Result<ParseResult, NmeaLineError> {
    let parsed = ::nmea::parse_str(line).map_err(|e| NmeaLineError::Garbage {
        line: line_no,
        reason: format!("malformed {kind:?} sentence ({e})"),
        text: line.chars().take(QUOTE_CHARS_MAX).collect(),
    })?;
    Ok(parsed)
}

impl Epoch {
    fn into_record(self, key: &str) -> Record {
        let ts = self
            .rmc
            .as_ref()
            .and_then(|r| sentence_ns(r.fix_date?, r.fix_time?))
            .unwrap_or(self.recv_ns);
        let mut fields: Vec<(String, Value)> = Vec::with_capacity(9);
        let mut put = |name: &str, value: Option<Value>| {
            if let Some(v) = value {
                fields.push((name.to_owned(), v));
            }
        };
        let (gga, rmc) = (self.gga.as_ref(), self.rmc.as_ref());
        let f = |v: Option<f64>, decimals: i32| v.map(|v| Value::F64(round(v, decimals)));
        put(
            "lat",
            f(gga.and_then(|g| g.latitude).or(rmc.and_then(|r| r.lat)), 7),
        );
        put(
            "lon",
            f(gga.and_then(|g| g.longitude).or(rmc.and_then(|r| r.lon)), 7),
        );
        put("alt_m", f(gga.and_then(|g| g.altitude).map(f64::from), 2));
        put(
            "speed_kmh",
            f(
                rmc.and_then(|r| r.speed_over_ground)
                    .map(|kn| f64::from(kn) * 1.852),
                2,
            ),
        );
        put(
            "course_deg",
            f(rmc.and_then(|r| r.true_course).map(f64::from), 2),
        );
        put(
            "fix_quality",
            gga.and_then(|g| g.fix_type)
                .map(|t| Value::I64(fix_quality(t))),
        );
        put(
            "satellites",
            gga.and_then(|g| g.fix_satellites)
                .map(|n| Value::I64(i64::from(n))),
        );
        put("hdop", f(gga.and_then(|g| g.hdop).map(f64::from), 2));
        let valid = match (gga.and_then(|g| g.fix_type), rmc) {
            (Some(t), _) => Some(t.is_valid()),
            (None, Some(r)) => Some(r.status_of_fix != RmcStatusOfFix::Invalid),
            (None, None) => None,
        };
        put("fix_valid", valid.map(Value::Bool));
        Record {
            tags: Vec::new(),
            key: key.to_owned(),
            ts,
            fields,
        }
    }
}

/// Nanoseconds since the Unix epoch for a UTC date and time, if representable.
fn sentence_ns(date: NaiveDate, time: NaiveTime) -> Option<i64> {
    date.and_time(time).and_utc().timestamp_nanos_opt()
}

/// GGA's fix quality digit.
fn fix_quality(t: FixType) -> i64 {
    match t {
        FixType::Invalid => 0,
        FixType::Gps => 1,
        FixType::DGps => 2,
        FixType::Pps => 3,
        FixType::Rtk => 4,
        FixType::FloatRtk => 5,
        FixType::Estimated => 6,
        FixType::Manual => 7,
        FixType::Simulation => 8,
    }
}

/// The crate parses into `f32` for some fields; rounding drops the float noise (545.4 rather
/// than 545.4000244140625), as the receiver sent it.
fn round(v: f64, decimals: i32) -> f64 {
    let m = 10f64.powi(decimals);
    (v * m).round() / m
}

/// Reads NMEA lines from a file or a serial device and parses them in batches.
#[derive(Debug)]
pub struct NmeaReader<R> {
    reader: R,
    parser: NmeaParser,
    line: Vec<u8>,
}

impl NmeaReader<BufReader<File>> {
    /// Opens a file or a serial device (already configured for its line speed).
    pub fn open(path: &Path, device_id: &str) -> Result<Self, NmeaOpenError> {
        let file = File::open(path).map_err(|source| NmeaOpenError {
            path: path.to_owned(),
            source,
        })?;
        Ok(NmeaReader::new(BufReader::new(file), device_id))
    }
}

impl<R: BufRead> NmeaReader<R> {
    /// Reads from any buffered reader (tests use a byte slice).
    pub fn new(reader: R, device_id: &str) -> Self {
        NmeaReader {
            reader,
            parser: NmeaParser::new(device_id),
            line: Vec::with_capacity(LINE_BYTES_MAX),
        }
    }

    /// Reads up to `lines_max` lines, blocking until they arrive on a serial device, and
    /// returns the records and line errors they produced. `recv_ns` is called once per line
    /// for its receive time. At the end of the input the pending epoch is flushed and
    /// [`NmeaBatch::eof`] is set.
    pub fn read_batch(
        &mut self,
        lines_max: usize,
        mut recv_ns: impl FnMut() -> i64,
    ) -> Result<NmeaBatch, NmeaReadError> {
        let mut batch = NmeaBatch::default();
        for _ in 0..lines_max {
            let Some(too_long) = self.next_line()? else {
                batch.records.extend(self.parser.flush());
                batch.eof = true;
                break;
            };
            let now = recv_ns();
            match self.parse_line(too_long, now) {
                Ok(record) => batch.records.extend(record),
                Err(e) => batch.errors.push(e),
            }
        }
        Ok(batch)
    }

    /// Counters so far.
    pub fn stats(&self) -> NmeaStats {
        self.parser.stats()
    }

    fn parse_line(&mut self, too_long: bool, now: i64) -> Result<Option<Record>, NmeaLineError> {
        let text = String::from_utf8_lossy(&self.line).into_owned();
        if too_long {
            return Err(self.parser.reject_too_long(&text));
        }
        self.parser.push_line(&text, now)
    }

    /// Reads one line into `self.line`, keeping at most [`LINE_BYTES_MAX`] bytes. Returns
    /// `None` at the end of the input, else whether the line was too long.
    fn next_line(&mut self) -> io::Result<Option<bool>> {
        self.line.clear();
        let mut too_long = false;
        let mut read_any = false;
        loop {
            let available = match self.reader.fill_buf() {
                Ok(b) => b,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            if available.is_empty() {
                return Ok(read_any.then_some(too_long));
            }
            read_any = true;
            let newline = available.iter().position(|&b| b == b'\n');
            let chunk = &available[..newline.unwrap_or(available.len())];
            let room = LINE_BYTES_MAX.saturating_sub(self.line.len());
            too_long |= chunk.len() > room;
            self.line.extend_from_slice(&chunk[..chunk.len().min(room)]);
            let used = newline.map_or(available.len(), |i| i + 1);
            self.reader.consume(used);
            if newline.is_some() {
                return Ok(Some(too_long));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_checks() {
        let gga = "$GPGGA,123519,4807.038,N,01131.000,E,1,08,0.9,545.4,M,46.9,M,,*47";
        assert!(matches!(check_frame(gga, 1), Ok(Some(Known::Gga))));
        let bad = "$GPGGA,123519,4807.038,N,01131.000,E,1,08,0.9,545.4,M,46.9,M,,*48";
        assert!(matches!(
            check_frame(bad, 1),
            Err(NmeaLineError::Checksum {
                computed: 0x47,
                found: 0x48,
                ..
            })
        ));
        assert!(matches!(
            check_frame("hello", 1),
            Err(NmeaLineError::Garbage { .. })
        ));
        assert!(matches!(
            check_frame("$GPGGA,1,2", 1),
            Err(NmeaLineError::Garbage { .. })
        ));
        assert!(matches!(
            check_frame("$GPGGA,1*zz", 1),
            Err(NmeaLineError::Garbage { .. })
        ));
    }

    #[test]
    fn rounding_drops_float_noise() {
        assert_eq!(round(f64::from(545.4f32), 2), 545.4);
    }
}
