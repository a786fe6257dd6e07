//! Influx drop-in writes through the real binaries: the Python `influxdb-client` writes points
//! with tags through `/api/v2/write`, and a Telegraf-format mixed batch (`cpu`, `mem`, `disk`,
//! `modbus`; tags, `i`/`u` integers, strings, gzip, every precision) goes through `/write`
//! with its `db` mapped to the stream. The hub tiers it all to local Parquet, and DuckDB
//! reads tags as columns (`host`, `measurement`, `cpu`, ...) and one column per numeric field
//! (`temp` arrives as `65i` and as `71.3` and is one DOUBLE).
//!
//! Needs `pip install influxdb-client==1.49.0 duckdb` (`.ci/test` installs both).

use std::io::Write;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use serde_json::json;
use tributary_tests::cluster::{AgentSpec, HubSpec, Pki};
use tributary_tests::{http, tier2};

const STREAM: &str = "telemetry";
/// 2026-01-01T00:00:00Z in seconds.
const T0: i64 = 1_767_225_600;

fn gzip(body: &str) -> Vec<u8> {
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    enc.write_all(body.as_bytes()).unwrap();
    enc.finish().unwrap()
}

/// The Telegraf batch at `T0 + n` seconds, its timestamp written in `precision`.
fn telegraf_batch(n: i64, precision: &str) -> String {
    let ts = match precision {
        "s" => (T0 + n).to_string(),
        "ms" => ((T0 + n) * 1_000).to_string(),
        "u" => ((T0 + n) * 1_000_000).to_string(),
        _ => ((T0 + n) * 1_000_000_000).to_string(),
    };
    // `temp` is an integer in even batches and a decimal in odd ones.
    let temp = if n % 2 == 0 {
        "65i".to_owned()
    } else {
        "71.3".to_owned()
    };
    format!(
        "cpu,host=gw-01,cpu=cpu0 usage_idle=98.5,usage_user=1.25 {ts}\n\
         mem,host=gw-01 used=123456789i,available_percent=55.5 {ts}\n\
         disk,host=gw-01,path=/,fstype=ext4 free=1000000u,mode=\"rw\" {ts}\n\
         modbus,host=gw-01,name=press7 temp={temp},running=true {ts}\n"
    )
}

const CLIENT: &str = r#"
import sys
from influxdb_client import InfluxDBClient, Point, WritePrecision
from influxdb_client.client.write_api import SYNCHRONOUS
url, t0 = sys.argv[1], int(sys.argv[2])
with InfluxDBClient(url=url, token="t0ken", org="site") as c:
    w = c.write_api(write_options=SYNCHRONOUS)
    for i in range(5):
        p = (Point("weather").tag("host", "gw-02").tag("site", "north")
             .field("temp", 20.5 + i).field("gust", i).time(t0 + i, WritePrecision.S))
        w.write(bucket="telemetry", record=p, write_precision=WritePrecision.S)
    w.write(bucket="telemetry", record="weather,host=gw-02,site=north temp=30.5 %d" % ((t0 + 5) * 10**9))
print("ok")
"#;

