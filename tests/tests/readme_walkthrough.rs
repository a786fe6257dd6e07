//! The README's quickstart, run as written against the built binaries: it fails when the
//! README and the binaries disagree.
//!
//! Every fenced `sh` block of the README preceded by a `<!-- walkthrough: ... -->` marker is
//! taken verbatim, in order:
//! - `setup`: how to build and put the binaries on `PATH`; checked to say so, and replaced by
//!   the binaries of this build (the test does not build a release);
//! - `run`: commands that must all succeed (the block runs under `bash -e`); `run after-tiering`
//!   waits first until tier 2 holds every record the hub committed, as the README says to;
//! - `serve URL`: a long-running process, started in the background; the next block runs once
//!   `URL` answers (`http://` for `/healthz`, `tcp://` for a listening port).
//!
//! The README uses the example files' fixed ports and `/var/tmp/tributary`, so the whole
//! walkthrough runs in private network and mount namespaces (`unshare`, as root), with a
//! temporary directory bind-mounted at `/var/tmp/tributary`: nothing of the machine is used or
//! left behind. Other engineers change the CLIs' output, so this asserts exit codes and key
//! facts (records counted by the hub, rows exported, the retired device), not exact text.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use serde_json::Value;
use tributary_tests::procs::bin_path;

/// The whole walkthrough, tiering included, must finish within this.
const WALKTHROUGH_TIMEOUT: Duration = Duration::from_secs(150);
/// Records the README sends: 180 over HTTP, 2 from stdin into `telemetry`, 3 over MQTT.
const TELEMETRY_RECORDS: u64 = 182;
const MQTT_RECORDS: u64 = 3;
/// Where the README puts everything.
const README_ROOT: &str = "/var/tmp/tributary";

#[derive(Debug, Clone, PartialEq, Eq)]
enum Marker {
    Setup,
    Run { after_tiering: bool },
    Serve { ready: String },
}

#[derive(Debug, Clone)]
struct Block {
    marker: Marker,
    line: usize,
    body: String,
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn parse_marker(text: &str, line: usize) -> Result<Marker> {
    let words: Vec<&str> = text.split_whitespace().collect();
    Ok(match words.as_slice() {
        ["setup"] => Marker::Setup,
        ["run"] => Marker::Run {
            after_tiering: false,
        },
        ["run", "after-tiering"] => Marker::Run {
            after_tiering: true,
        },
        ["serve", url] => Marker::Serve {
            ready: (*url).to_string(),
        },
        _ => bail!("README.md:{line}: unknown walkthrough marker `{text}`"),
    })
}

/// The marked blocks of `readme`, in order. A marker must be followed by a fenced `sh` block.
fn walkthrough_blocks(readme: &str) -> Result<Vec<Block>> {
    let lines: Vec<&str> = readme.lines().collect();
    let mut blocks = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let Some(marker) = lines[i]
            .trim()
            .strip_prefix("<!-- walkthrough:")
            .and_then(|r| r.strip_suffix("-->"))
        else {
            i += 1;
            continue;
        };
        let marker = parse_marker(marker, i + 1)?;
        ensure!(
            lines.get(i + 1).map(|l| l.trim()) == Some("```sh"),
            "README.md:{}: a walkthrough marker must be followed by a ```sh block",
            i + 1
        );
        let end = (i + 2..lines.len())
            .find(|&j| lines[j].trim() == "```")
            .with_context(|| format!("README.md:{}: unterminated block", i + 2))?;
        let body = lines[i + 2..end].join("\n");
        blocks.push(Block {
            marker,
            line: i + 2,
            body,
        });
        i = end + 1;
    }
    Ok(blocks)
}

