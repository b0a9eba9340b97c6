"""Microbenchmark of the quantised linear kernels against bf16 and cuBLAS fp8, one projection at a time.

    python -m benchmarks.quant_bench --out benchmarks/reports/gpu/quant_bench_h100   # GPU: ~3 min
    python -m benchmarks.quant_bench --smoke --out /tmp/quant_bench                   # CPU: interpreter

For the Llama-3.1-8B and Llama-3.2-1B projections (qkv, o, gate_up, down) and each M in --ms: bf16
F.linear (cuBLAS), the bf16 GEMV at M = 1 (kernels.triton_gemv), kernels.triton_qgemv at M = 1 and
kernels.triton_qgemm at M > 1 for fp8 per-channel, fp8 128x128-block and int8 per-channel weights (every
act_quant that pairs with them), and torch._scaled_mm (fp8, row-wise scales; x quantised beforehand, M
padded to 16) as the cuBLAS fp8 reference. Weights come from one random fp32 matrix (std K^-1/2),
quantised as scripts/quant_formats.py writes checkpoints; x is random bf16.

Timing: each variant's calls go into one CUDA graph that cycles through enough weight copies to exceed
4x the L2 cache (so every call streams its weights from HBM); the graph is replayed --reps times between
CUDA events, and the median replay over the number of calls is reported (warm-up calls compile first).
GB/s counts the bytes a call must move at least: weights + scales + activations in + outputs; "% peak" is
that over the datasheet HBM bandwidth of the GPU (PEAK_BW; H100 SXM 3.35e12, H200 4.8e12 B/s).
"rel err" = max |y - ref| / max |ref| against an fp32 product of the unquantised x and the dequantised
weights, so a fast but wrong kernel shows (fp8 activations alone give ~1e-2, weight-only ~1e-3).
--smoke runs tiny shapes on the CPU under the Triton interpreter (timings meaningless; it checks that
every variant runs and the report is written).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

SHAPES = {  # model -> projection -> (N, K)
    "llama-3.1-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
    "llama-3.2-1b": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)},
}
SMOKE_SHAPES = {"tiny": {"qkv": (160, 192), "down": (64, 384)}}
PEAK_BW = {"H200": 4.8e12, "H100 PCIe": 2.0e12, "H100 NVL": 3.9e12, "H100": 3.35e12}  # B/s, datasheets
WEIGHT_FORMATS = {"fp8-channel": ["fp8_token"], "fp8-block": ["fp8_group128", "fp8_token"],
                  "int8-channel": ["int8_token"]}  # fmt: skip
L2_MULTIPLE = 4
MAX_COPIES = 64


HUB_FORMAT = {"fp8-channel": "fp8-channel", "fp8-block": "fp8-block", "int8-channel": "int8"}


def quantise_weight(w, fmt: str) -> dict:
    """fp32 [N, K] -> {"qweight", "scale", "row_block", "scheme"}: quantised as make_model writes the hub
    format (scripts/quant_formats.py), stored as the model's quantised linears hold it."""
    from engine.models.quant_linear import scale_row_blocks
    from scripts.quant_formats import BLOCK, quantize

    qweight, scale = quantize(HUB_FORMAT[fmt], w)
    if fmt == "fp8-block":
        row_block = scale_row_blocks([w.shape[0]], BLOCK).to(w.device)
        return {"qweight": qweight, "scale": scale, "row_block": row_block, "scheme": "block"}
    return {
        "qweight": qweight,
        "scale": scale.reshape(-1).contiguous(),
        "row_block": None,
        "scheme": "channel",
    }


def dequantised(wq: dict):
    from kernels.torch_ops import dequantize_weight

    return dequantize_weight(wq["qweight"], wq["scale"], wq["row_block"], wq["scheme"])


