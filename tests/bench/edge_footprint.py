#!/usr/bin/env python3
"""Edge footprint under a steady load: RSS and CPU of a running edge agent at a fixed record rate.

Starts the given edge-agent binary with a throwaway data dir (interval:10ms fsync, one stream),
posts NDJSON batches at --rate records/s for --seconds, and reports the agent's peak and final
RSS and its CPU time as a share of one core, read from /proc. The producer's own CPU is not
counted. Before the load, the agent's RSS once it has been up and idle for --idle-seconds
(healthy, nothing posted) is reported as idle_rss_mib. Prints one JSON object.

  tests/bench/edge_footprint.py --bin target/edge/edge-agent --rate 10000 --seconds 30
"""
import argparse, http.client, json, os, socket, subprocess, tempfile, time

def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p

def proc_stats(pid):
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    ticks = int(parts[11]) + int(parts[12])  # utime + stime
    rss = hwm = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"): rss = int(line.split()[1]) * 1024
            if line.startswith("VmHWM:"): hwm = int(line.split()[1]) * 1024
    return ticks / os.sysconf("SC_CLK_TCK"), rss, hwm

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/edge/edge-agent")
    ap.add_argument("--rate", type=int, default=10000)
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--idle-seconds", type=float, default=3)
    a = ap.parse_args()
    d = tempfile.mkdtemp(prefix="tributary-footprint-")
    port = free_port()
    cfg = os.path.join(d, "edge.toml")
    with open(cfg, "w") as f:
        f.write(f'data_dir = "{d}/data"\n[http]\nlisten = "127.0.0.1:{port}"\n'
                '[storage]\nfsync = "interval:10ms"\n[[streams]]\nname = "telemetry"\n')
    agent = subprocess.Popen([a.bin, "run", "--config", cfg], stderr=subprocess.DEVNULL)
    try:
        for _ in range(200):
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=2); c.request("GET", "/healthz")
                if c.getresponse().status == 200: break
            except OSError: pass
            time.sleep(0.05)
        else:
            raise SystemExit("the agent did not answer /healthz")
        time.sleep(a.idle_seconds)
        _, idle_rss, _ = proc_stats(agent.pid)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        per_s = a.rate / a.batch
        seq = 0
        t0 = time.monotonic(); cpu0, _, _ = proc_stats(agent.pid)
        n = 0
        while time.monotonic() - t0 < a.seconds:
            lines = []
            for i in range(a.batch):
                seq += 1
                lines.append(json.dumps({"key": f"truck-{seq % 200:04d}/engine", "ts": 1764374400000000000 + seq * 1000000,
                    "fields": {"engine_temp_c": round(70 + (seq % 97) / 10, 2), "speed_kmh": round((seq % 900) / 10, 1),
                               "odometer_m": 100000 + seq, "ignition": seq % 2 == 0}}))
            conn.request("POST", "/v1/streams/telemetry/records", "\n".join(lines), {"Content-Type": "application/x-ndjson"})
            r = conn.getresponse(); r.read()
            assert r.status == 200, r.status
            n += a.batch
            due = t0 + n / a.rate
            wait = due - time.monotonic()
            if wait > 0: time.sleep(wait)
        elapsed = time.monotonic() - t0
        cpu1, rss, hwm = proc_stats(agent.pid)
        print(json.dumps({"records": n, "seconds": round(elapsed, 2), "records_per_s": round(n / elapsed),
                          "agent_cpu_pct_of_one_core": round(100 * (cpu1 - cpu0) / elapsed, 2),
                          "agent_cpu_ns_per_record": round(1e9 * (cpu1 - cpu0) / n),
                          "idle_rss_mib": round(idle_rss / 2**20, 2),
                          "rss_mib": round(rss / 2**20, 2), "peak_rss_mib": round(hwm / 2**20, 2),
                          "binary_bytes": os.path.getsize(a.bin)}))
    finally:
        agent.terminate(); agent.wait(10)

if __name__ == "__main__":
    main()
