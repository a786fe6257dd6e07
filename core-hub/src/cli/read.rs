//! `core-hub read STREAM [--from ..] [--follow] [--key K] [--group G --reader R]`.
//!
//! Pages through the stream (each page starts at the previous page's cut); with `--follow`,
//! then holds one streaming response open and prints records as the hub pushes them. A
//! follow that loses the hub (it stopped, crashed or restarted) says so on stderr and
//! reconnects with backoff from the offset after the last record it printed, so the output
//! has neither gaps nor duplicates. It gives up (exit 3) once no reconnect has worked for
//! `--retry-for` (default 5 minutes), or never with `--retry-forever`. Only whole lines are
//! printed: a record cut off by a lost connection is read again after the reconnect.

use super::error::{Exit, coded};
use super::output;
use super::target::{self, Target};
use anyhow::{Context as _, Result, bail};
use core_hub::client::{self, ApiTarget, query_escape};
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug)]
pub struct ReadArgs {
    pub stream: String,
    /// `start`, a hub offset, an RFC 3339 time (hub ingest time) or a stream cut.
    #[arg(long, default_value = "start")]
    pub from: String,
    /// Keep running and print records as they commit; reconnect if the hub goes away.
    #[arg(long)]
    pub follow: bool,
    /// With --follow: give up (exit 3) after the hub has been unreachable this long.
    #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
    pub retry_for: Duration,
    /// With --follow: never give up reconnecting.
    #[arg(long, conflicts_with = "retry_for")]
    pub retry_forever: bool,
    /// Only this routing key.
    #[arg(long)]
    pub key: Option<String>,
    /// Read as a member of this reader group (created from `--from` if new); the hub
    /// stores the checkpoints, and each batch is checkpointed once printed.
    #[arg(long, requires = "reader")]
    pub group: Option<String>,
    /// This reader's name in the group.
    #[arg(long, requires = "group")]
    pub reader: Option<String>,
    /// Output format (only `ndjson`).
    #[arg(long, default_value = "ndjson")]
    pub format: String,
    /// Stop after this many records.
    #[arg(long)]
    pub limit: Option<u64>,
    #[command(flatten)]
    pub target: Target,
}

/// Backoff between reconnect attempts: doubling from the first to the last.
const BACKOFF_FIRST: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

pub fn read(a: ReadArgs) -> Result<()> {
    if a.format != "ndjson" {
        bail!(
            "--format {} is not supported; use --format ndjson",
            a.format
        );
    }
    let rt = super::runtime()?;
    match (&a.group, &a.reader) {
        (Some(g), Some(r)) => rt.block_on(read_group(&a, g, r)),
        _ => rt.block_on(Follower::new(&a)?.run()),
    }
}

/// A plain read's progress: where the next request starts and what is left to print.
struct Follower<'a> {
    a: &'a ReadArgs,
    target: ApiTarget,
    /// The next request's `from`: the first page's, then a cut or the next hub offset.
    from: String,
    left: u64,
    key: String,
    /// The tail of a line not yet complete.
    partial: Vec<u8>,
    /// Why the hub ended the follow response, from its shutdown line.
    ended: Option<String>,
}

