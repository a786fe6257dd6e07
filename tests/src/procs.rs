//! Child processes for system tests: the real hub and agent binaries, started, killed and
//! restarted by the test, with their output kept in files for the failure message.
//!
//! Also the one waiting primitive the harness uses: [`wait_until`] polls a condition inside a
//! deadline. It waits for the condition itself, never for a guessed amount of time.

use std::ffi::{OsStr, OsString};
use std::fs::{File, OpenOptions};
use std::io;
use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};

use crate::http;

/// Longest pause between two polls of a condition.
const POLL_MAX: Duration = Duration::from_millis(50);

/// Lines of each log shown when a process-related wait fails.
const LOG_TAIL_LINES: usize = 40;

/// The path of a workspace binary, e.g. `bin_path("core-hub")`.
///
/// Cargo sets `CARGO_BIN_EXE_<name>` only for tests of the package that defines the binary, so
/// this looks next to the running test executable instead: `target/<profile>/deps/<test>` gives
/// `target/<profile>/<name>`. `TRIBUTARY_BIN_DIR` overrides the directory. The binaries must
/// have been built first (`cargo build --workspace`, as `.ci/test` does); [`Proc::spawn`] says so
/// when one is missing.
pub fn bin_path(name: &str) -> PathBuf {
    if let Some(dir) = std::env::var_os("TRIBUTARY_BIN_DIR") {
        return PathBuf::from(dir).join(name);
    }
    let exe = std::env::current_exe().unwrap_or_else(|_| PathBuf::from(name));
    let mut dir = exe.parent().unwrap_or(Path::new(".")).to_path_buf();
    if dir.file_name() == Some(OsStr::new("deps")) {
        dir.pop();
    }
    dir.join(name)
}

/// Polls `condition` until it holds or `timeout` passes, with short growing pauses.
/// The error names `what` and how long was waited.
pub fn wait_until(
    timeout: Duration,
    what: &str,
    mut condition: impl FnMut() -> bool,
) -> Result<()> {
    wait_for(timeout, what, || condition().then_some(()))
}

/// Polls `probe` until it returns a value or `timeout` passes.
pub fn wait_for<T>(
    timeout: Duration,
    what: &str,
    mut probe: impl FnMut() -> Option<T>,
) -> Result<T> {
    let started = Instant::now();
    let mut pause = Duration::from_millis(1);
    loop {
        if let Some(value) = probe() {
            return Ok(value);
        }
        let elapsed = started.elapsed();
        if elapsed >= timeout {
            bail!("timed out after {elapsed:?} waiting for {what}");
        }
        std::thread::sleep(pause.min(timeout - elapsed));
        pause = (pause * 2).min(POLL_MAX);
    }
}

/// How to start a process. Built with chained calls, reused by [`Proc::restart`].
#[derive(Debug, Clone)]
pub struct ProcSpec {
    name: String,
    program: PathBuf,
    args: Vec<OsString>,
    env: Vec<(OsString, OsString)>,
    cwd: Option<PathBuf>,
    netns: Option<String>,
    log_dir: Option<PathBuf>,
}

impl ProcSpec {
    /// A process running `program`, named after its file name in logs and errors.
    pub fn new(program: impl Into<PathBuf>) -> Self {
        let program = program.into();
        let name = program
            .file_name()
            .map_or("proc".into(), |n| n.to_string_lossy().into_owned());
        ProcSpec {
            name,
            program,
            args: Vec::new(),
            env: Vec::new(),
            cwd: None,
            netns: None,
            log_dir: None,
        }
    }

