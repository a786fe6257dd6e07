//! Tests of the harness pieces that run real processes: `procs`, `ports`, `mosquitto`.
//!
//! They use ordinary system programs (`sh`, `sleep`) and a real mosquitto, so a broken helper
//! shows up here rather than as a confusing failure in a system test.

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::ExitStatusExt;
use std::time::{Duration, Instant};

use anyhow::Result;
use tributary_tests::mosquitto::{Mosquitto, MosquittoOptions};
use tributary_tests::procs::{Proc, ProcSpec, bin_path, wait_for, wait_until};
use tributary_tests::{http, ports};

const WAIT: Duration = Duration::from_secs(10);

#[test]
fn bin_path_points_next_to_the_test_executable() {
    let path = bin_path("core-hub");
    let dir = path.parent().expect("a directory");
    assert!(
        dir.join("deps").is_dir(),
        "{} is not a target profile directory",
        dir.display()
    );
    assert_eq!(path.file_name().and_then(|n| n.to_str()), Some("core-hub"));
}

#[test]
fn a_missing_binary_is_a_clear_error() {
    let error = Proc::spawn(ProcSpec::new(bin_path("no-such-binary"))).unwrap_err();
    assert!(
        format!("{error:#}").contains("cargo build --workspace"),
        "{error:#}"
    );
}

#[test]
fn output_is_captured_and_kill9_reports_sigkill() -> Result<()> {
    let spec = ProcSpec::new("/bin/sh")
        .name("shell")
        .args(["-c", "echo out-$GREETING; echo err-line >&2; exec sleep 30"])
        .env("GREETING", "hello");
    let mut proc = Proc::spawn(spec)?;
    wait_until(WAIT, "both lines to be written", || {
        proc.stdout().contains("out-hello") && proc.stderr().contains("err-line")
    })?;
    assert!(proc.is_running());
    let status = proc.kill9()?;
    assert_eq!(status.signal(), Some(libc::SIGKILL));
    assert!(!proc.is_running());
    assert!(proc.log_tail(5).contains("err-line"));

    proc.restart()?;
    assert_eq!(proc.spawns(), 2);
    wait_until(WAIT, "the restarted output", || {
        proc.stdout().matches("out-hello").count() == 2
    })?;
    Ok(())
}

#[test]
fn terminate_sends_sigterm_and_waits() -> Result<()> {
    let mut proc = Proc::spawn(ProcSpec::new("sleep").arg("30"))?;
    let status = proc.terminate(WAIT)?;
    assert_eq!(status.signal(), Some(libc::SIGTERM));

    // A process that ignores SIGTERM is killed at the deadline, and that is reported.
    let trap = ProcSpec::new("/bin/sh")
        .args(["-c", "trap '' TERM; echo ready; while :; do sleep 1; done"]);
    let mut stubborn = Proc::spawn(trap)?;
    wait_until(WAIT, "the trap to be set", || {
        stubborn.stdout().contains("ready")
    })?;
    let error = stubborn.terminate(Duration::from_millis(300)).unwrap_err();
    assert!(
        format!("{error:#}").contains("ignored SIGTERM"),
        "{error:#}"
    );
    assert!(!stubborn.is_running());
    Ok(())
}

#[test]
fn drop_kills_the_process_and_its_children() -> Result<()> {
    let spec = ProcSpec::new("/bin/sh").args(["-c", "sleep 30 & echo $!; wait"]);
    let proc = Proc::spawn(spec)?;
    let pid = proc.pid();
    let child: u32 = wait_for(WAIT, "the child's pid", || {
        proc.stdout().trim().parse().ok()
    })?;
    drop(proc);
    assert!(!alive(pid), "pid {pid} survived the drop of its Proc");
    // The orphaned child is reaped by init at its own pace; it must be dead, not necessarily gone.
    wait_until(WAIT, "the child to die with its group", || !alive(child))?;
    Ok(())
}

/// Whether `pid` exists and is not a zombie.
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

#[test]
fn wait_until_times_out_with_the_reason() {
    let started = Instant::now();
    let error = wait_until(Duration::from_millis(100), "the impossible", || false).unwrap_err();
    assert!(started.elapsed() >= Duration::from_millis(100));
    assert!(error.to_string().contains("the impossible"), "{error}");
    let mut n = 0;
    assert_eq!(
        wait_for(WAIT, "n to reach 3", || {
            n += 1;
            (n >= 3).then_some(n)
        })
        .unwrap(),
        3
    );
}

#[test]
fn wait_http_ok_fails_fast_when_the_process_dies() -> Result<()> {
    let mut proc = Proc::spawn(ProcSpec::new("/bin/sh").args(["-c", "echo dying >&2; exit 3"]))?;
    let addr = ports::loopback(ports::Proto::Tcp);
    let started = Instant::now();
    let error = proc.wait_http_ok(addr, "/healthz", WAIT).unwrap_err();
    assert!(
        started.elapsed() < WAIT,
        "must not wait for the deadline once the process exited"
    );
    let text = format!("{error:#}");
    assert!(text.contains("exited") && text.contains("dying"), "{text}");
    Ok(())
}

#[test]
fn wait_http_ok_returns_the_answer() -> Result<()> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let server = std::thread::spawn(move || -> Result<()> {
        // The first probe gets a 503, the second a 200, as a starting service would answer.
        for answer in ["503 Service Unavailable", "200 OK"] {
            let (mut stream, _) = listener.accept()?;
            let mut buf = [0u8; 1024];
            let _ = std::io::Read::read(&mut stream, &mut buf)?;
            write!(stream, "HTTP/1.1 {answer}\r\nContent-Length: 2\r\n\r\nok")?;
        }
        Ok(())
    });
    let mut proc = Proc::spawn(ProcSpec::new("sleep").arg("30"))?;
    let response = proc.wait_http_ok(addr, "/healthz", WAIT)?;
    assert_eq!((response.status, response.text().as_str()), (200, "ok"));
    server.join().expect("server thread")?;
    assert!(http::get(addr, "/").is_err(), "the server is gone");
    Ok(())
}

#[test]
fn mosquitto_starts_accepts_restarts_and_stops() -> Result<()> {
    let data = tempfile::tempdir()?;
    let options = MosquittoOptions {
        persistence_dir: Some(data.path().into()),
        ..Default::default()
    };
    let mut broker = Mosquitto::start_with(options)?;
    TcpStream::connect_timeout(&broker.addr(), WAIT)?;
    let config = std::fs::read_to_string(broker.conf_path())?;
    assert!(
        config.contains(&format!("listener {} 127.0.0.1", broker.port())),
        "{config}"
    );
    assert!(config.contains("persistence true"));

    broker.proc_mut().kill9()?;
    assert!(
        TcpStream::connect_timeout(&broker.addr(), WAIT).is_err(),
        "a killed broker accepts nothing"
    );
    broker.restart()?;
    TcpStream::connect_timeout(&broker.addr(), WAIT)?;
    broker.stop()?;
    // SIGTERM makes mosquitto save its database on the way out.
    assert!(data.path().join("mosquitto.db").exists());
    Ok(())
}

#[test]
fn mosquitto_default_has_no_persistence() -> Result<()> {
    let broker = Mosquitto::start()?;
    TcpStream::connect_timeout(&broker.addr(), WAIT)?;
    assert!(std::fs::read_to_string(broker.conf_path())?.contains("persistence false"));
    Ok(())
}
