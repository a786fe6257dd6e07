//! The `core-hub` binary: `run`, `pki init|issue|revoke`, `read`, `devices [retire]`,
//! `streams`, `completeness`, `status`, `export`, `recover` and `demo` (see [`cli`]).
//!
//! `run` opens the hub and serves until Ctrl-C or SIGTERM; the other commands go through the
//! hub's HTTP API (locally with `--config`, remotely with `--url`) or its tier 2. Errors print
//! as one line with a documented exit code (`core-hub --help`).

mod cli;

use clap::Parser as _;
use std::process::ExitCode;

fn main() -> ExitCode {
    let _ = rustls::crypto::ring::default_provider().install_default();
    cli::error::install_panic_hook();
    core_hub::logging::init();
    match cli::dispatch(cli::Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => cli::error::report(&e),
    }
}