    /// The name used for log files and messages, e.g. `hub` or `agent-2`.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    pub fn arg(mut self, arg: impl Into<OsString>) -> Self {
        self.args.push(arg.into());
        self
    }

    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    pub fn env(mut self, key: impl Into<OsString>, value: impl Into<OsString>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    pub fn cwd(mut self, dir: impl Into<PathBuf>) -> Self {
        self.cwd = Some(dir.into());
        self
    }

    /// Runs the process inside a network namespace (`ip netns exec NAME`), e.g. from
    /// [`crate::netns::NetnsPair::name`]. `ip` execs the program, so the pid is the program's.
    pub fn netns(mut self, name: impl Into<String>) -> Self {
        self.netns = Some(name.into());
        self
    }

    /// Where `NAME.stdout.log` and `NAME.stderr.log` go (appended across restarts).
    /// Without it, the process gets a temporary directory that lives as long as the [`Proc`].
    pub fn log_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.log_dir = Some(dir.into());
        self
    }

    fn command(&self, stdout: File, stderr: File) -> Command {
        let mut command = match &self.netns {
            Some(ns) => {
                let mut command = Command::new("ip");
                command.args(["netns", "exec"]).arg(ns).arg(&self.program);
                command
            }
            None => Command::new(&self.program),
        };
        command
            .args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k, v)));
        if let Some(cwd) = &self.cwd {
            command.current_dir(cwd);
        }
        // Its own process group, so a terminal's Ctrl-C reaches the test and not the child first.
        command
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .process_group(0);
        command
    }
}

/// A running (or exited) child process. Dropping it SIGKILLs and reaps the process.
#[derive(Debug)]
pub struct Proc {
    spec: ProcSpec,
    child: Child,
    exited: Option<ExitStatus>,
    stdout_path: PathBuf,
    stderr_path: PathBuf,
    spawns: u32,
    // Keeps the default log directory alive as long as the process handle.
    _logs: Option<tempfile::TempDir>,
}

impl Proc {
    /// Starts the process. Fails with a readable message when the binary does not exist.
    pub fn spawn(spec: ProcSpec) -> Result<Proc> {
        if spec.program.components().count() > 1 && !spec.program.exists() {
            bail!(
                "binary {} does not exist: build it first with `cargo build --workspace` \
                 (system tests run the real binaries)",
                spec.program.display()
            );
        }
        let (logs, dir) = match &spec.log_dir {
            Some(dir) => (None, dir.clone()),
            None => {
                let temp = tempfile::Builder::new().prefix("trb-proc-").tempdir()?;
                let dir = temp.path().to_path_buf();
                (Some(temp), dir)
            }
        };
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let stdout_path = dir.join(format!("{}.stdout.log", spec.name));
        let stderr_path = dir.join(format!("{}.stderr.log", spec.name));
        let child = start(&spec, &stdout_path, &stderr_path)?;
        Ok(Proc {
            spec,
            child,
            exited: None,
            stdout_path,
            stderr_path,
            spawns: 1,
            _logs: logs,
        })
    }

    /// Kills the process if it still runs and starts it again with the same spec and logs.
    pub fn restart(&mut self) -> Result<()> {
        if self.exited.is_none() {
            self.kill9()?;
        }
        self.child = start(&self.spec, &self.stdout_path, &self.stderr_path)?;
        self.exited = None;
        self.spawns += 1;
        Ok(())
    }

    pub fn name(&self) -> &str {
        &self.spec.name
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    fn pid_t(&self) -> Result<libc::pid_t> {
        libc::pid_t::try_from(self.pid()).context("pid out of range")
    }

    /// How many times the process was started, restarts included.
    pub fn spawns(&self) -> u32 {
        self.spawns
    }

    /// SIGKILL, then reap. Returns the exit status (or the earlier one if it had already exited).
    ///
    /// The signal goes to the process's whole group (it leads its own), so anything it started
    /// dies with it and no orphan outlives the test.
    pub fn kill9(&mut self) -> Result<ExitStatus> {
        if let Some(status) = self.try_status()? {
            return Ok(status);
        }
        send_signal(-self.pid_t()?, libc::SIGKILL)
            .with_context(|| format!("SIGKILL {}", self.name()))?;
        let status = self.child.wait()?;
        self.exited = Some(status);
        Ok(status)
    }

    /// SIGTERM, then waits up to `timeout` for a clean exit. If the process is still alive at the
    /// deadline it is SIGKILLed and this returns an error: a graceful shutdown that hangs is a bug.
    pub fn terminate(&mut self, timeout: Duration) -> Result<ExitStatus> {
        if let Some(status) = self.try_status()? {
            return Ok(status);
        }
        send_signal(self.pid_t()?, libc::SIGTERM)
            .with_context(|| format!("SIGTERM {}", self.name()))?;
        match self.wait_exit(timeout) {
            Ok(status) => Ok(status),
            Err(error) => {
                self.kill9()?;
                Err(error.context(format!("{} ignored SIGTERM and was SIGKILLed", self.name())))
            }
        }
    }

    /// The exit status if the process has exited, without blocking.
    pub fn try_status(&mut self) -> Result<Option<ExitStatus>> {
        if self.exited.is_none() {
            self.exited = self.child.try_wait()?;
        }
        Ok(self.exited)
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.try_status(), Ok(None))
    }

