//! The `core-hub` command line: the clap definitions and one module per command group.
//!
//! Every command is a function returning `anyhow::Result`; [`error::report`] turns a failure
//! into one line on stderr (what is wrong and what to do) and the documented exit code
//! ([`error::Exit`]). Output for people is the default (tables, RFC 3339 times, human
//! sizes); `--json` prints the API's JSON unchanged, for scripts.

pub mod devices;
pub mod error;
pub mod export;
pub mod output;
pub mod pki;
pub mod read;
pub mod run;
pub mod status;
pub mod streams;
pub mod target;
pub mod time;

use clap::{Parser, Subcommand};
use std::path::PathBuf;
use target::Target;

#[derive(Parser, Debug)]
#[command(
    name = "core-hub",
    version,
    about = "Tributary hub: tier-1 log, reader API and PKI",
    after_help = error::EXIT_CODES_HELP
)]
pub struct Cli {
    #[command(subcommand)]
    pub cmd: Cmd,
}

#[derive(Subcommand, Debug)]
pub enum Cmd {
    /// Run the hub.
    Run {
        #[arg(long, default_value = "hub.toml")]
        config: PathBuf,
    },
    /// Manage the fleet PKI.
    Pki {
        #[command(subcommand)]
        cmd: pki::PkiCmd,
    },
    /// Print a stream's committed records as NDJSON (each line with its segment and offset).
    Read(read::ReadArgs),
    /// List devices with their marks, fences and backlog, or retire one.
    #[command(args_conflicts_with_subcommands = true)]
    Devices {
        #[command(subcommand)]
        cmd: Option<devices::DevicesCmd>,
        /// Print the API's JSON instead of a table.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        target: Target,
    },
    /// List streams, or show one: segments, rates and completeness.
    Streams {
        /// Show only this stream, in detail.
        stream: Option<String>,
        /// Print the API's JSON instead of a table.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        target: Target,
    },
    /// Is a stream complete for event times in [--from, --to)? Exit 0 when complete.
    Completeness(streams::CompletenessArgs),
    /// The hub at a glance: health, streams and devices (`--watch` re-renders).
    Status(status::StatusArgs),
    /// Run a hub and simulated edges with flaky links, then verify the merged stream.
    Demo(core_hub::demo::DemoArgs),
    /// Rebuild a lost data directory's catalog from tier 2 (`--from-tier2`).
    Recover {
        #[arg(long, default_value = "hub.toml")]
        config: PathBuf,
        /// Rebuild from the manifests and chunk files in tier 2 (the only source supported).
        #[arg(long)]
        from_tier2: bool,
    },
    /// Export a stream's committed records with event time in [--from, --to) to one Parquet
    /// file: tier 2, plus what the running hub has committed but not yet tiered.
    Export(export::ExportArgs),
}

/// Parses the arguments and runs the command.
pub fn dispatch(cli: Cli) -> anyhow::Result<()> {
    match cli.cmd {
        Cmd::Run { config } => run::run(&config),
        Cmd::Pki { cmd } => pki::pki(cmd),
        Cmd::Read(args) => read::read(args),
        Cmd::Devices { cmd, json, target } => devices::devices(cmd, json, target),
        Cmd::Streams {
            stream,
            json,
            target,
        } => streams::streams(stream.as_deref(), json, &target),
        Cmd::Completeness(args) => streams::completeness(&args),
        Cmd::Status(args) => status::status(&args),
        Cmd::Demo(args) => core_hub::demo::run(&args),
        Cmd::Recover { config, from_tier2 } => run::recover(&config, from_tier2),
        Cmd::Export(args) => export::export(&args),
    }
}

/// A runtime for one command.
pub fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    use anyhow::Context as _;
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
}