def variants(m: int, on_gpu: bool) -> list[tuple[str, str, str | None]]:
    """(kind, weight format, act_quant) for M rows: bf16 baselines, ours, cuBLAS fp8."""
    out = [("F.linear", "bf16", None)] + ([("gemv", "bf16", None)] if m == 1 else [])
    for fmt, acts in WEIGHT_FORMATS.items():
        out += [("qgemv", fmt, None)] if m == 1 else [("qgemm", fmt, a) for a in [None, *acts]]
    return out + ([("scaled_mm", "fp8-channel", "fp8_token")] if on_gpu else [])


def make_call(kind: str, weights: dict, x, act: str | None):
    """A zero-argument call of one variant on one weight copy."""
    import torch

    from kernels import triton_gemv, triton_qgemm, triton_qgemv

    if kind == "F.linear":
        return lambda: torch.nn.functional.linear(x, weights["w"])
    if kind == "gemv":
        return lambda: triton_gemv.gemv(x, weights["w"])
    args = (weights["qweight"], weights["scale"], weights["row_block"], None, weights["scheme"])
    if kind == "qgemv":
        return lambda: triton_qgemv.qgemv(x, *args, act_quant=act)
    if kind == "qgemm":
        return lambda: triton_qgemm.qgemm(x, *args, act)
    xq, sx = triton_qgemm.quantise_activations(x, act)  # scaled_mm: x quantised beforehand
    rows = max(16, -(-x.shape[0] // 16) * 16)  # cuBLAS fp8 wants M a multiple of 16
    xq = torch.nn.functional.pad(xq.view(torch.uint8), (0, 0, 0, rows - x.shape[0])).view(xq.dtype)
    sx = torch.nn.functional.pad(sx, (0, rows - x.shape[0]), value=1.0)[:, None]
    qt, sw = weights["qweight"].t(), weights["scale"][None, :]
    return lambda: torch._scaled_mm(xq, qt, scale_a=sx, scale_b=sw, out_dtype=x.dtype)


def _nbytes(weights: dict) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values() if hasattr(t, "element_size"))


def time_calls(calls: list, reps: int, on_gpu: bool) -> float:
    """Median seconds per call: all calls in one CUDA graph, replayed reps times (CPU: wall clock)."""
    import torch

    for call in calls[:2]:
        call()  # compile and warm up outside the capture
    if not on_gpu:
        t0 = time.perf_counter()
        for call in calls:
            call()
        return (time.perf_counter() - t0) / len(calls)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del graph
    return statistics.median(times) / len(calls)


def run_shape(n: int, k: int, m: int, args, env: dict) -> list[dict]:
    """Every variant of one projection at M rows: time, bytes, GB/s, % of peak, error vs fp32."""
    import torch

    dev, on_gpu = env["device"], env["device"] == "cuda"
    g = torch.Generator(dev).manual_seed(n * 31 + k)
    w32 = torch.randn(n, k, generator=g, device=dev) * k**-0.5
    x = torch.randn(m, k, generator=g, device=dev).to(env["dtype"])
    formats = {"bf16": {"w": w32.to(env["dtype"])}}
    formats.update({fmt: quantise_weight(w32, fmt) for fmt in WEIGHT_FORMATS})
    rows = []
    for kind, fmt, act in variants(m, on_gpu):
        weights = formats[fmt]
        ref = x.float() @ (dequantised(weights) if fmt != "bf16" else weights["w"].float()).T
        wbytes = _nbytes(weights)
        copies = 1 if not on_gpu else min(MAX_COPIES, max(2, math.ceil(L2_MULTIPLE * env["l2"] / wbytes)))
        sets = [weights] + [{key: t.clone() if hasattr(t, "clone") else t for key, t in weights.items()}
                            for _ in range(copies - 1)]  # fmt: skip
        try:
            err = float((make_call(kind, weights, x, act)().float() - ref).abs().max() / ref.abs().max())
            seconds = time_calls([make_call(kind, s, x, act) for s in sets], args.reps, on_gpu)
        except (RuntimeError, ValueError) as exc:  # e.g. no fp8 cuBLAS on this build
            rows.append({"n": n, "k": k, "m": m, "kind": kind, "weights": fmt, "act": act, "error": str(exc)})
            continue
        moved = wbytes + m * k * x.element_size() + m * n * x.element_size()
        rate = moved / seconds
        rows.append({"n": n, "k": k, "m": m, "kind": kind, "weights": fmt, "act": act, "us": seconds * 1e6,
                     "bytes": moved, "GBps": rate / 1e9, "pct_peak": 100 * rate / env["peak"],
                     "rel_err": err, "copies": copies})  # fmt: skip
        del sets
    return rows


def device_env(smoke: bool) -> dict:
    import torch

    if smoke or not torch.cuda.is_available():
        return {"device": "cpu", "dtype": torch.float32, "peak": float("nan"), "l2": 0, "gpu": None}
    props = torch.cuda.get_device_properties(0)
    peak = next((bw for name, bw in PEAK_BW.items() if name in props.name), float("nan"))
    return {"device": "cuda", "dtype": torch.bfloat16, "peak": peak, "l2": props.L2_cache_size,
            "gpu": props.name}  # fmt: skip


def table(rows: list[dict], peak: float) -> str:
    cols = ["model", "proj", "N", "K", "M", "kernel", "weights", "act", "µs", "GB/s",
            f"% of {peak / 1e12:.2f} TB/s", "vs bf16", "rel err"]  # fmt: skip
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    base = {(r["model"], r["proj"], r["m"]): r["us"] for r in rows if r["kind"] == "F.linear" and "us" in r}
    for r in rows:
        key = (r["model"], r["proj"], r["n"], r["k"], r["m"], r["kind"], r["weights"], r["act"] or "-")
        if "error" in r:
            lines.append("| " + " | ".join(map(str, key)) + f" | failed: {r['error'][:60]} | | | | |")
            continue
        speedup = base.get((r["model"], r["proj"], r["m"]), float("nan")) / r["us"]
        lines.append("| " + " | ".join(map(str, key)) + f" | {r['us']:.1f} | {r['GBps']:.0f} | "
                     f"{r['pct_peak']:.0f}% | {speedup:.2f}x | {r['rel_err']:.1e} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/reports/gpu/quant_bench", help="report prefix (.json, .md)")
    p.add_argument("--ms", default="1,64", help="comma-separated row counts M")
    p.add_argument("--models", default=",".join(SHAPES), help=f"subset of {','.join(SHAPES)}")
    p.add_argument("--reps", type=int, default=50, help="graph replays per variant (median)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under the Triton interpreter")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
    from benchmarks.common import environment, git_commit, write_report

    env = device_env(args.smoke)
    shapes = SMOKE_SHAPES if args.smoke else {m: SHAPES[m] for m in args.models.split(",")}
    rows = []
    for model, projections in shapes.items():
        for proj, (n, k) in projections.items():
            for m in (int(v) for v in args.ms.split(",")):
                rows += [{"model": model, "proj": proj, **r} for r in run_shape(n, k, m, args, env)]
                print(f"{model} {proj} M={m}: {len(rows)} rows", file=sys.stderr, flush=True)
    command = " ".join([Path(sys.executable).name, "-m", "benchmarks.quant_bench", *(argv or sys.argv[1:])])
    root = Path(__file__).resolve().parents[1]
    report = {"command": command, "commit": git_commit(root), **environment(), "peak_Bps": env["peak"],
              "gpu": env["gpu"], "reps": args.reps, "rows": rows}  # fmt: skip
    versions = report["versions"]
    header = (f"## Quantised linear kernels on {env['gpu'] or 'CPU (interpreter smoke)'}\n\n"
              f"- `{command}` at {report['commit']}; torch {versions['torch']}, triton {versions['triton']}\n"
              f"- median of {args.reps} CUDA-graph replays; weights rotated past {L2_MULTIPLE}x L2\n\n"
              )  # fmt: skip
    write_report(args.out, report, header + table(rows, env["peak"]))


if __name__ == "__main__":
    main()
