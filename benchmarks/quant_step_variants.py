"""Device time of one batch-1 decode step under variants of the quantised GEMV kernels, in one process.

    python -m benchmarks.quant_step_variants --model llama-3.1-8b --out PREFIX

A tuning tool beside benchmarks/quant_sweep.py: a kernel variant that wins alone can lose inside a
step, where each GEMV follows a short kernel instead of another GEMV, so this times the whole step.
For each format (benchmarks.quant_decode's checkpoints), each variant sets module constants of the
kernels, builds an engine (which captures its CUDA graphs with them), decodes one greedy request to a
steady state and times the step on the device alone (benchmarks.decode_profile.device_step_us: graph
replay, logits and argmax back to back, best of three medians of 30), then restores the constants.
bf16 and fp8-block run once each as the baselines of the same process.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.common import environment, git_commit, write_report
from benchmarks.quant_decode import ROOT, checkpoint

# format -> [(label, {"module.CONSTANT": value})]; "w8" is kernels.triton_qgemv_w8a8, "qv" triton_qgemv
VARIANTS = {
    "bf16": [("bf16 GEMV", {})],
    "fp8-block": [("fp8 GEMV", {})],
    "int8": [
        ("W8A8 DP4A GEMV (default)", {}),
        ("W8A8 DP4A GEMV, float-GEMV tiles", {"w8.MAX_WIDE_PROGRAMS_PER_SM": 0}),
        ("weight-only float GEMV, PRMT", {"w8.supported": lambda *a: False}),
        ("weight-only float GEMV, Triton-lowered", {"w8.supported": lambda *a: False, "qv.PRMT_INT8": False}),
    ],
}


def _set(patch: dict) -> dict:
    from kernels import triton_qgemv, triton_qgemv_w8a8

    mods = {"qv": triton_qgemv, "w8": triton_qgemv_w8a8}
    old = {}
    for key, value in patch.items():
        mod, name = key.split(".")
        old[key] = getattr(mods[mod], name)
        setattr(mods[mod], name, value)
    return old


def step_us(path: Path, opts: dict) -> float:
    from benchmarks.decode_profile import _decode_until_steady, device_step_us
    from engine import LLM, SamplingParams

    llm = LLM(str(path), max_num_seqs=8, max_model_len=600, num_blocks=256, enable_prefix_caching=False,
              **opts)  # fmt: skip
    engine = llm.engine
    sp = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    engine.add_request(list(range(100, 228)), sp)
    _decode_until_steady(engine, 1)
    us = min(device_step_us(engine, 1) for _ in range(3))
    while engine.has_unfinished():
        engine.step()
    return us


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--ckpt-dir", type=Path, default=Path("/tmp/minserve_bench"))
    ap.add_argument("--out", required=True, help="PREFIX for PREFIX.json and PREFIX.md")
    args = ap.parse_args(argv)
    cmd = "python -m benchmarks.quant_step_variants " + " ".join(sys.argv[1:] if argv is None else argv)
    rows = []
    for fmt, variants in VARIANTS.items():
        path, opts = checkpoint(args.model, fmt, args.ckpt_dir)
        for label, patch in variants:
            old = _set(patch)
            try:
                rows.append({"format": fmt, "variant": label, "step_us": round(step_us(path, opts), 1)})
            finally:
                _set(old)
            print(rows[-1], flush=True)
    base = rows[0]["step_us"]
    env = environment()
    lines = [f"# Batch-1 decode step of {args.model} by GEMV variant (device time)\n",
             f"Command: `{cmd}`  ", f"Commit {git_commit(ROOT)}; {env['hardware'].get('gpu')}\n",
             "| format | variant | step µs | speed-up over bf16 |", "|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['format']} | {r['variant']} | {r['step_us']:,.1f} | {base / r['step_us']:.3f}x |")
    report = {"command": cmd, "commit": git_commit(ROOT), **env, "rows": rows}
    write_report(args.out, report, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
