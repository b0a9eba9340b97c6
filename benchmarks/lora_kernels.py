"""Microbenchmark of the batched multi-LoRA kernels against the base layer, one projection at a time.

    python -m benchmarks.lora_kernels --out benchmarks/reports/gpu/lora_kernels.json   # GPU only

For the Llama-3.1-8B projections (fused qkv 4096 -> 4096+1024+1024, gate|up 4096 -> 2 x 14336,
o 4096 -> 4096, down 14336 -> 4096), each T in --tokens and rank in --ranks, with --slots adapter slots
(bf16, every slot filled): the base layer as the model runs it (kernels.ops.linear: the Triton GEMV at
T = 1, cuBLAS above), kernels.triton_lora's shrink and expand alone and together (one shrink + one
expand launch per layer, every slice in the expand), and the mapping, which a step builds once for all
layers. At T = 1 the row uses slot 0; at T > 1 each row takes a random slot (seeded).

Timing as benchmarks.quant_bench.time_calls: each variant's calls go into one CUDA graph that cycles
through enough weight copies to exceed 4x the L2 cache (so weights stream from HBM, as in a real step
where 32 layers' weights pass through L2), replayed --reps times; the median per call is reported.
"LoRA GB/s" counts the adapter bytes the kernels must read (A and B of the slots in use) plus x, s and
y traffic. Writes the rows as JSON to --out and the markdown table next to it (.md) and on stdout.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

SHAPES = {"qkv": (4096, (4096, 1024, 1024)), "gate_up": (4096, (14336, 14336)), "o": (4096, (4096,)),
          "down": (14336, (4096,))}  # fmt: skip  # proj -> (K, slice widths)
L2_MULTIPLE = 4
MAX_COPIES = 64


def _offsets(widths) -> list[int]:
    out = [0]
    for w in widths:
        out.append(out[-1] + w)
    return out


def _copies(nbytes: int, l2: int) -> int:
    return min(MAX_COPIES, max(2, math.ceil(L2_MULTIPLE * l2 / nbytes)))


def _slots(t: int, num_slots: int):
    import torch

    if t == 1:
        return torch.zeros(1, dtype=torch.int32, device="cuda")
    g = torch.Generator().manual_seed(t)
    return torch.randint(0, num_slots, (t,), generator=g, dtype=torch.int32).cuda()


def run_case(proj: str, t: int, rank: int, args, l2: int) -> dict:
    """Base layer, shrink, expand, shrink+expand at T rows and this rank: median µs of each."""
    import torch

    from benchmarks.quant_bench import time_calls
    from kernels import ops, triton_lora

    k, widths = SHAPES[proj]
    off, n = _offsets(widths), sum(widths)
    bf16 = dict(dtype=torch.bfloat16, device="cuda")
    x, y = torch.randn(t, k, **bf16), torch.zeros(t, n, **bf16)
    w = torch.randn(n, k, **bf16) * k**-0.5
    a = torch.randn(args.slots, len(widths) * rank, k, **bf16) * k**-0.5
    b = torch.randn(args.slots, n, rank, **bf16) * rank**-0.5
    m = ops.lora_mapping(_slots(t, args.slots), args.slots)
    s = triton_lora.lora_shrink(x, a, m)
    ws = [w] + [w.clone() for _ in range(_copies(w.numel() * 2, l2) - 1)]
    lora_bytes = (a.numel() + b.numel()) * 2
    ab = [(a, b)] + [(a.clone(), b.clone()) for _ in range(_copies(lora_bytes, l2) - 1)]

    def both(a_i, b_i):
        return lambda: triton_lora.lora_expand(y, triton_lora.lora_shrink(x, a_i, m), b_i, m, off)

    calls = {
        "base": [lambda w_i=w_i: ops.linear(x, w_i) for w_i in ws],
        "shrink": [lambda a_i=a_i: triton_lora.lora_shrink(x, a_i, m) for a_i, _ in ab],
        "expand": [lambda b_i=b_i: triton_lora.lora_expand(y, s, b_i, m, off) for _, b_i in ab],
        "lora": [both(a_i, b_i) for a_i, b_i in ab],
    }
    us = {key: time_calls(fns, args.reps, True) for key, fns in calls.items()}
    used = min(t, args.slots)  # slots holding at least one row (all of them, with high probability)
    moved = lora_bytes * used // args.slots + t * (k + 2 * n) * 2 + t * len(widths) * rank * 4 * 2
    row = {"proj": proj, "n": n, "k": k, "t": t, "rank": rank, "slots": args.slots}
    row.update({f"{key}_us": sec * 1e6 for key, sec in us.items()})
    row["lora_over_base"] = us["lora"] / us["base"]
    row["lora_GBps"] = moved / us["lora"] / 1e9
    return row


def mapping_us(t: int, args) -> float:
    from benchmarks.quant_bench import time_calls
    from kernels import ops

    slots = _slots(t, args.slots)
    return 1e6 * time_calls([lambda: ops.lora_mapping(slots, args.slots)] * 8, args.reps, True)


def table(rows: list[dict], maps: dict[int, float]) -> str:
    cols = ["proj", "N", "K", "T", "rank", "base µs", "shrink µs", "expand µs", "LoRA µs", "LoRA/base",
            "LoRA GB/s"]  # fmt: skip
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append(f"| {r['proj']} | {r['n']} | {r['k']} | {r['t']} | {r['rank']} | {r['base_us']:.1f} | "
                     f"{r['shrink_us']:.1f} | {r['expand_us']:.1f} | {r['lora_us']:.1f} | "
                     f"{100 * r['lora_over_base']:.0f}% | {r['lora_GBps']:.0f} |")  # fmt: skip
    lines.append("")
    lines.append("lora_mapping (once per step, all layers): " + ", ".join(
        f"T={t}: {us:.1f} µs" for t, us in maps.items()))  # fmt: skip
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/reports/gpu/lora_kernels.json", help="JSON path (.md beside)")
    p.add_argument("--tokens", default="1,64", help="comma-separated row counts T")
    p.add_argument("--ranks", default="16,64", help="comma-separated max_lora_rank values")
    p.add_argument("--slots", type=int, default=8, help="adapter slots (max_loras)")
    p.add_argument("--projs", default=",".join(SHAPES), help=f"subset of {','.join(SHAPES)}")
    p.add_argument("--reps", type=int, default=50, help="graph replays per variant (median)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(
            "benchmarks.lora_kernels needs a CUDA GPU (CPU checks: tests/test_kernels_lora.py)",
            file=sys.stderr,
        )
        return 2
    from benchmarks.common import environment, git_commit, write_json

    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    tokens = [int(v) for v in args.tokens.split(",")]
    rows = [run_case(proj, t, rank, args, l2) for t in tokens for rank in map(int, args.ranks.split(","))
            for proj in args.projs.split(",")]  # fmt: skip
    maps = {t: mapping_us(t, args) for t in tokens}
    text = table(rows, maps)
    out = Path(args.out)
    root = Path(__file__).resolve().parents[1]
    report = {"rows": rows, "mapping_us": maps, "env": environment(), "commit": git_commit(root)}
    write_json(out, report)
    out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
