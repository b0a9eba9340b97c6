"""Tile-config sweep of the quantised linear kernels on one GPU: which fixed config each projection
shape should get (kernels/triton_qgemv_tiles.py, kernels/triton_qgemm.py take theirs from module constants,
which this patches one variant at a time). A tuning tool: its table informs the constants, the report
of record is benchmarks/quant_bench.py's.

    python -m benchmarks.quant_sweep --models llama-3.1-8b --out PREFIX
"""

from __future__ import annotations

import argparse
import math
import sys

from benchmarks.quant_bench import (
    L2_MULTIPLE,
    MAX_COPIES,
    SHAPES,
    device_env,
    make_call,
    quantise_weight,
    time_calls,
)

W8A8 = ("qgemv", "int8-channel", "int8_token")
# (label, {module attribute: value}, kernel, weights, act_quant): M = 1
GEMV = [
    ("gemv bf16", {}, "gemv", "bf16", None),
    ("qgemv fp8 default", {}, "qgemv", "fp8-channel", None),
    ("qgemv fp8 short 1024x8 s3", {"qt.SHORT_ROWS": (1024, 3, 8, 4)}, "qgemv", "fp8-channel", None),
    ("qgemv fp8-block default", {}, "qgemv", "fp8-block", None),
    ("qgemv int8 default", {}, "qgemv", "int8-channel", None),
    ("qgemv int8 triton-lowered", {"qv.PRMT_INT8": False}, "qgemv", "int8-channel", None),
    ("qgemv int8 w8a8 dp4a", {}, *W8A8),
    ("qgemv int8 w8a8 dp4a, float-GEMV tiles", {"w8.MAX_WIDE_PROGRAMS_PER_SM": 0}, *W8A8),
    ("qgemv int8 w8a8 dp4a, wide 16x1024 s3", {"w8.WIDE": (16, 1024, 3, 8)}, *W8A8),
    ("qgemv int8 w8a8 dp4a, wide 16x2048 w4", {"w8.WIDE": (16, 2048, 2, 4)}, *W8A8),
    ("qgemv int8 w8a8 dp4a, wide up to 8/SM", {"w8.MAX_WIDE_PROGRAMS_PER_SM": 8}, *W8A8),
    ("qgemv int8 w8a8 dp4a, long 16x2048", {"qt.LONG_ROWS": (2048, 3, 16, 8)}, *W8A8),
    ("qgemv int8 w8a8 dp4a, long 8x1024 s4", {"qt.LONG_ROWS": (1024, 4, 8, 8)}, *W8A8),
]
# M = 64
GEMM = [
    ("F.linear bf16", {}, "F.linear", "bf16", None),
    ("scaled_mm", {}, "scaled_mm", "fp8-channel", "fp8_token"),
    ("qgemm fp8 tok no split", {"qm.MAX_SPLIT": 1}, "qgemm", "fp8-channel", "fp8_token"),
    ("qgemm fp8 tok split", {}, "qgemm", "fp8-channel", "fp8_token"),
    ("qgemm fp8 tok split 4/SM", {"qm.SPLIT_PROGRAMS_PER_SM": 4}, "qgemm", "fp8-channel", "fp8_token"),
    ("qgemm fp8 tok split bn64", {"qm.MIN_BLOCK_N": 64}, "qgemm", "fp8-channel", "fp8_token"),
    (
        "qgemm fp8 tok split bn64 4/SM",
        {"qm.MIN_BLOCK_N": 64, "qm.SPLIT_PROGRAMS_PER_SM": 4},
        "qgemm",
        "fp8-channel",
        "fp8_token",
    ),
    (
        "qgemm fp8 tok split s6",
        {"qm.CONFIGS": ((16, 16, 64, 4, 5), (64, 64, 128, 4, 6), (1 << 62, 128, 128, 8, 3))},
        "qgemm",
        "fp8-channel",
        "fp8_token",
    ),
    ("qgemm fp8 grp split", {}, "qgemm", "fp8-block", "fp8_group128"),
    ("qgemm int8 tok split", {}, "qgemm", "int8-channel", "int8_token"),
]


def patched(patches: dict):
    """Set module constants (or class attributes) for one variant; returns the undo."""
    from engine.models.quant_linear import QuantLinear
    from kernels import (
        triton_decode_attention,
        triton_gemv,
        triton_norm,
        triton_qgemm,
        triton_qgemv,
        triton_qgemv_tiles,
        triton_qgemv_w8a8,
    )

    mods = {
        "qv": triton_qgemv,
        "qt": triton_qgemv_tiles,
        "qm": triton_qgemm,
        "w8": triton_qgemv_w8a8,
        "tg": triton_gemv,
        "tn": triton_norm,
        "da": triton_decode_attention,
        "QuantLinear": QuantLinear,
    }
    old = {}
    for key, value in patches.items():
        mod, name = key.split(".")
        old[key] = getattr(mods[mod], name)
        setattr(mods[mod], name, value)
    return lambda: [setattr(mods[k.split(".")[0]], k.split(".")[1], v) for k, v in old.items()]


def sweep(n: int, k: int, m: int, variants: list, env: dict, reps: int) -> list[dict]:
    import torch

    g = torch.Generator("cuda").manual_seed(n + k)
    w32 = torch.randn(n, k, generator=g, device="cuda") * k**-0.5
    x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
    formats = {"bf16": {"w": w32.to(torch.bfloat16)}}
    formats.update({f: quantise_weight(w32, f) for f in ("fp8-channel", "fp8-block", "int8-channel")})
    rows = []
    for label, patches, kind, fmt, act in variants:
        undo = patched(patches)
        try:
            weights = formats[fmt]
            wbytes = sum(t.numel() * t.element_size() for t in weights.values() if hasattr(t, "element_size"))
            copies = min(MAX_COPIES, max(2, math.ceil(L2_MULTIPLE * env["l2"] / wbytes)))
            sets = [weights] + [{key: t.clone() if hasattr(t, "clone") else t for key, t in weights.items()}
                                for _ in range(copies - 1)]  # fmt: skip
            us = 1e6 * time_calls([make_call(kind, s, x, act) for s in sets], reps, True)
            rows.append({"n": n, "k": k, "m": m, "label": label, "us": round(us, 2),
                         "pct_peak": round(100 * wbytes / (us * 1e-6) / env["peak"], 1)})  # fmt: skip
        except Exception as exc:  # a variant that fails to compile or launch is a row, not the end
            rows.append(
                {"n": n, "k": k, "m": m, "label": label, "error": f"{type(exc).__name__}: {exc}"[:120]}
            )
        finally:
            undo()
        print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama-3.1-8b")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", required=True)
    ap.add_argument("--m", default="1,64", help="batch sizes to sweep: 1 (GEMV variants), 64 (GEMM variants)")
    args = ap.parse_args(argv)
    from benchmarks.common import environment, write_report

    env = device_env(False)
    rows = []
    for model in args.models.split(","):
        for proj, (n, k) in SHAPES[model].items():
            for m in map(int, args.m.split(",")):
                variants = GEMV if m == 1 else GEMM
                found = sweep(n, k, m, variants, env, args.reps)
                rows += [{"model": model, "proj": proj, **r} for r in found]
    lines = ["| model | proj | M | variant | µs | % of peak |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['proj']} | {r['m']} | {r['label']} | {r.get('us', r.get('error'))} | "
              f"{r.get('pct_peak', '')} |" for r in rows]  # fmt: skip
    report = {
        "command": "python -m benchmarks.quant_sweep " + " ".join(argv or sys.argv[1:]),
        **environment(),
    }
    write_report(args.out, report | {"rows": rows}, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
