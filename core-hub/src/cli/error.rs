//! One error style for the CLI: a single line on stderr that says what is wrong and what to
//! do, and an exit code a script can branch on.
//!
//! No error chain is printed as a list and no backtrace is shown unless `RUST_BACKTRACE` is
//! set; a panic prints one line too. A closed stdout (`core-hub streams | head`) ends the
//! command quietly with exit 0, as `cat` and `grep` do.

use std::process::ExitCode;

/// The exit codes, as printed by `core-hub --help`.
pub const EXIT_CODES_HELP: &str = "\
Exit codes:
  0  success (also an export of an empty window, and a reader whose stdout was closed)
  1  failure: bad input, or the hub answered an error (the line on stderr says which)
  2  usage: unknown command, flag or value
  3  the hub cannot be reached (or `read --follow` gave up reconnecting)
  4  completeness: devices still owe data for the window
  5  completeness: settled, with gaps a device reported lost
  6  export: records committed in the window are missing from the file";

/// An exit status other than plain failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    Failed = 1,
    Unreachable = 3,
    Owed = 4,
    Gaps = 5,
    Incomplete = 6,
}

/// An error that carries its exit code; an empty message prints nothing (the command has
/// already said what it had to).
#[derive(Debug, thiserror::Error)]
#[error("{msg}")]
pub struct Coded {
    pub code: Exit,
    pub msg: String,
}

/// An error with exit code `code`.
pub fn coded(code: Exit, msg: impl Into<String>) -> anyhow::Error {
    Coded {
        code,
        msg: msg.into(),
    }
    .into()
}

/// Installs the one-line panic message (the full default one with `RUST_BACKTRACE`).
pub fn install_panic_hook() {
    if backtrace_wanted() {
        return;
    }
    std::panic::set_hook(Box::new(|info| {
        let msg = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| (*s).to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "panic".into());
        let at = info
            .location()
            .map(|l| format!(" at {}:{}", l.file(), l.line()))
            .unwrap_or_default();
        eprintln!(
            "core-hub: internal error: {}{at}; please report it (RUST_BACKTRACE=1 shows a backtrace)",
            one_line(&msg)
        );
    }));
}

fn backtrace_wanted() -> bool {
    std::env::var_os("RUST_BACKTRACE").is_some_and(|v| v != "0")
}

/// Whether `e` is our stdout closed by its reader.
pub fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// Prints `e` as one line and returns its exit code.
pub fn report(e: &anyhow::Error) -> ExitCode {
    if is_broken_pipe(e) {
        return ExitCode::SUCCESS;
    }
    let code = e
        .chain()
        .find_map(|c| c.downcast_ref::<Coded>())
        .map_or(Exit::Failed, |c| c.code);
    let line = one_line(&format!("{e:#}"));
    if !line.is_empty() {
        eprintln!("core-hub: {line}");
    }
    if backtrace_wanted() {
        eprintln!("{e:?}");
    }
    ExitCode::from(code as u8)
}

/// `s` on one line: line breaks become "; ", trailing blanks go.
pub fn one_line(s: &str) -> String {
    s.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chains_and_bodies_print_on_one_line() {
        let e = anyhow::anyhow!("bad\nbody\n").context("the hub answered 400");
        assert_eq!(
            one_line(&format!("{e:#}")),
            "the hub answered 400: bad; body"
        );
    }

    #[test]
    fn a_closed_stdout_is_quiet() {
        let e = anyhow::Error::from(std::io::Error::from(std::io::ErrorKind::BrokenPipe))
            .context("writing records");
        assert!(is_broken_pipe(&e));
        assert!(!is_broken_pipe(&anyhow::anyhow!("other")));
    }
}
