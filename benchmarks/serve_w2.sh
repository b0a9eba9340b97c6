#!/usr/bin/env bash
# Serve a random-weight checkpoint through Ray Serve, drive the W2 load at it for DURATION seconds, and
# add TTFT / ITL / E2E percentiles to the benchmark report (<OUT>/benchmark.{json,md}).
#
#   OUT=$OUT benchmarks/serve_w2.sh                 # GPU host (carry .gpuwheels; ~3 min)
#   SMOKE=1 OUT=/tmp/serve-smoke benchmarks/serve_w2.sh   # CPU check: tiny model, 4 users, 15 s
#
# Environment: OUT (report dir, default benchmarks/reports), MODEL (a scripts.make_model shape, default
# llama-3.2-1b), CKPT (its directory, default /tmp/minserve_bench/$MODEL, made when missing), USERS (64),
# SPAWN_RATE (16/s), DURATION (60 s), WORKLOAD (W2), PORT (8000), PY (python3), READY_TIMEOUT (300 s),
# STREAM_INTERVAL_MS (10; GPU only: the engine's stream_interval_ms).
# Load tool: Locust with loadtests/locustfile.py when `import locust` works, else benchmarks.serve_client
# (same workload and timing definitions; the GPU host's wheelhouse has no Locust).
set -euo pipefail
cd "$(dirname "$0")/.."

SMOKE=${SMOKE:-0}
if [ "$SMOKE" = 1 ]; then
  PY=${PY:-.venv/bin/python}; MODEL=${MODEL:-tiny}; CKPT=${CKPT:-/tmp/minserve_bench_smoke/tiny}
  USERS=${USERS:-4}; SPAWN_RATE=${SPAWN_RATE:-4}; DURATION=${DURATION:-15}; PORT=${PORT:-8317}
  SCALE_ARGS=(--gen-scale 0.1 --prompt-scale 0.1)
  export RAY_ADDRESS=local  # never join a Ray cluster someone else started on a shared machine
else
  PY=${PY:-python3}; MODEL=${MODEL:-llama-3.2-1b}; CKPT=${CKPT:-/tmp/minserve_bench/$MODEL}
  USERS=${USERS:-64}; SPAWN_RATE=${SPAWN_RATE:-16}; DURATION=${DURATION:-60}; PORT=${PORT:-8000}
  SCALE_ARGS=()
fi
WORKLOAD=${WORKLOAD:-W2}
READY_TIMEOUT=${READY_TIMEOUT:-300}
OUT=${OUT:-benchmarks/reports}
RUN="$OUT/serve"
mkdir -p "$RUN"
export TQDM_MININTERVAL=${TQDM_MININTERVAL:-5}

