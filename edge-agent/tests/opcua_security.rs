//! The OPC UA source's secure path inside the real agent, against a real OPC UA server:
//! asyncua serving `opcua_server.py --secure` on a loopback port, offering only
//! Basic256Sha256 with SignAndEncrypt, with its own self-signed certificate (application URI
//! `urn:tributary:test-server`, host names localhost and 127.0.0.1), accepting any client
//! certificate.
//!
//! - Trust list: an agent asking for Basic256Sha256 / SignAndEncrypt with `trust_unknown =
//!   false` and an empty trust list creates its own key pair, refuses the session, stores the
//!   server's certificate (byte for byte) in `pki_dir/rejected/`, keeps retrying, shows the
//!   source `disconnected` in `/v1/status` with the trust-list error naming both directories,
//!   and stores nothing. The test then moves the certificate into `pki_dir/trusted/`: without
//!   a restart the source connects, shows `connected`, and the server's values arrive as
//!   records (counter rising, labels matching), with no gap record (no session was lost).
//!   The refused phase is the mutation check of the trusted one: the only change between
//!   them is the file's place.
//! - Trust on first use: with `trust_unknown = true` the first connect succeeds, the
//!   certificate is stored in `trusted/` and nothing in `rejected/`.
//! - Mismatch: sources asking for None / None and for Basic256Sha256 / Sign, which this
//!   server does not offer, stay `disconnected` with an error naming both settings, and store
//!   nothing.

mod opcua_support;
mod process_support;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use opcua_support::{Server, metric};
use process_support::{Agent, Setup};
use serde_json::Value as Json;

const DEADLINE: Duration = Duration::from_secs(60);

/// Records from the server the trusted runs wait for.
const RECORDS: u64 = 20;

/// Refused connects seen before the refused state is checked: the error must hold across
/// the agent's retries, not only on the first one.
const REFUSALS: f64 = 3.0;

const TRUST_LIST_ERROR: &str = "the server's certificate is not in the trust list";

/// The files in `dir`, sorted; none when it does not exist.
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = match std::fs::read_dir(dir) {
        Ok(rd) => rd.map(|e| e.unwrap().path()).collect(),
        Err(_) => Vec::new(),
    };
    out.sort();
    out
}

/// One OPC UA source's `[[sources]]` table against `port`; `pki_dir` when not the default.
fn source(
    port: u16,
    policy: &str,
    mode: &str,
    trust_unknown: bool,
    pki_dir: Option<&str>,
) -> String {
    let pki = pki_dir.map_or(String::new(), |p| format!("pki_dir = \"{p}\"\n"));
    format!(
        "[[sources]]\nkind = \"opcua\"\nendpoint = \"opc.tcp://127.0.0.1:{port}/tributary/\"\n\
         security_policy = \"{policy}\"\nsecurity_mode = \"{mode}\"\ntrust_unknown = {trust_unknown}\n{pki}\
         publishing_interval = \"200ms\"\ntimeout = \"2s\"\nstream = \"telemetry\"\nkey = \"plant/opcua\"\n\
         [[sources.items]]\nnode_id = \"ns=2;s=Counter\"\nname = \"counter\"\nsampling_interval = \"100ms\"\n\
         [[sources.items]]\nnode_id = \"ns=2;s=Label\"\nname = \"label\"\nsampling_interval = \"100ms\"\n"
    )
}

/// A secure server, and an agent with `sources` (built by [`source`] from the server's port).
struct Case {
    /// Fields drop in order: the agent and the server end before the directory is removed.
    agent: Agent,
    _server: Server,
    rt: tokio::runtime::Runtime,
    /// The server's certificate as it wrote it (DER).
    server_cert: Vec<u8>,
    setup: Setup,
}

impl Case {
    fn start(sources: &dyn Fn(u16) -> String) -> Case {
        let setup = Setup::new("fsync = \"always\"");
        let port = process_support::free_port();
        let cert = setup.dir.path().join("server_cert.der");
        let server = {
            let key = setup.dir.path().join("server_key.pem");
            let secure = ["--secure".as_ref(), cert.as_os_str(), key.as_os_str()];
            Server::start(port, 0, &secure)
        };
        let server_cert = std::fs::read(&cert).unwrap();
        let config = format!(
            "data_dir = \"data\"\n[http]\nlisten = \"127.0.0.1:{http}\"\n[[streams]]\nname = \"telemetry\"\n{}",
            sources(port),
            http = setup.port,
        );
        std::fs::write(&setup.config, config).unwrap();
        let agent = setup.start();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        Case {
            agent,
            _server: server,
            rt,
            server_cert,
            setup,
        }
    }

    /// The default `pki_dir` (`data_dir/opcua-pki`) and one of its directories.
    fn pki(&self, sub: &str) -> PathBuf {
        self.setup.data_dir().join("opcua-pki").join(sub)
    }