fn duckdb(glob: &str, sql: &str) -> Result<serde_json::Value> {
    let script = format!(
        r#"
import duckdb, json
c = duckdb.connect()
c.execute("CREATE VIEW t AS SELECT * FROM read_parquet('{glob}', union_by_name=true)")
print(json.dumps([list(r) for r in c.execute({sql:?}).fetchall()], default=str))
"#
    );
    let out = Command::new("python3").arg("-c").arg(script).output()?;
    ensure!(
        out.status.success(),
        "duckdb: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).context("duckdb output")
}

#[test]
fn influx_clients_write_tags_that_become_columns() -> Result<()> {
    let (_scratch, root) = tier2::scratch_dir("trb-influx-")?;
    let root = root.as_path();
    let pki = Pki::init(root.join("pki"))?;
    let tier2_dir = root.join("tier2");
    let mut hub_spec = HubSpec::new(root);
    hub_spec.extra_toml = format!(
        "[tier2]\nurl = \"file://{}\"\nchunk_records_max = 8\nchunk_age_max = \"1s\"\n\
         poll_interval = \"100ms\"\n",
        tier2_dir.display()
    );
    let _hub = hub_spec.start(&pki)?;
    let cert = pki.issue("dev-0", None)?;
    let mut agent_spec = AgentSpec::new(root, "dev-0", cert, Some(hub_spec.quic));
    agent_spec.extra_toml = format!("[http.influx_streams]\ntelegraf = \"{STREAM}\"\n");
    let _agent = agent_spec.start()?;
    let addr = agent_spec.http;

    // Telegraf's outputs.influxdb: v1 `/write`, gzip, one request per precision.
    for (n, precision) in ["s", "ms", "u", "n"].into_iter().enumerate() {
        let body = gzip(&telegraf_batch(n as i64, precision));
        let path = format!("/write?db=telegraf&precision={precision}");
        let headers = [("Content-Type", "text/plain"), ("Content-Encoding", "gzip")];
        let r = http::request(addr, "POST", &path, &headers, Some(&body))?;
        ensure!(
            r.status == 204,
            "precision {precision}: {} {}",
            r.status,
            r.text()
        );
    }
    // A parse error names its line and stores nothing of the batch.
    let bad = "cpu,host=gw-01 usage_idle=1 1\ncpu,host=gw-01 usage_idle= 2\n";
    let r = http::post(addr, "/write?db=telegraf", "text/plain", bad.as_bytes())?;
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()?["line"], 2);
    let r = http::post(addr, "/api/v2/write?bucket=nope", "text/plain", b"m x=1 1")?;
    assert_eq!(r.status, 404, "{}", r.text());

    let out = Command::new("python3")
        .args(["-c", CLIENT, &format!("http://{addr}"), &T0.to_string()])
        .output()
        .context("python3 with influxdb-client")?;
    ensure!(
        out.status.success(),
        "influxdb-client (pip install influxdb-client==1.49.0): {}",
        String::from_utf8_lossy(&out.stderr)
    );

    let total = 4 * 4 + 6;
    let catalog = hub_spec.data_dir.join("catalog.sqlite");
    tier2::wait_tiered(&catalog, STREAM, total, Duration::from_secs(60))?;
    let glob = format!("{}/streams/{STREAM}/**/*.parquet", tier2_dir.display());

    let types = duckdb(
        &glob,
        "SELECT column_name || ' ' || column_type FROM (DESCRIBE t) WHERE column_name IN \
         ('host','measurement','cpu','path','name','site','temp','gust','free','used','mode','running') \
         OR column_name LIKE 'temp%' ORDER BY column_name",
    )?;
    assert_eq!(
        types,
        json!([
            ["cpu VARCHAR"],
            ["free BIGINT"],
            ["gust BIGINT"],
            ["host VARCHAR"],
            ["measurement VARCHAR"],
            ["mode VARCHAR"],
            ["name VARCHAR"],
            ["path VARCHAR"],
            ["running BOOLEAN"],
            ["site VARCHAR"],
            ["temp DOUBLE"],
            ["used BIGINT"]
        ])
    );
    // Tags filter and group; every precision landed on the same second.
    let by_measurement = duckdb(
        &glob,
        "SELECT measurement, count(*), count(DISTINCT ts) FROM t WHERE host = 'gw-01' \
         GROUP BY measurement ORDER BY measurement",
    )?;
    assert_eq!(
        by_measurement,
        json!([
            ["cpu", 4, 4],
            ["disk", 4, 4],
            ["mem", 4, 4],
            ["modbus", 4, 4]
        ])
    );
    let temps = duckdb(
        &glob,
        "SELECT epoch_ms(ts) // 1000 - 1767225600, temp FROM t WHERE name = 'press7' ORDER BY ts",
    )?;
    assert_eq!(temps, json!([[0, 65.0], [1, 71.3], [2, 65.0], [3, 71.3]]));
    let weather = duckdb(
        &glob,
        "SELECT count(*), sum(temp), min(key) FROM t WHERE measurement = 'weather' AND site = 'north'",
    )?;
    let sum: f64 = (0..5).map(|i| 20.5 + f64::from(i)).sum::<f64>() + 30.5;
    assert_eq!(
        weather,
        json!([[6, sum, "host=gw-02/measurement=weather/site=north"]])
    );
    Ok(())
}
