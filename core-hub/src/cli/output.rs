//! Output for people: aligned tables, RFC 3339 times, human sizes and epochs in the one form
//! both binaries print (16 hex digits, as in the agent's segment file names and metrics).

use std::fmt::Write as _;
use std::io::Write as _;

/// Writes `text` to stdout and flushes; a closed stdout comes back as `BrokenPipe`, which
/// [`super::error::report`] turns into a quiet exit.
pub fn print(text: &str) -> std::io::Result<()> {
    print_bytes(text.as_bytes())
}

/// [`print`] for bytes (NDJSON pages as the hub sent them).
pub fn print_bytes(bytes: &[u8]) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(bytes)?;
    out.flush()
}

/// Pretty JSON of an API answer, for `--json` (the API's own fields and types, unchanged).
pub fn json(v: &serde_json::Value) -> anyhow::Result<()> {
    let mut s = serde_json::to_string_pretty(v)?;
    s.push('\n');
    Ok(print(&s)?)
}

/// A table with left-aligned columns separated by two spaces.
pub struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(header: &[&str]) -> Table {
        Table {
            header: header.iter().map(|h| h.to_string()).collect(),
            rows: Vec::new(),
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        assert_eq!(
            cells.len(),
            self.header.len(),
            "a row has one cell per column"
        );
        self.rows.push(cells);
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The rendered table, one line per row after the header.
    pub fn render(&self) -> String {
        let mut widths: Vec<usize> = self.header.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (w, c) in widths.iter_mut().zip(row) {
                *w = (*w).max(c.chars().count());
            }
        }
        let mut out = String::new();
        for row in std::iter::once(&self.header).chain(&self.rows) {
            let mut line = String::new();
            for (i, (c, w)) in row.iter().zip(&widths).enumerate() {
                if i + 1 == row.len() {
                    line.push_str(c);
                } else {
                    let _ = write!(line, "{c:<w$}  ");
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

/// ns since the Unix epoch as RFC 3339 UTC with milliseconds; `-` for none.
pub fn time(ns: Option<i64>) -> String {
    match ns {
        Some(ns) if ns >= 0 => {
            let t = std::time::UNIX_EPOCH + std::time::Duration::from_nanos(ns as u64);
            humantime::format_rfc3339_millis(t).to_string()
        }
        Some(ns) => ns.to_string(),
        None => "-".into(),
    }
}

/// A byte count in binary units (`512 B`, `1.5 KiB`, `3.2 GiB`).
pub fn size(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = bytes as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

/// An epoch as both binaries print it: 16 lowercase hex digits.
pub fn epoch(e: u64) -> String {
    sync::epoch::format(e)
}

/// An epoch from API JSON: the hex string of today's API, or a number from an older hub.
pub fn epoch_of(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::String(s) => s.clone(),
        v => v.as_u64().map_or_else(|| "-".into(), epoch),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_align() {
        let mut t = Table::new(&["NAME", "RECORDS"]);
        t.row(vec!["telemetry".into(), "40".into()]);
        t.row(vec!["x".into(), "1".into()]);
        assert_eq!(
            t.render(),
            "NAME       RECORDS\ntelemetry  40\nx          1\n"
        );
    }

    #[test]
    fn sizes_times_epochs() {
        assert_eq!(size(512), "512 B");
        assert_eq!(size(1536), "1.5 KiB");
        assert_eq!(size(3 << 30), "3.0 GiB");
        assert_eq!(
            time(Some(1_764_374_400_000_000_000)),
            "2025-11-29T00:00:00.000Z"
        );
        assert_eq!(time(None), "-");
        assert_eq!(epoch(0xab), "00000000000000ab");
        assert_eq!(epoch_of(&serde_json::json!(171)), "00000000000000ab");
        assert_eq!(
            epoch_of(&serde_json::json!("00000000000000ab")),
            "00000000000000ab"
        );
    }
}