    fn get(&self, path: &str) -> String {
        self.rt
            .block_on(self.setup.client().get(path))
            .unwrap()
            .text()
    }

    fn status(&self) -> Json {
        serde_json::from_str(&self.get("/v1/status")).unwrap()
    }

    /// Source `i`'s line in `/v1/status`.
    fn source(&self, i: usize) -> Json {
        self.status()["sources"][i].clone()
    }

    fn next_seq(&self) -> u64 {
        self.status()["streams"][0]["next_seq"].as_u64().unwrap()
    }

    /// OPC UA metric `name` of source `i`; -1 when absent.
    fn m(&self, i: usize, name: &str) -> f64 {
        metric(
            &self.get("/metrics"),
            &format!("tributary_edge_opcua_{name}{{source=\"{i}\"}}"),
        )
        .unwrap_or(-1.0)
    }

    /// What a failed check shows: the status and the end of the agent's log.
    fn context(&self) -> String {
        let log = self.agent.log_text();
        let lines: Vec<&str> = log.lines().collect();
        let tail = lines[lines.len().saturating_sub(40)..].join("\n");
        format!(
            "status: {}\nrejected: {:?}\ntrusted: {:?}\nagent log tail:\n{tail}",
            self.status(),
            files(&self.pki("rejected")),
            files(&self.pki("trusted")),
        )
    }

