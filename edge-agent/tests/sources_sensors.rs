//! Sensor sources inside the real agent: a fake hwmon tree with one good and one garbage
//! channel, and the seeded simulator. Records arrive in the log, the garbage channel is
//! reported and skipped, and the agent stays healthy throughout.

mod process_support;

use std::time::{Duration, Instant};

use process_support::Setup;

fn write(path: &std::path::Path, text: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, text).unwrap();
}

#[test]
fn hwmon_and_simulator_sources_feed_the_log_and_survive_garbage() {
    let setup = Setup::new("fsync = \"always\"");
    let sys = setup.dir.path().join("sys");
    let chip = sys.join("class/hwmon/hwmon0");
    write(&chip.join("name"), "cpu_thermal\n");
    write(&chip.join("temp1_input"), "48250\n");
    write(&chip.join("temp1_label"), "package\n");
    write(&chip.join("temp2_input"), "not-a-number\n");
    let config = format!(
        "data_dir = \"data\"\n[http]\nlisten = \"127.0.0.1:{port}\"\n\
         [[streams]]\nname = \"telemetry\"\n[[streams]]\nname = \"sim\"\n\
         [[sources]]\nkind = \"hwmon\"\nstream = \"telemetry\"\nsysfs_root = {sys:?}\ninterval = \"50ms\"\nkey_prefix = \"dev-7\"\n\
         [[sources]]\nkind = \"simulator\"\nstream = \"sim\"\nsim = \"fleet\"\nunits = 3\nhz = 10\nseed = 4\ninterval = \"100ms\"\nkey_prefix = \"dev-7\"\n",
        port = setup.port,
        sys = sys.display().to_string(),
    );
    std::fs::write(&setup.config, config).unwrap();
    let mut agent = setup.start();
    let client = setup.client();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let get = |path: &str| rt.block_on(client.get(path)).unwrap().text();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let status: serde_json::Value = serde_json::from_str(&get("/v1/status")).unwrap();
        let next = |name: &str| {
            status["streams"]
                .as_array()
                .unwrap()
                .iter()
                .find(|s| s["stream"] == name)
                .unwrap()["next_seq"]
                .as_u64()
                .unwrap()
        };
        if next("telemetry") > 3 && next("sim") > 30 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "sources produced too little: {status}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let health = get("/healthz");
    assert!(
        health.starts_with("ok"),
        "the agent stays healthy with a garbage channel: {health}"
    );
    agent.terminate();
    let log = agent.log_text();
    assert!(
        log.contains("temp2_input"),
        "the garbage channel is reported by file name:\n{log}"
    );
    let records = setup.inspect();
    assert!(records.len() > 3);
    for r in &records {
        assert_eq!(r["key"], "dev-7/hwmon/cpu_thermal", "{r}");
        assert_eq!(
            r["fields"]["package_c"], 48.25,
            "millidegrees become degrees C: {r}"
        );
        assert!(
            r["fields"].get("temp2_c").is_none(),
            "the garbage channel is skipped: {r}"
        );
    }
}