# The serving stack on the offline host: the three lines of ../shared/tools/gpu_env.sh (not carried there).
if ! "$PY" -c "import ray.serve, fastapi" 2>/dev/null; then
  [ -d .gpuwheels ] || { echo "serve_w2.sh: Ray Serve is missing and there is no .gpuwheels to install it from" \
                              "(build it on the CPU side: python3 ../shared/tools/build_gpu_wheelhouse.py)"; exit 2; }
  "$PY" -m pip install -q --no-deps --no-index --target /tmp/pylib .gpuwheels/*.whl
  export PYTHONPATH=/tmp/pylib${PYTHONPATH:+:$PYTHONPATH} RAY_AUTH_MODE=disabled
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the replicas import app/ and engine/ from here

DEVICE=$("$PY" -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")
if [ ! -f "$CKPT/config.json" ]; then
  "$PY" -m scripts.make_model "$MODEL" "$CKPT" --device "$DEVICE"
fi

# serve_config.yaml with the model, GPUs, port and a GPU-sized engine swapped in.
"$PY" - "$CKPT" "$DEVICE" "$PORT" "$USERS" "$RUN/serve_config.yaml" "${STREAM_INTERVAL_MS:-10}" <<'EOF'
import sys, yaml
ckpt, device, port, users, dst, interval = sys.argv[1:]
cfg = yaml.safe_load(open("serve_config.yaml"))
cfg["http_options"]["port"] = int(port)
args = cfg["applications"][0]["args"]
args.update(model=ckpt, num_gpus=1 if device == "cuda" else 0, max_ongoing_requests=max(256, 2 * int(users)))
if device == "cuda":
    args["engine"].update(max_num_seqs=256, gpu_memory_utilization=0.85)
    args["stream_interval_ms"] = int(interval)  # batch stream chunks: fewer, larger SSE events
    args["engine"].pop("cpu_kv_cache_bytes", None)
yaml.safe_dump(cfg, open(dst, "w"), sort_keys=False)
EOF

echo "serve_w2.sh: starting Ray Serve ($MODEL on $DEVICE, port $PORT); log: $RUN/serve.log"
setsid "$PY" -c "from ray.serve.scripts import cli; cli()" run "$RUN/serve_config.yaml" >"$RUN/serve.log" 2>&1 &
SERVE_PID=$!
stop_server() {
  if kill -0 "$SERVE_PID" 2>/dev/null; then
    kill -INT "$SERVE_PID" 2>/dev/null || true  # serve run shuts Serve and its local Ray down on Ctrl-C
    for _ in $(seq 60); do kill -0 "$SERVE_PID" 2>/dev/null || break; sleep 1; done
  fi
  # Ray workers leave the process group but stay in the session setsid opened: stop what is left of it.
  for pid in $(ps -eo pid=,sid= | awk -v s="$SERVE_PID" '$2 == s {print $1}'); do
    kill -TERM "$pid" 2>/dev/null || true
  done
}
trap stop_server EXIT
trap 'stop_server; exit 143' TERM INT

URL="http://127.0.0.1:$PORT"
"$PY" - "$URL" "$READY_TIMEOUT" "$SERVE_PID" <<'EOF'
import os, sys, time, urllib.request
url, timeout, pid = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
t0 = time.time()
while time.time() - t0 < timeout:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("serve_w2.sh: `serve run` exited before the server came up; see serve.log")
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
            if r.status == 200:
                print(f"serve_w2.sh: server ready after {time.time() - t0:.0f} s")
                sys.exit(0)
    except Exception:
        pass
    time.sleep(2)
sys.exit(f"serve_w2.sh: no answer from {url}/v1/models within {timeout:.0f} s; see serve.log")
EOF

rm -f "$RUN"/summary.json "$RUN"/locust_*.csv
if [ "${LOCUST:-1}" != 0 ] && "$PY" -c "import locust" 2>/dev/null; then
  TOOL=locust
  "$PY" -m locust -f loadtests/locustfile.py --headless -u "$USERS" -r "$SPAWN_RATE" -t "${DURATION}s" \
    --workload "$WORKLOAD" --host "$URL" --csv "$RUN/locust" --only-summary "${SCALE_ARGS[@]}" \
    || echo "serve_w2.sh: locust exit code $? (failed requests?); summarising anyway"
else
  TOOL=benchmarks.serve_client
  "$PY" -m benchmarks.serve_client --host "$URL" --users "$USERS" --spawn-rate "$SPAWN_RATE" \
    --duration "$DURATION" --workload "$WORKLOAD" --out "$RUN" "${SCALE_ARGS[@]}"
fi

GPU=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU')")
"$PY" - "$RUN/meta.json" <<EOF
import json, sys
meta = {"workload": "$WORKLOAD", "model": "$MODEL", "checkpoint": "$CKPT", "users": $USERS,
        "spawn_rate": $SPAWN_RATE, "duration_s": $DURATION, "load_tool": "$TOOL", "gpu": "$GPU",
        "serve_config": "$RUN/serve_config.yaml", "command": "benchmarks/serve_w2.sh",
        "scale_args": "${SCALE_ARGS[*]}"}
json.dump(meta, open(sys.argv[1], "w"), indent=2)
EOF
trap - EXIT TERM INT
stop_server
"$PY" -m benchmarks.report --out "$OUT" --serve "$RUN"
