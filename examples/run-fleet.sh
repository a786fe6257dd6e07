#!/usr/bin/env bash
# Starts a hub (examples/hub.toml) and two agents (examples/edge-http.toml and
# examples/edge-sensors.toml) on this machine, with a fresh fleet CA, posts
# examples/sample.ndjson through the first agent and waits until the hub holds it.
#
#   examples/run-fleet.sh                 # runs until Ctrl-C, under /var/tmp/tributary
#   examples/run-fleet.sh --check [DIR]   # stops everything once the records arrived, exit 0
#
# The binaries come from $BIN (default target/release, else target/debug, else $PATH).
# Ports: HUB_QUIC, HUB_HTTP, EDGE_HTTP_1, EDGE_HTTP_2 (defaults those of the example files).
# The examples' paths are overridden from the environment (TRIBUTARY_HUB__*, TRIBUTARY_EDGE__*),
# so the files stay as they are whatever DIR is.
set -euo pipefail

check=0
if [ "${1:-}" = "--check" ]; then check=1; shift; fi
examples="$(cd "$(dirname "$0")" && pwd)"
work="${1:-/var/tmp/tributary}"
hub_quic="${HUB_QUIC:-127.0.0.1:7400}"
hub_http="${HUB_HTTP:-127.0.0.1:7480}"
edge_http_1="${EDGE_HTTP_1:-127.0.0.1:7401}"
edge_http_2="${EDGE_HTTP_2:-127.0.0.1:7402}"

find_bin() {
  local name="$1" dir
  for dir in "${BIN:-}" "$examples/../target/release" "$examples/../target/debug"; do
    if [ -n "$dir" ] && [ -x "$dir/$name" ]; then echo "$dir/$name"; return; fi
  done
  command -v "$name" || { echo "run-fleet: no $name binary: cargo build --release" >&2; exit 1; }
}
core_hub="$(find_bin core-hub)"
edge_agent="$(find_bin edge-agent)"

# Waits up to $2 seconds for an HTTP URL to answer 200.
wait_ok() {
  local url="$1" seconds="$2" i
  for ((i = 0; i < seconds * 10; i++)); do
    curl -fsS -o /dev/null "$url" 2>/dev/null && return 0
    sleep 0.1
  done
  echo "run-fleet: $url did not answer within ${seconds}s" >&2
  return 1
}

pids=()
stop() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; wait || true; }
trap stop EXIT

mkdir -p "$work/logs"
if [ ! -f "$work/pki/ca.pem" ]; then
  "$core_hub" pki init --dir "$work/pki" >/dev/null
fi
for device in edge-http edge-sensors; do
  if [ ! -f "$work/certs/$device/device.pem" ]; then
    "$core_hub" pki issue --dir "$work/pki" --device "$device" --out "$work/certs/$device" >/dev/null
  fi
done

TRIBUTARY_HUB__DATA_DIR="$work/hub" \
TRIBUTARY_HUB__LISTEN__QUIC="$hub_quic" \
TRIBUTARY_HUB__LISTEN__HTTP="$hub_http" \
TRIBUTARY_HUB__TLS__CA="$work/pki/ca.pem" \
TRIBUTARY_HUB__TLS__CERT="$work/pki/hub.pem" \
TRIBUTARY_HUB__TLS__KEY="$work/pki/hub.key" \
TRIBUTARY_HUB__TIER2__URL="file://$work/tier2" \
  "$core_hub" run --config "$examples/hub.toml" >"$work/logs/hub.log" 2>&1 &
pids+=($!)
wait_ok "http://$hub_http/healthz" 60

# Starts agent $1 from examples/$1.toml on HTTP address $2.
start_agent() {
  local device="$1" listen="$2"
  TRIBUTARY_EDGE__DATA_DIR="$work/$device" \
  TRIBUTARY_EDGE__HUB__ADDR="$hub_quic" \
  TRIBUTARY_EDGE__HTTP__LISTEN="$listen" \
  TRIBUTARY_EDGE__TLS__CA="$work/certs/$device/ca.pem" \
  TRIBUTARY_EDGE__TLS__CERT="$work/certs/$device/device.pem" \
  TRIBUTARY_EDGE__TLS__KEY="$work/certs/$device/device.key" \
    "$edge_agent" run --config "$examples/$device.toml" >"$work/logs/$device.log" 2>&1 &
  pids+=($!)
  wait_ok "http://$listen/healthz" 60
}
start_agent edge-http "$edge_http_1"
start_agent edge-sensors "$edge_http_2"

records=$(grep -c . "$examples/sample.ndjson")
curl -fsS -H 'content-type: application/x-ndjson' --data-binary "@$examples/sample.ndjson" \
  "http://$edge_http_1/v1/streams/telemetry/records" >/dev/null

# The hub's stream holds every record once it says next_offset >= records.
held=0
for ((i = 0; i < 600; i++)); do
  held=$(curl -fsS "http://$hub_http/v1/streams" 2>/dev/null \
    | python3 -c 'import json,sys
s=json.load(sys.stdin)
s=s.get("streams", s) if isinstance(s, dict) else s
print(next((x.get("next_offset", x.get("records", 0)) for x in s if x.get("name")=="telemetry"), 0))' \
    2>/dev/null || echo 0)
  [ "$held" -ge "$records" ] && break
  sleep 0.1
done
if [ "$held" -lt "$records" ]; then
  echo "run-fleet: the hub holds $held of $records telemetry records; logs in $work/logs" >&2
  exit 1
fi
echo "hub http://$hub_http holds $held telemetry records from edge-http;" \
  "edge-sensors ships simulated trucks to the sensors stream"
echo "status page: http://$hub_http/   logs: $work/logs   tier 2: $work/tier2"
if [ "$check" = 1 ]; then exit 0; fi
echo "Ctrl-C stops the hub and both agents"
wait
