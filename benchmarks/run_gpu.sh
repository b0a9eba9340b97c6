#!/usr/bin/env bash
# The GPU benchmark run: every figure within a wall-time budget; the report goes to ${OUT:-benchmarks/reports}
# (benchmark.json / .md / .png, parts/, console.log) and the short table is printed last.
#
#   OUT=$OUT benchmarks/run_gpu.sh                        # all suites, about 9 minutes on one H100
#   SUITES=c,hf-c,eager OUT=$OUT benchmarks/run_gpu.sh    # a subset (jobs past the budget are "skipped")
#   OUT=$OUT benchmarks/run_gpu.sh --enforce-eager        # extra flags go to python -m benchmarks.bench
#
# Environment: BUDGET_S (540: the jobs' wall-time budget; one device command may run 600 s), SUITES (all),
# CKPT_DIR (/tmp/minserve_bench: random-weight checkpoints, ~20 GB, reused when present), PY (python3).
# Runs split over several device calls are combined on the CPU side with
#   python -m benchmarks.report --merge RUN1 RUN2 [SERVE_RUN] --out benchmarks/reports
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-benchmarks/reports}
PY=${PY:-python3}
BUDGET_S=${BUDGET_S:-540}
SUITES=${SUITES:-all}
CKPT_DIR=${CKPT_DIR:-/tmp/minserve_bench}
export TQDM_MININTERVAL=${TQDM_MININTERVAL:-10}  # fewer progress-bar redraws in a captured log
mkdir -p "$OUT" "$CKPT_DIR"

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "run_gpu.sh: no nvidia-smi"
free_gb=$(df -Pk "$CKPT_DIR" | awk 'NR == 2 {print int($4 / 1048576)}')
echo "run_gpu.sh: ${free_gb} GiB free under $CKPT_DIR (the three checkpoints need about 20 GiB)"

"$PY" -m benchmarks.bench --suite "$SUITES" --out "$OUT" --budget-s "$BUDGET_S" --ckpt-dir "$CKPT_DIR" "$@" \
  2>&1 | tee "$OUT/console.log"
