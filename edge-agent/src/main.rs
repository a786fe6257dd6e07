//! The `edge-agent` binary: the device agent and its operator commands.
//!
//! - `run`: open the local log (recovering it), serve the HTTP API, stop cleanly on SIGTERM/ctrl-c;
//! - `ingest`: send NDJSON or line protocol from stdin to a running agent;
//! - `status`: ask a running agent for its streams, backlog, link state and dropped counts;
//! - `inspect`: print a stopped agent's stored records as NDJSON;
//! - `bench append`: measure durable append throughput and latency on this device's storage.
//!
//! Errors are reported as one line that says what to fix, and a non-zero exit.

mod cli;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

#[derive(Debug, Parser)]
#[command(
    name = "edge-agent",
    version,
    about = "Tributary's device agent: durable local log, ingest and replication"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the agent: recover the local log, then serve the HTTP API until SIGTERM or ctrl-c.
    Run {
        /// The agent's config file (TOML); TRIBUTARY_EDGE__* variables override its keys.
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Send records from stdin to a running agent, in batches; exits non-zero on the first refusal.
    Ingest(IngestArgs),
    /// Show a running agent's streams, backlog, link state and dropped counts.
    Status {
        /// Find the agent through this config's http.listen (and http.token).
        #[arg(long, short, conflicts_with = "url")]
        config: Option<PathBuf>,
        /// The agent's API, such as http://127.0.0.1:7401 (the default).
        #[arg(long)]
        url: Option<String>,
        /// Print the raw JSON report.
        #[arg(long)]
        json: bool,
    },
    /// Print a stopped agent's stored records of one stream as NDJSON (epoch, seq, key, ts, fields).
    Inspect {
        #[arg(long, short)]
        config: PathBuf,
        #[arg(long, short)]
        stream: String,
        /// Start at this seq of the current epoch (default: everything held, every epoch).
        #[arg(long)]
        from_seq: Option<u64>,
    },
    /// Check the config, certificates, clock, disk, broker and hub; says what to fix.
    Doctor {
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Benchmarks for qualifying a device's storage.
    Bench {
        #[command(subcommand)]
        what: BenchCommand,
    },
}

#[derive(Debug, clap::Args)]
struct IngestArgs {
    /// The stream to append to.
    #[arg(long, short)]
    stream: String,
    /// How stdin encodes records.
    #[arg(long, value_enum, default_value_t = Format::Json)]
    format: Format,
    /// Find the agent through this config's http.listen (and http.token).
    #[arg(long, short, conflicts_with = "url")]
    config: Option<PathBuf>,
    /// The agent's API, such as http://127.0.0.1:7401 (the default).
    #[arg(long)]
    url: Option<String>,
    /// Lines per request: each request is one atomic, durable batch.
    #[arg(long, default_value_t = 1000)]
    batch_lines: usize,
    /// Bearer token, when the agent requires one and --config does not give it.
    #[arg(long)]
    token: Option<String>,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Format {
    Json,
    Line,
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// Durable append throughput and latency for each fsync policy, record size and producer count.
    Append {
        /// One JSON object per configuration instead of a table.
        #[arg(long)]
        json: bool,
        /// Where to write (default: a temporary directory under the current one).
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Records per configuration.
        #[arg(long, default_value_t = 1_000_000)]
        records: u64,
        /// Also measure the disk: sequential write MB/s and fdatasync rate.
        #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
        disk: bool,
    },
}

fn main() -> ExitCode {
    // One crypto provider for the whole process: ring (see docs/operations.md).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run { config } => cli::run::run(&config),
        Command::Ingest(a) => cli::ingest::ingest(cli::ingest::Args {
            stream: a.stream,
            line_protocol: matches!(a.format, Format::Line),
            config: a.config,
            url: a.url,
            batch_lines: a.batch_lines.max(1),
            token: a.token,
        }),
        Command::Status { config, url, json } => cli::status::status(config.as_deref(), url, json),
        Command::Inspect {
            config,
            stream,
            from_seq,
        } => cli::inspect::inspect(&config, &stream, from_seq),
        Command::Doctor { config } => cli::doctor::doctor(&config),
        Command::Bench {
            what:
                BenchCommand::Append {
                    json,
                    dir,
                    records,
                    disk,
                },
        } => edge_agent::bench::run_append(&edge_agent::bench::AppendOptions {
            json,
            dir,
            records,
            disk,
        })
        .map_err(anyhow::Error::from),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("edge-agent: {e:#}");
            ExitCode::FAILURE
        }
    }
}