impl<'a> Follower<'a> {
    fn new(a: &'a ReadArgs) -> Result<Follower<'a>> {
        Ok(Follower {
            target: target::api_target(&a.target)?,
            from: a.from.clone(),
            left: a.limit.unwrap_or(u64::MAX),
            key: a
                .key
                .as_deref()
                .map(|k| format!("&key={}", query_escape(k)))
                .unwrap_or_default(),
            partial: Vec::new(),
            ended: None,
            a,
        })
    }

    async fn run(mut self) -> Result<()> {
        while self.left > 0 {
            match self.page().await {
                Ok(true) => {}
                Ok(false) => break,
                Err(e) if self.a.follow && is_lost(&e) => self.reconnect(&e).await?,
                Err(e) => return Err(e),
            }
        }
        while self.a.follow && self.left > 0 {
            let lost = self.follow().await?;
            self.reconnect(&lost).await?;
        }
        Ok(())
    }

    /// One page; `false` once caught up.
    async fn page(&mut self) -> Result<bool> {
        let page = self.left.min(core_hub::api::RECORDS_LIMIT_MAX as u64);
        let path = format!(
            "/v1/streams/{}/records?from={}&limit={page}{}",
            self.a.stream,
            query_escape(&self.from),
            self.key
        );
        let resp = target::get_ok(&self.target, &path).await?;
        let next = resp
            .header(core_hub::streams::api::NEXT_CUT_HEADER)
            .context("the hub's answer lacks the next-cut header (is it a Tributary hub?)")?
            .to_string();
        if resp.body.is_empty() {
            self.from = next;
            return Ok(false);
        }
        self.emit(&resp.body)?;
        self.partial.clear();
        self.from = next;
        Ok(true)
    }

    /// Holds a follow response open until the hub ends it or goes away; returns why.
    async fn follow(&mut self) -> Result<anyhow::Error> {
        let limit = match self.left {
            u64::MAX => String::new(),
            n => format!("&limit={n}"),
        };
        let path = format!(
            "/v1/streams/{}/records?from={}&follow=true{limit}{}",
            self.a.stream,
            query_escape(&self.from),
            self.key
        );
        self.partial.clear();
        self.ended = None;
        let mut failed = None;
        let target = self.target.clone();
        let result = client::get_streaming(&target, &path, |data| match self.emit(data) {
            Ok(()) => self.left > 0 && self.ended.is_none(),
            Err(e) => {
                failed = Some(e);
                false
            }
        })
        .await;
        if let Some(e) = failed {
            return Err(e);
        }
        if let Some(why) = self.ended.take() {
            return Ok(coded(
                Exit::Unreachable,
                format!("the hub ended the follow: {why}"),
            ));
        }
        match result {
            Ok(resp) if resp.status == 200 && self.left == 0 => Ok(anyhow::anyhow!("done")),
            Ok(resp) if resp.status == 200 => {
                Ok(coded(Exit::Unreachable, "the hub ended the follow stream"))
            }
            Ok(resp) if resp.status == 503 => Ok(target::api_error(&resp)),
            Ok(resp) => Err(target::api_error(&resp)),
            Err(e) => Ok(target::unreachable(&self.target, &e)),
        }
    }

    /// Prints the complete lines of `data` (after any partial line before it) and moves
    /// `from` past the last one printed. The hub's shutdown line (the last of a follow
    /// response it ends) is not printed: it sets `from` and `ended`.
    fn emit(&mut self, data: &[u8]) -> Result<()> {
        self.partial.extend_from_slice(data);
        let Some(end) = self.partial.iter().rposition(|&b| b == b'\n') else {
            return Ok(());
        };
        let whole: Vec<u8> = self.partial.drain(..=end).collect();
        let mut lines: Vec<&[u8]> = whole.split_inclusive(|&b| b == b'\n').collect();
        let tail = |l: &[u8]| serde_json::from_slice::<LineTail>(l);
        if let Some(last) = lines.last()
            && let Ok(LineTail {
                end: Some(why),
                next_offset: Some(next),
                ..
            }) = tail(last)
        {
            lines.pop();
            self.ended = Some(why);
            self.from = next.to_string();
        }
        lines.truncate(usize::try_from(self.left).unwrap_or(usize::MAX));
        let Some(last) = lines.last() else {
            return Ok(());
        };
        let offset = tail(last)
            .ok()
            .and_then(|t| t.offset)
            .context("the hub sent a record line without an offset")?;
        output::print_bytes(&lines.concat())?;
        self.left = self.left.saturating_sub(lines.len() as u64);
        self.from = (offset + 1).to_string();
        Ok(())
    }

    /// Waits for the hub to answer again, with backoff; fails once `--retry-for` is spent.
    async fn reconnect(&mut self, why: &anyhow::Error) -> Result<()> {
        if self.left == 0 {
            return Ok(());
        }
        let giving_up = if self.a.retry_forever {
            "never gives up".to_string()
        } else {
            format!(
                "gives up after {}",
                humantime::format_duration(self.a.retry_for)
            )
        };
        eprintln!(
            "core-hub: lost the hub ({}); reconnecting from `{}` ({giving_up})",
            super::error::one_line(&format!("{why:#}")),
            self.from
        );
        let started = Instant::now();
        let mut wait = BACKOFF_FIRST;
        loop {
            tokio::time::sleep(wait).await;
            match client::get(&self.target, "/healthz").await {
                Ok(r) if r.status == 200 => {
                    eprintln!(
                        "core-hub: reconnected to http://{}; resuming at `{}`",
                        self.target.authority, self.from
                    );
                    return Ok(());
                }
                _ => {}
            }
            if !self.a.retry_forever && started.elapsed() >= self.a.retry_for {
                return Err(coded(
                    Exit::Unreachable,
                    format!(
                        "gave up reconnecting to the hub at http://{} after {}; resume with --from {}",
                        self.target.authority,
                        humantime::format_duration(self.a.retry_for),
                        self.from
                    ),
                ));
            }
            wait = (wait * 2).min(BACKOFF_MAX);
        }
    }
}

/// What `read` looks at in a line: a record's offset, or the hub's shutdown line.
#[derive(serde::Deserialize)]
struct LineTail {
    offset: Option<u64>,
    end: Option<String>,
    next_offset: Option<u64>,
}

/// Whether a failed request means the hub is (for now) away rather than refusing.
fn is_lost(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<super::error::Coded>().is_some_and(|c| {
            c.code == Exit::Unreachable || c.msg.starts_with("the hub answered 503")
        })
    })
}

/// Reads as a reader-group member: poll a batch, print it, checkpoint it with the next poll.
async fn read_group(a: &ReadArgs, group: &str, reader: &str) -> Result<()> {
    if a.key.is_some() {
        bail!("--key cannot be combined with --group: a group reads whole segments");
    }
    let target = target::api_target(&a.target)?;
    let base = format!("/v1/streams/{}/groups/{group}/readers/{reader}", a.stream);
    let mut left = a.limit.unwrap_or(u64::MAX);
    let mut positions = String::new();
    let wait = if a.follow { 1000 } else { 0 };
    while left > 0 {
        let max = left.min(10_000);
        let path = format!(
            "{base}/records?max={max}&wait_ms={wait}&from={}&checkpoint={}",
            query_escape(&a.from),
            query_escape(&positions)
        );
        let resp = target::get_ok(&target, &path).await?;
        positions = resp
            .header(core_hub::streams::api::POSITIONS_HEADER)
            .unwrap_or_default()
            .to_string();
        if resp.body.is_empty() {
            if a.follow {
                continue;
            }
            break;
        }
        let lines = resp.body.iter().filter(|&&b| b == b'\n').count() as u64;
        output::print_bytes(&resp.body)?;
        left = left.saturating_sub(lines);
    }
    if !positions.is_empty() {
        let path = format!("{base}/checkpoint?positions={}", query_escape(&positions));
        target::post_ok(&target, &path).await?;
    }
    Ok(())
}