    /// Waits for the process to exit by itself.
    pub fn wait_exit(&mut self, timeout: Duration) -> Result<ExitStatus> {
        let what = format!("{} to exit", self.name());
        let status = wait_for(timeout, &what, || self.try_status().ok().flatten())?;
        Ok(status)
    }

    /// Waits until `GET path` on `addr` answers 200, failing at once (with the logs) if the
    /// process exits meanwhile. Returns the answer, e.g. the `/healthz` body.
    pub fn wait_http_ok(
        &mut self,
        addr: SocketAddr,
        path: &str,
        timeout: Duration,
    ) -> Result<http::Response> {
        let mut last = String::from("no answer yet");
        let what = format!("{} to answer 200 on http://{addr}{path}", self.name());
        let outcome = wait_for(timeout, &what, || {
            if let Ok(Some(status)) = self.try_status() {
                return Some(Err(status));
            }
            match http::request_timeout(addr, "GET", path, &[], None, Duration::from_secs(2)) {
                Ok(response) if response.status == 200 => return Some(Ok(response)),
                Ok(response) => last = format!("status {}: {}", response.status, response.text()),
                Err(error) => last = format!("{error:#}"),
            }
            None
        });
        let tail = || self.log_tail(LOG_TAIL_LINES);
        match outcome {
            Ok(Ok(response)) => Ok(response),
            Ok(Err(status)) => Err(anyhow!(
                "{} exited with {status} before answering {path}\n{}",
                self.name(),
                tail()
            )),
            Err(error) => Err(anyhow!("{error:#} (last: {last})\n{}", tail())),
        }
    }

    pub fn stdout_path(&self) -> &Path {
        &self.stdout_path
    }

    pub fn stderr_path(&self) -> &Path {
        &self.stderr_path
    }

    /// Everything the process (and its earlier incarnations) wrote to stdout.
    pub fn stdout(&self) -> String {
        read_lossy(&self.stdout_path)
    }

    pub fn stderr(&self) -> String {
        read_lossy(&self.stderr_path)
    }

    /// The last `lines` lines of stdout and stderr, labelled, for failure messages.
    pub fn log_tail(&self, lines: usize) -> String {
        let tail = |text: String| {
            let all: Vec<&str> = text.lines().collect();
            all[all.len().saturating_sub(lines)..].join("\n")
        };
        format!(
            "--- {name} stdout (last {lines} lines, {out}) ---\n{}\n--- {name} stderr ({err}) ---\n{}",
            tail(self.stdout()),
            tail(self.stderr()),
            name = self.name(),
            out = self.stdout_path.display(),
            err = self.stderr_path.display(),
        )
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.kill9();
    }
}

fn start(spec: &ProcSpec, stdout_path: &Path, stderr_path: &Path) -> Result<Child> {
    let open = |path: &Path| {
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("opening log {}", path.display()))
    };
    let mut command = spec.command(open(stdout_path)?, open(stderr_path)?);
    command
        .spawn()
        .with_context(|| format!("spawning {} ({})", spec.name, spec.program.display()))
}

fn read_lossy(path: &Path) -> String {
    std::fs::read(path)
        .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
        .unwrap_or_default()
}

/// Sends `signal` to `pid`, or to the process group `-pid` when negative.
#[allow(unsafe_code)]
fn send_signal(pid: libc::pid_t, signal: libc::c_int) -> io::Result<()> {
    // SAFETY: kill(2) only takes integers and touches none of our memory. The callers signal only
    // children that have not been reaped yet (or the group such a child leads), so the id cannot
    // have been recycled for another process.
    let rc = unsafe { libc::kill(pid, signal) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}