/// Shell helpers the generated script uses between blocks.
const PRELUDE: &str = r#"set -u
T=/var/tmp/tributary
mkdir -p "$T/.walkthrough"
ip link set lo up
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; }
trap cleanup EXIT
ready() {
  local url="$1" i
  for ((i = 0; i < 600; i++)); do
    case "$url" in
      http://*) curl -fsS -o /dev/null "$url" 2>/dev/null && return 0 ;;
      tcp://*) local hp="${url#tcp://}"; (exec 3<>"/dev/tcp/${hp%:*}/${hp##*:}") 2>/dev/null && return 0 ;;
    esac
    sleep 0.1
  done
  echo "not ready: $url" >&2; return 1
}
# Waits until tier 2 holds, per stream, every record the hub committed.
tiered() {
  local i
  for ((i = 0; i < 900; i++)); do
    python3 - 2>"$T/.walkthrough/tiered.err" <<'PY' && return 0
import duckdb, json, sys, urllib.request
streams = json.load(urllib.request.urlopen("http://127.0.0.1:7480/v1/streams"))
streams = streams.get("streams", streams) if isinstance(streams, dict) else streams
for s in streams:
    n = s.get("records", s.get("next_offset", 0))
    glob = f"/var/tmp/tributary/tier2/streams/{s['name']}/**/*.parquet"
    try:
        have = duckdb.sql(f"SELECT count(*) FROM read_parquet('{glob}')").fetchall()[0][0]
    except duckdb.IOException:
        have = 0
    if n and have < n:
        sys.exit(1)
PY
    sleep 0.1
  done
  echo "tier 2 did not catch up" >&2; return 1
}
facts() {
  curl -fsS http://127.0.0.1:7480/v1/streams >"$T/.walkthrough/streams.json"
  curl -fsS http://127.0.0.1:7480/v1/devices >"$T/.walkthrough/devices.json"
}
"#;

/// One bash script: the prelude, then each block with its marker's handling; each `run`
/// block's output and exit code go to `.walkthrough/{n}.out` and `.walkthrough/{n}.rc`.
fn script(blocks: &[Block], bin_dir: &Path) -> Result<String> {
    let mut s = String::from(PRELUDE);
    s.push_str(&format!(
        "export PATH={:?}:\"$PATH\"\n",
        bin_dir.display().to_string()
    ));
    for (n, b) in blocks.iter().enumerate() {
        let out = format!("\"$T/.walkthrough/{n}\"");
        match &b.marker {
            Marker::Setup => {
                ensure!(
                    b.body.contains("cargo build") && b.body.contains("export PATH="),
                    "README.md:{}: the setup block no longer builds and sets PATH",
                    b.line
                );
            }
            Marker::Run { after_tiering } => {
                if *after_tiering {
                    s.push_str("tiered || exit 3\n");
                }
                s.push_str(&format!(
                    "bash -e >{out}.out 2>&1 <<'WALKTHROUGH_BLOCK'\n{}\nWALKTHROUGH_BLOCK\necho $? >{out}.rc\n",
                    b.body
                ));
            }
            Marker::Serve { ready } => {
                s.push_str(&format!(
                    "bash -c {} >{out}.out 2>&1 &\npids+=($!)\nready {ready:?} || exit 4\n",
                    shell_quote(&b.body)
                ));
            }
        }
    }
    s.push_str("facts\n");
    Ok(s)
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// Runs `script` in fresh network and mount namespaces with `root` at `/var/tmp/tributary`.
fn run_isolated(script: &str, root: &Path) -> Result<()> {
    std::fs::create_dir_all(README_ROOT).context("creating the mount point")?;
    let path = root.join("walkthrough.sh");
    std::fs::write(&path, script)?;
    let inner = format!(
        "mount --bind {} {README_ROOT} && exec bash {}",
        shell_quote(&root.display().to_string()),
        shell_quote(&path.display().to_string())
    );
    let log = std::fs::File::create(root.join("walkthrough.log"))?;
    let mut child = Command::new("unshare")
        .args(["--net", "--mount", "--propagation", "private", "--fork"])
        .args(["--kill-child", "bash", "-c", &inner])
        .current_dir(repo_root())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .context("running unshare (the walkthrough test needs root)")?;
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if start.elapsed() > WALKTHROUGH_TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "the walkthrough did not finish within {WALKTHROUGH_TIMEOUT:?}: {}",
                progress(root)
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    ensure!(
        status.success(),
        "the walkthrough stopped ({status}): {}",
        std::fs::read_to_string(root.join("walkthrough.log")).unwrap_or_default()
    );
    Ok(())
}

/// What the walkthrough left so far: its log and each block's output, for a failure message.
fn progress(root: &Path) -> String {
    let mut out = std::fs::read_to_string(root.join("walkthrough.log")).unwrap_or_default();
    let mut files: Vec<PathBuf> = std::fs::read_dir(root.join(".walkthrough"))
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    files.sort();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap_or_default();
        let tail: String = text
            .chars()
            .rev()
            .take(1500)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        out.push_str(&format!("\n--- {}:\n{tail}", f.display()));
    }
    out
}

