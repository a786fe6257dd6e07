//! The process's own diagnostic log (tracing, to stderr), not the record log of `log/`. One
//! source file compiled into both binaries (the hub includes it by path), so the agent and the
//! hub cannot drift:
//! - `log.format = "text"` (the default): one line per event, coloured only when stderr is a
//!   terminal and `NO_COLOR` is unset, so a log file or journald never gets ANSI codes;
//! - `log.format = "json"`: one JSON object per line (`timestamp`, `level`, `target`,
//!   `message` and the event's fields at the top level), for journald and log shippers.
//!
//! `RUST_LOG` sets the level (default `info`). [`init`] runs first thing in `main`, as text;
//! once the config is read, [`apply`] switches to the configured format, so a config error is
//! still reported as text.

use std::io::IsTerminal;
use std::sync::OnceLock;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer, Registry, reload};

/// How log lines are written (`log.format`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

impl LogFormat {
    /// Parses `log.format`; the error says what the key takes.
    pub fn parse(s: &str) -> Result<LogFormat, String> {
        match s {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            other => Err(format!("is {other:?}: use \"text\" or \"json\"")),
        }
    }
}

/// The raw `[log]` table of either binary's config.
#[derive(Debug, Default, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLog {
    pub format: Option<String>,
}

impl RawLog {
    /// The typed format; `Err` is the problem with `log.format`.
    pub fn parse(&self) -> Result<LogFormat, String> {
        self.format
            .as_deref()
            .map_or(Ok(LogFormat::default()), LogFormat::parse)
    }
}

type Output = Box<dyn Layer<Registry> + Send + Sync>;

/// The handle that switches the installed subscriber's format.
static OUTPUT: OnceLock<reload::Handle<Output, Registry>> = OnceLock::new();

/// Installs the process's subscriber, writing text to stderr. Calling it again does nothing.
pub fn init() {
    if OUTPUT.get().is_some() {
        return;
    }
    let (layer, handle) = reload::Layer::new(output(LogFormat::Text));
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    if tracing_subscriber::registry()
        .with(layer)
        .with(filter)
        .try_init()
        .is_ok()
    {
        let _ = OUTPUT.set(handle);
    }
}

/// Switches to `format` (installing the subscriber first if [`init`] did not run).
pub fn apply(format: LogFormat) {
    init();
    if let Some(handle) = OUTPUT.get() {
        let _ = handle.reload(output(format));
    }
}

/// Whether text lines get colour: only on a terminal, and never with `NO_COLOR` set.
pub fn colour() -> bool {
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

fn output(format: LogFormat) -> Output {
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    match format {
        LogFormat::Text => fmt.with_ansi(colour()).boxed(),
        LogFormat::Json => fmt
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false)
            .boxed(),
    }
}

/// A list as a log field: `a,b,c` (Display of each), never `["a", "b"]`.
pub struct List<'a, T>(pub &'a [T]);

impl<T: std::fmt::Display> std::fmt::Display for List<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, v) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{v}")?;
        }
        Ok(())
    }
}

/// An optional value as a log field: the value, or `none`, never `Some(..)`.
pub struct Maybe<'a, T: ?Sized>(pub Option<&'a T>);

impl<T: std::fmt::Display + ?Sized> std::fmt::Display for Maybe<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(v) => write!(f, "{v}"),
            None => f.write_str("none"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn format_names_what_the_key_takes() {
        assert_eq!(LogFormat::parse("json"), Ok(LogFormat::Json));
        assert_eq!(LogFormat::parse("text"), Ok(LogFormat::Text));
        let err = LogFormat::parse("JSON").unwrap_err();
        assert!(err.contains("\"text\" or \"json\""), "{err}");
        assert_eq!(RawLog::default().parse(), Ok(LogFormat::Text));
    }

    #[test]
    fn fields_print_without_debug_syntax() {
        assert_eq!(List(&["a", "b"]).to_string(), "a,b");
        assert_eq!(List::<u64>(&[]).to_string(), "");
        assert_eq!(Maybe(Some(&3u64)).to_string(), "3");
        assert_eq!(Maybe::<u64>(None).to_string(), "none");
    }
}
