//! The hub's status page (`GET /`) as a browser shows it: headless Chromium loads it, runs its
//! scripts and dumps the resulting DOM, and the test reads that.
//!
//! One hub with reader tokens set and three real agents: `dev-ok`, `dev-gappy` (a gap of 500
//! records in its catalog, as a gap marker from its agent leaves there) and `dev-revoked`
//! (revoked with `core-hub pki revoke` while connected), plus 1,000 more devices in the
//! catalog. Checked:
//! - a device with gaps is not shown as complete, in the devices table or in the stream's
//!   completeness table, and the page says how many records were lost;
//! - the revoked device is shown as revoked, with why;
//! - with 1,003 devices the page stays usable: at most 100 rows that need attention are open,
//!   the healthy devices are collapsed under one line, and the page stays small;
//! - with tokens set, a browser without a token gets the sign-in page (200, nothing about the
//!   fleet), and with the token it gets the page.
//!
//! Chromium comes from `.ci/test` (apt `chromium`); it runs with `--no-sandbox` because the
//! tests run as root, on loopback only.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use tributary_tests::cluster::{AgentSpec, HubSpec, Pki, wait_caught_up};
use tributary_tests::http;
use tributary_tests::procs::wait_for;

const TOKEN: &str = "status-reader-token-0123456789";
const FLEET: usize = 1_000;
const GAP_RECORDS: u64 = 500;
const CHROMIUM_TIMEOUT: Duration = Duration::from_secs(60);
const WAIT: Duration = Duration::from_secs(30);

/// The DOM of `url` after its scripts ran, from headless Chromium.
fn chromium_dom(url: &str, profile: &Path) -> Result<String> {
    // A file, not a pipe: a large page would fill a pipe nobody reads until chromium exits.
    let out_path = profile.with_extension("dom.html");
    let mut child = Command::new("chromium")
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
        ])
        .args(["--disable-extensions", "--disable-background-networking"])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(["--virtual-time-budget=3000", "--dump-dom", url])
        .stdout(std::fs::File::create(&out_path)?)
        .stderr(Stdio::null())
        .spawn()
        .context("starting chromium (.ci/test installs it with apt)")?;
    let started = Instant::now();
    while child.try_wait()?.is_none() {
        if started.elapsed() > CHROMIUM_TIMEOUT {
            let _ = child.kill();
            bail!("chromium did not finish loading {url} within {CHROMIUM_TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let status = child.wait()?;
    ensure!(status.success(), "chromium failed on {url}: {status}");
    Ok(std::fs::read_to_string(&out_path)?)
}

/// The outer HTML of the element whose start tag is `<{tag} id="{id}"` (or `id={id}`).
fn element<'a>(dom: &'a str, tag: &str, id: &str) -> Option<&'a str> {
    let start = dom
        .find(&format!("<{tag} id=\"{id}\""))
        .or_else(|| dom.find(&format!("<{tag} id={id}")))?;
    let end = dom[start..].find(&format!("</{tag}>"))? + start;
    Some(&dom[start..end])
}

fn catalog(spec: &HubSpec) -> Result<rusqlite::Connection> {
    let c = rusqlite::Connection::open(spec.data_dir.join("catalog.sqlite"))?;
    c.busy_timeout(Duration::from_secs(10))?;
    Ok(c)
}

/// What an agent's gap marker leaves in the catalog, and a fleet of devices seen just now.
fn seed_catalog(spec: &HubSpec) -> Result<()> {
    let c = catalog(spec)?;
    let (device, epoch, stream, seq): (i64, i64, i64, i64) = c.query_row(
        "SELECT m.device, m.epoch, m.stream, m.durable_seq FROM marks m
         JOIN devices d ON d.id = m.device WHERE d.name = 'dev-gappy'",
        [],
        |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
    )?;
    let first = seq + 1_000;
    c.execute(
        "INSERT INTO gaps (device, epoch, stream, first_seq, last_seq, reason, reported_at_ns)
         VALUES (?1, ?2, ?3, ?4, ?5, 'disk budget full', ?6)",
        rusqlite::params![
            device,
            epoch,
            stream,
            first,
            first + GAP_RECORDS as i64 - 1,
            now_ns()
        ],
    )?;
    let tx = c.unchecked_transaction()?;
    for i in 0..FLEET {
        tx.execute(
            "INSERT INTO devices (name, last_contact_ns) VALUES (?1, ?2)",
            rusqlite::params![format!("fleet-{i:04}"), now_ns()],
        )?;
    }
    tx.commit()?;
    Ok(())
}

fn now_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i64)
}

fn ndjson(n: usize, key: &str) -> Vec<u8> {
    let ts = now_ns();
    (0..n)
        .map(|i| {
            format!(
                "{{\"key\":\"{key}\",\"ts\":{},\"fields\":{{\"v\":{i}}}}}\n",
                ts + i as i64
            )
        })
        .collect::<String>()
        .into_bytes()
}