/// Every `run` block exited 0; the error shows the block, its line and its output.
fn check_blocks(blocks: &[Block], dir: &Path) -> Result<()> {
    for (n, b) in blocks.iter().enumerate() {
        if !matches!(b.marker, Marker::Run { .. }) {
            continue;
        }
        let rc = std::fs::read_to_string(dir.join(format!("{n}.rc")))
            .with_context(|| format!("README.md:{}: the block never ran", b.line))?;
        let out = std::fs::read_to_string(dir.join(format!("{n}.out"))).unwrap_or_default();
        ensure!(
            rc.trim() == "0",
            "README.md:{}: the block exited {}:\n{}\n--- output:\n{out}",
            b.line,
            rc.trim(),
            b.body
        );
    }
    Ok(())
}

fn stream_records(streams: &Value, name: &str) -> u64 {
    let list = streams.get("streams").unwrap_or(streams);
    list.as_array()
        .into_iter()
        .flatten()
        .find(|s| s["name"] == name)
        .and_then(|s| s.get("records").or(s.get("next_offset")))
        .and_then(Value::as_u64)
        .unwrap_or(0)
}

fn parquet_rows(file: &Path) -> Result<u64> {
    let out = Command::new("python3")
        .arg("-c")
        .arg(format!(
            "import duckdb; print(duckdb.sql(\"SELECT count(*) FROM read_parquet('{}')\").fetchall()[0][0])",
            file.display()
        ))
        .output()
        .context("python3 with duckdb (.ci/test installs it)")?;
    ensure!(
        out.status.success(),
        "duckdb: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).trim().parse()?)
}

/// The facts the README promises: what the hub counted, the exported rows, the retired device.
fn check_facts(root: &Path) -> Result<()> {
    let dir = root.join(".walkthrough");
    let streams: Value = serde_json::from_slice(&std::fs::read(dir.join("streams.json"))?)?;
    assert_eq!(stream_records(&streams, "telemetry"), TELEMETRY_RECORDS);
    assert_eq!(stream_records(&streams, "mqtt"), MQTT_RECORDS);
    assert_eq!(
        parquet_rows(&root.join("telemetry.parquet"))?,
        TELEMETRY_RECORDS,
        "the export of the README's time range"
    );
    let devices: Value = serde_json::from_slice(&std::fs::read(dir.join("devices.json"))?)?;
    let list = devices.get("devices").unwrap_or(&devices);
    let retired = |id: &str| {
        list.as_array()
            .into_iter()
            .flatten()
            .find(|d| d["id"] == id)
            .map(|d| d["retired"] == true)
    };
    assert_eq!(retired("edge-mqtt"), Some(true), "devices: {devices}");
    assert_eq!(retired("edge-http"), Some(false), "devices: {devices}");
    Ok(())
}

#[test]
fn readme_quickstart_runs_as_written() -> Result<()> {
    let readme = std::fs::read_to_string(repo_root().join("README.md"))?;
    let blocks = walkthrough_blocks(&readme)?;
    let serves = blocks
        .iter()
        .filter(|b| matches!(b.marker, Marker::Serve { .. }))
        .count();
    assert!(
        serves >= 3 && blocks.len() >= 8,
        "the README's walkthrough lost its markers: {blocks:?}"
    );
    let bin_dir = bin_path("core-hub")
        .parent()
        .context("binary dir")?
        .to_path_buf();
    let root = tempfile::tempdir()?;
    run_isolated(&script(&blocks, &bin_dir)?, root.path())?;
    check_blocks(&blocks, &root.path().join(".walkthrough"))?;
    check_facts(root.path())
}

#[test]
fn markers_are_parsed_and_a_bad_one_is_refused() {
    let readme = "x\n<!-- walkthrough: serve http://h/healthz -->\n```sh\na &\n```\n\
                  <!-- walkthrough: run after-tiering -->\n```sh\nb\nc\n```\n";
    let blocks = walkthrough_blocks(readme).unwrap();
    assert_eq!(blocks.len(), 2);
    assert_eq!(
        blocks[0].marker,
        Marker::Serve {
            ready: "http://h/healthz".into()
        }
    );
    assert_eq!(blocks[1].body, "b\nc");
    assert!(walkthrough_blocks("<!-- walkthrough: dance -->\n```sh\n```\n").is_err());
    assert!(walkthrough_blocks("<!-- walkthrough: run -->\ntext\n").is_err());
}