    /// Waits for `cond`, failing with `what` and [`Case::context`] after [`DEADLINE`].
    #[track_caller]
    fn must(&self, what: &str, cond: &dyn Fn() -> bool) {
        let end = Instant::now() + DEADLINE;
        while !cond() {
            assert!(
                Instant::now() < end,
                "timed out waiting for {what}\n{}",
                self.context()
            );
            // Polling the condition itself; the pause only spaces the probes.
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Asserts `ok`, failing with `what` and [`Case::context`].
    #[track_caller]
    fn check(&self, ok: bool, what: &str) {
        assert!(ok, "{what}\n{}", self.context());
    }

    /// The one certificate in `pki_dir/<sub>`, checked to be the server's.
    #[track_caller]
    fn the_server_cert_in(&self, sub: &str) -> PathBuf {
        let found = files(&self.pki(sub));
        self.check(
            found.len() == 1,
            &format!("one certificate in {sub}/: {found:?}"),
        );
        let bytes = std::fs::read(&found[0]).unwrap();
        self.check(
            bytes == self.server_cert,
            &format!("{} is the server's certificate", found[0].display()),
        );
        found[0].clone()
    }

    /// The source is connected and `RECORDS` records from the server are stored.
    #[track_caller]
    fn values_flow(&self) {
        self.must("the source connected and records stored", &|| {
            self.source(0)["state"] == "connected" && self.next_seq() > RECORDS
        });
        let src = self.source(0);
        self.check(src["last_error"].is_null(), "no error once connected");
        self.check(self.m(0, "up") == 1.0, "tributary_edge_opcua_up is 1");
    }

    /// Stops the agent and checks the stored records: the server's values, no gap.
    fn stop_and_check_records(mut self) {
        self.agent.terminate();
        let records = self.setup.inspect();
        let (mut counters, mut labels) = (Vec::new(), 0);
        for r in &records {
            assert_eq!(r["key"], "plant/opcua", "{r}");
            assert!(
                r["tags"]["opcua_event"].is_null(),
                "no gap record: no session was lost: {r}"
            );
            let fields = r["fields"].as_object().unwrap();
            assert_eq!(fields.len(), 1, "one field per data change: {r}");
            if let Some(n) = fields.get("counter") {
                assert_eq!(r["tags"]["node"], "ns=2;s=Counter", "{r}");
                counters.push(n.as_i64().unwrap_or_else(|| panic!("an integer: {r}")));
            } else {
                let s = fields["label"]
                    .as_str()
                    .unwrap_or_else(|| panic!("a counter or a label: {r}"));
                assert_eq!(r["tags"]["node"], "ns=2;s=Label", "{r}");
                assert!(
                    s.strip_prefix('n')
                        .is_some_and(|d| d.parse::<i64>().is_ok()),
                    "a label the server wrote: {r}"
                );
                labels += 1;
            }
        }
        assert!(
            counters.len() >= 5 && labels >= 5,
            "{} counter and {labels} label records",
            counters.len()
        );
        assert!(
            counters.windows(2).all(|w| w[0] < w[1]),
            "the server's counter, rising: {counters:?}"
        );
    }
}

#[test]
fn an_unknown_server_certificate_is_refused_until_it_is_moved_into_the_trust_list() {
    let case = Case::start(&|port| source(port, "Basic256Sha256", "SignAndEncrypt", false, None));

    // Refused: the certificate lands in rejected/, the agent keeps retrying, nothing stored.
    case.must(
        "the server's certificate in rejected/ and repeated refusals",
        &|| {
            !files(&case.pki("rejected")).is_empty()
                && case.m(0, "connect_errors_total") >= REFUSALS
        },
    );
    let rejected = case.the_server_cert_in("rejected");
    case.check(
        files(&case.pki("trusted")).is_empty(),
        "nothing trusted yet",
    );
    for own in ["own/cert.der", "private/private.pem"] {
        case.check(
            case.pki(own).is_file(),
            &format!("the agent created its key pair: {own}"),
        );
    }
    let src = case.source(0);
    case.check(src["state"] == "disconnected", "the source is disconnected");
    let error = src["last_error"].as_str().unwrap_or_default().to_owned();
    let (rejected_dir, trusted_dir) = (case.pki("rejected"), case.pki("trusted"));
    case.check(
        error.contains(TRUST_LIST_ERROR)
            && error.contains(&format!("move it from {}", rejected_dir.display()))
            && error.contains(&format!("to {}", trusted_dir.display()))
            && error.contains("trust_unknown = true"),
        &format!("the trust-list error, after {REFUSALS} refusals: {error:?}"),
    );
    case.check(case.m(0, "up") == 0.0, "tributary_edge_opcua_up is 0");
    case.check(
        case.m(0, "changes_total") == 0.0 && case.m(0, "records_total") == 0.0,
        "no data change received or stored while refused",
    );
    case.check(case.next_seq() == 1, "the stream holds no record");

    // Trusted: the same file, moved; the running agent connects on its next retry.
    let name = rejected.file_name().unwrap();
    std::fs::rename(&rejected, trusted_dir.join(name)).unwrap();
    case.values_flow();
    case.the_server_cert_in("trusted");
    case.check(
        files(&rejected_dir).is_empty(),
        "rejected/ is empty after the move",
    );
    case.check(
        case.m(0, "reconnects_total") == 0.0 && case.m(0, "gaps_total") == 0.0,
        "a first session: no reconnect, no gap",
    );
    case.stop_and_check_records();
}

#[test]
fn trust_unknown_accepts_the_server_certificate_and_stores_it_as_trusted() {
    let case = Case::start(&|port| source(port, "Basic256Sha256", "SignAndEncrypt", true, None));
    case.values_flow();
    case.check(
        case.m(0, "connect_errors_total") == 0.0,
        "the first connect succeeded",
    );
    case.the_server_cert_in("trusted");
    case.check(files(&case.pki("rejected")).is_empty(), "nothing rejected");
    case.stop_and_check_records();
}

/// Two secure sources on the default `pki_dir`: the key pair is created once, before either
/// connects, so both get a session (a race between them would leave one without its key).
#[test]
fn two_secure_sources_share_one_pki_dir() {
    let case = Case::start(&|port| {
        source(port, "Basic256Sha256", "SignAndEncrypt", true, None)
            + &source(port, "Basic256Sha256", "SignAndEncrypt", true, None)
    });
    case.must("both sources connected", &|| {
        case.m(0, "up") == 1.0 && case.m(1, "up") == 1.0
    });
    for i in [0, 1] {
        case.check(
            case.source(i)["state"] == "connected",
            &format!("source {i} is connected"),
        );
    }
}

#[test]
fn a_policy_and_mode_the_server_does_not_offer_are_refused_naming_both_settings() {
    let case = Case::start(&|port| {
        // Its own pki_dir, so that each source's directories can be checked on their own.
        source(port, "None", "None", false, None)
            + &source(port, "Basic256Sha256", "Sign", true, Some("pki-1"))
    });
    case.must("both sources refused repeatedly", &|| {
        case.m(0, "connect_errors_total") >= REFUSALS
            && case.m(1, "connect_errors_total") >= REFUSALS
    });
    for (i, policy, mode) in [(0, "None", "None"), (1, "Basic256Sha256", "Sign")] {
        let src = case.source(i);
        case.check(
            src["state"] == "disconnected",
            &format!("source {i} is disconnected"),
        );
        let error = src["last_error"].as_str().unwrap_or_default().to_owned();
        case.check(
            error.contains("security_policy")
                && error.contains(policy)
                && error.contains("security_mode")
                && error.contains(mode),
            &format!("source {i}: an error naming security_policy {policy} and security_mode {mode}: {error:?}"),
        );
        case.check(case.m(i, "up") == 0.0, &format!("source {i} is down"));
    }
    case.check(case.next_seq() == 1, "the stream holds no record");
    case.check(
        ["rejected", "trusted"].iter().all(|d| {
            files(&case.pki(d)).is_empty()
                && files(&case.setup.dir.path().join("pki-1").join(d)).is_empty()
        }),
        "no session got as far as the server's certificate",
    );
}
