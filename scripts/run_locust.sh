#!/usr/bin/env bash
# Headless Locust run against minserve, writing its CSV files and summary (benchmarks/runs/ is git-ignored).
#   scripts/run_locust.sh                  # starts `serve run serve_config.yaml`, W2, 16 users, 60 s
#                                          # -> benchmarks/runs/locust_w2_cpu_{stats,...}.csv, .summary.txt
#   HOST=http://gpu-box:8000 WORKLOAD=W3 USERS=64 DURATION=120s OUT=benchmarks/runs/locust_w3_gpu \
#     MINSERVE_GEN_SCALE=1 scripts/run_locust.sh   # against a running server, full lengths
# Without HOST, the server is started from $CONFIG and stopped at the end (log: $SERVER_LOG).
# On the 2-core CPU box generation lengths are scaled down (MINSERVE_GEN_SCALE default 0.25).
set -euo pipefail
cd "$(dirname "$0")/.."
WORKLOAD=${WORKLOAD:-W2}
USERS=${USERS:-16}
SPAWN_RATE=${SPAWN_RATE:-$USERS}
DURATION=${DURATION:-60s}
CONFIG=${CONFIG:-serve_config.yaml}
OUT=${OUT:-benchmarks/runs/locust_$(echo "$WORKLOAD" | tr '[:upper:]' '[:lower:]')_cpu}
SERVER_LOG=${SERVER_LOG:-${TMPDIR:-/tmp}/minserve_locust_server.log}
export MINSERVE_GEN_SCALE=${MINSERVE_GEN_SCALE:-0.25}
mkdir -p "$(dirname "$OUT")"

if [ -z "${HOST:-}" ]; then
  HOST=http://127.0.0.1:8000
  # TERM, not INT, stops it: a background job of a script ignores SIGINT.
  .venv/bin/serve run "$CONFIG" > "$SERVER_LOG" 2>&1 &
  server=$!
  trap 'kill -TERM "$server" 2>/dev/null; wait "$server" 2>/dev/null || true' EXIT
  for _ in $(seq 1 90); do
    if curl -sf "$HOST/health" > /dev/null 2>&1; then break; fi
    if ! kill -0 "$server" 2>/dev/null; then echo "serve run exited; see $SERVER_LOG" >&2; exit 1; fi
    sleep 2
  done
  curl -sf "$HOST/health" > /dev/null || { echo "server not healthy after 180 s; see $SERVER_LOG" >&2; exit 1; }
fi

echo "locust: $WORKLOAD, $USERS users, $DURATION, gen scale $MINSERVE_GEN_SCALE, host $HOST"
.venv/bin/locust -f loadtests/ --host "$HOST" --headless -u "$USERS" -r "$SPAWN_RATE" -t "$DURATION" \
  --workload "$WORKLOAD" --csv "$OUT" --only-summary 2>&1 | tee "$OUT.summary.txt"
