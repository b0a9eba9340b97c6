"""Device time of one decode step under variants of the quantised linear kernels, in one process.

    python -m benchmarks.quant_step_variants --model llama-3.1-8b --out PREFIX              # batch-1 GEMVs
    python -m benchmarks.quant_step_variants --set act --batch 64 --out PREFIX             # act quantisation

A tuning tool beside benchmarks/quant_sweep.py: a kernel variant that wins alone can lose inside a
step, where each GEMV follows a short kernel instead of another GEMV, so this times the whole step.
For each format (benchmarks.quant_decode's checkpoints), each variant sets module constants of the
kernels, builds an engine (which captures its CUDA graphs with them), decodes `--batch` greedy requests
to a steady state and times the step on the device alone (benchmarks.decode_profile.device_step_us: graph
replay, logits and argmax back to back, best of three medians of 30), then restores the constants.
bf16 runs once as the baseline of the same process.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.common import environment, git_commit, write_report
from benchmarks.quant_decode import ROOT, checkpoint
from benchmarks.quant_sweep import patched

# format -> [(label, {"module.CONSTANT": value})]; "tg" is kernels.triton_gemv, "w8" triton_qgemv_w8a8,
# "qv" triton_qgemv, "qm" triton_qgemm, "tn" triton_norm, "da" triton_decode_attention, "QuantLinear"
# the class engine.models.quant_linear.QuantLinear
# Each kernel before a GEMV lets it launch before its own wait (RELEASE_FIRST), and gate|up's GEMV applies
# the activation (GATED_EPILOGUE); the variants turn these off.
GEMVS_LATE = {"tg.RELEASE_FIRST": False, "qv.RELEASE_FIRST": False, "w8.RELEASE_FIRST": False}
LATE = {**GEMVS_LATE, "tn.RELEASE_FIRST": False, "da.RELEASE_FIRST": False}
UNFUSED = {"tg.GATED_EPILOGUE": False, "qv.GATED_EPILOGUE": False}


def _launch_variants(fmt: str) -> list:
    return [
        (f"{fmt} GEMV (default)", {}),
        ("GEMVs release their successor after their wait", GEMVS_LATE),
        ("every kernel releases its successor after its wait", LATE),
        ("... and a separate activation kernel (the kernels of dc809bc)", {**LATE, **UNFUSED}),
    ]


GEMV_VARIANTS = {
    "bf16": _launch_variants("bf16"),
    "fp8-block": _launch_variants("fp8-block"),
    "fp8-channel": [
        *_launch_variants("fp8-channel"),
        ("per-row scales loaded after the last tile", {"qv.SCALE_FIRST": False}),
    ],
    "int8": [
        ("W8A8 DP4A GEMV (default)", {}),
        ("W8A8 DP4A GEMV releasing its successor after its wait", {"w8.RELEASE_FIRST": False}),
        ("W8A8 DP4A GEMV, float-GEMV tiles", {"w8.MAX_WIDE_PROGRAMS_PER_SM": 0}),
        ("W8A8 DP4A GEMV, down_proj finds amax itself", {"QuantLinear.takes_act_amax": False}),
        ("weight-only float GEMV, PRMT", {"w8.supported": lambda *a: False}),
        ("weight-only float GEMV, Triton-lowered", {"w8.supported": lambda *a: False, "qv.PRMT_INT8": False}),
    ],
}
ACT = [("activations quantised in one pass (default)", {}), ("two chunked passes", {"qm.MAX_ONE_PASS": 0})]
ACT_VARIANTS = {"bf16": [("bf16 cuBLAS", {})], "fp8-channel": ACT, "fp8-block": ACT}
SETS = {"gemv": GEMV_VARIANTS, "act": ACT_VARIANTS}


def step_us(path: Path, opts: dict, batch: int) -> float:
    from benchmarks.decode_profile import decode_until_steady, device_step_us
    from engine import LLM, SamplingParams

    llm = LLM(str(path), max_num_seqs=max(8, batch), max_model_len=600, num_blocks=24 * batch + 64,
              enable_prefix_caching=False, **opts)  # fmt: skip
    engine = llm.engine
    sp = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(list(range(100 + i, 228 + i)), sp)
    decode_until_steady(engine, batch)
    us = min(device_step_us(engine, batch) for _ in range(3))
    while engine.has_unfinished():
        engine.step()
    return us


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--set", choices=sorted(SETS), default="gemv", help="which kernel's variants")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ckpt-dir", type=Path, default=Path("/tmp/minserve_bench"))
    ap.add_argument("--out", required=True, help="PREFIX for PREFIX.json and PREFIX.md")
    ap.add_argument("--only", default="", help="comma list: run the variants whose label contains one")
    args = ap.parse_args(argv)
    only = [w for w in args.only.split(",") if w]
    cmd = "python -m benchmarks.quant_step_variants " + " ".join(sys.argv[1:] if argv is None else argv)
    rows = []
    for i, (fmt, variants) in enumerate(SETS[args.set].items()):
        # bf16's first variant is the baseline, always run
        chosen = [
            v for j, v in enumerate(variants) if i == j == 0 or not only or any(w in v[0] for w in only)
        ]
        path, opts = checkpoint(args.model, fmt, args.ckpt_dir) if chosen else (None, None)
        for label, patch in chosen:
            undo = patched(patch)
            try:
                us = step_us(path, opts, args.batch)
                rows.append({"format": fmt, "variant": label, "step_us": round(us, 1)})
            finally:
                undo()
            print(rows[-1], flush=True)
    base = rows[0]["step_us"]
    env = environment()
    lines = [f"# Batch-{args.batch} decode step of {args.model} by kernel variant (device time)\n",
             f"Command: `{cmd}`  ", f"Commit {git_commit(ROOT)}; {env['hardware'].get('gpu')}\n",
             "| format | variant | step µs | speed-up over bf16 |", "|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['format']} | {r['variant']} | {r['step_us']:,.1f} | {base / r['step_us']:.3f}x |")
    report = {"command": cmd, "commit": git_commit(ROOT), **env, "rows": rows}
    write_report(args.out, report, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