#[test]
fn status_page_in_chromium() -> Result<()> {
    let root = tempfile::tempdir()?;
    let pki = Pki::init(root.path().join("pki"))?;
    let mut spec = HubSpec::new(root.path());
    spec.extra_toml = format!(
        "[http]\nreader_tokens = [\"{TOKEN}\"]\n\n[completeness]\noffline_after = \"1h\"\n"
    );
    let mut hub = spec.start(&pki)?;
    let mut agents = Vec::new();
    for name in ["dev-ok", "dev-gappy", "dev-revoked"] {
        let cert = pki.issue(name, None)?;
        let agent = AgentSpec::new(root.path(), name, cert, Some(spec.quic));
        let proc = agent.start()?;
        let resp = http::post_ndjson(
            agent.http,
            "/v1/streams/telemetry/records",
            &ndjson(20, name),
        )?;
        assert_eq!(resp.status, 200, "{name}: {}", resp.text());
        wait_caught_up(agent.http, WAIT)?;
        agents.push(proc);
    }
    pki.revoke("dev-revoked")?;
    hub.terminate(Duration::from_secs(20))?;
    seed_catalog(&spec)?;
    hub.restart()?;
    hub.wait_http_ok_with(spec.http, TOKEN)?;

    let profile = root.path().join("chromium");
    let url = format!("http://{}/?token={TOKEN}", spec.http);
    // The revocation list is read at start; poll until the page shows it.
    let mut last = String::new();
    let shown = wait_for(WAIT, "the page to show the revoked device", || {
        last = chromium_dom(&url, &profile).unwrap_or_else(|e| format!("{e:#}"));
        element(&last, "tr", "device-dev-revoked")
            .is_some_and(|r| r.contains("revoked"))
            .then_some(())
    });
    let dom = last;
    assert!(
        shown.is_ok(),
        "{shown:?}; the page: {}",
        &dom[..dom.len().min(6000)]
    );
    check_gaps(&dom);
    check_revoked(&dom);
    check_large_fleet(&dom);
    check_tokens(&spec, &profile)?;
    for mut a in agents {
        let _ = a.terminate(Duration::from_secs(10));
    }
    Ok(())
}

fn check_gaps(dom: &str) {
    let row = element(dom, "tr", "device-dev-gappy").expect("a row for dev-gappy");
    assert!(row.contains("incomplete"), "{row}");
    assert!(
        row.contains(&format!("{GAP_RECORDS} records lost")),
        "{row}"
    );
    assert!(
        !row.contains(">connected<"),
        "a device with gaps shown as fine: {row}"
    );
    let row = element(dom, "tr", "completeness-telemetry-dev-gappy")
        .expect("dev-gappy in the stream's completeness table");
    assert!(
        row.contains("class=\"bad\"") || row.contains("class=bad"),
        "{row}"
    );
    assert!(row.contains("incomplete"), "{row}");
    let ok = element(dom, "tr", "completeness-telemetry-dev-ok").expect("dev-ok's row");
    assert!(!ok.contains("incomplete"), "{ok}");
}

fn check_revoked(dom: &str) {
    let row = element(dom, "tr", "device-dev-revoked").expect("a row for dev-revoked");
    assert!(row.contains(">revoked<"), "{row}");
    assert!(row.contains("revocation list"), "why it is revoked: {row}");
    let ok = element(dom, "tr", "device-dev-ok").expect("a row for dev-ok");
    assert!(!ok.contains("revoked"), "{ok}");
}

fn check_large_fleet(dom: &str) {
    let attention = element(dom, "table", "devices").expect("the devices table");
    let open_rows = attention.matches("<tr id=\"device-").count();
    assert!(open_rows <= 100, "{open_rows} rows open");
    assert!(attention.contains("device-dev-gappy") && attention.contains("device-dev-revoked"));
    let healthy = element(dom, "details", "devices-healthy").expect("the collapsed devices");
    let head = &healthy[..healthy.find('>').unwrap()];
    assert!(!head.contains("open"), "collapsed by default: {head}");
    assert!(
        healthy.contains(&format!("{} devices", FLEET + 1)),
        "{}",
        &healthy[..300.min(healthy.len())]
    );
    assert!(healthy.contains("device-fleet-0000"));
    assert!(dom.len() < 2 << 20, "the page is {} bytes", dom.len());
}

fn check_tokens(spec: &HubSpec, profile: &Path) -> Result<()> {
    let plain = http::get(spec.http, "/")?;
    assert_eq!(
        plain.status,
        200,
        "a browser without a token: {}",
        plain.text()
    );
    let dom = chromium_dom(&format!("http://{}/", spec.http), profile)?;
    assert!(
        element(dom.as_str(), "form", "login").is_some(),
        "the sign-in form: {dom}"
    );
    assert!(
        !dom.contains("dev-ok"),
        "nothing about the fleet without a token"
    );
    Ok(())
}

trait WaitWithToken {
    fn wait_http_ok_with(&mut self, addr: std::net::SocketAddr, token: &str) -> Result<()>;
}

impl WaitWithToken for tributary_tests::procs::Proc {
    /// `/healthz` is open; the page needs the token, so wait on both.
    fn wait_http_ok_with(&mut self, addr: std::net::SocketAddr, token: &str) -> Result<()> {
        self.wait_http_ok(addr, "/healthz", WAIT)?;
        let path = format!("/?token={token}");
        wait_for(WAIT, "the status page", || {
            http::get(addr, &path).ok().filter(|r| r.status == 200)
        })?;
        Ok(())
    }
}
