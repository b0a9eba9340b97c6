"""The prefill attention kernel alone, by layout and tile config: microseconds and TFLOP/s per call.

    python -m benchmarks.prefill_kernel --out DIR      # GPU host

Each case is one layer's attention for a model shape (query heads, KV heads, head_dim) over a paged
bf16 cache with scattered blocks: either a mixed step (D one-query sequences at context C beside one
chunk of P queries after C cached tokens; the flat grid a mixed CUDA graph replays, D sequences left to
the decode kernel and not timed) or a prefill step (S prompts of P tokens, nothing cached). Variants
flip kernels.triton_prefill_attention's PACK_GQA (a program per KV head's group of query heads) and
SPLIT_CAUSAL (an unmasked loop over the keys every row sees), and try tile configs. FLOPs count the
causal work only (4 * queries * visible keys * head_dim per head). Writes OUT/prefill_kernel.{json,md}.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.common import environment, write_json

SHAPES = {"1b": (32, 8, 64), "8b": (32, 8, 128), "0.6b": (16, 8, 128)}
# (label, shape, kind, D decodes or S prompts, context C, queries P)
CASES = [
    ("1B mixed 64@512 + 256", "1b", "mixed", 64, 512, 256),
    ("1B mixed 64@600 + 1024", "1b", "mixed", 64, 600, 1024),
    ("1B mixed 60@600 + 1988", "1b", "mixed", 60, 600, 1988),
    ("8B mixed 63@1000 + 512 after 1536", "8b", "mixed", 63, 1536, 512),
    ("0.6B prefill 32 x 512", "0.6b", "prefill", 32, 0, 512),
    ("1B prefill 4 x 512", "1b", "prefill", 4, 0, 512),
]
# (name, PACK_GQA, SPLIT_CAUSAL, tiles by busy waves)
VARIANTS = [("old: per head, masked", False, False, False), ("packed", True, False, False),
            ("split", False, True, False), ("packed + split", True, True, False),
            ("packed + split, tiles by waves (default)", True, True, True)]  # fmt: skip
DEVICE = "cuda"
CONFIGS = [(64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 32, 4, 3), (128, 64, 4, 4), (64, 32, 4, 2)]


def build(shape: str, kind: str, n: int, ctx: int, p: int, page: int = 16):
    """(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, max_q, flops) on the GPU."""
    import torch

    hq, hk, dim = SHAPES[shape]
    q_lens = [1] * n + [p] if kind == "mixed" else [p] * n
    ctxs = [ctx] * len(q_lens) if kind == "mixed" else [0] * n
    seq_lens = [c + q for c, q in zip(ctxs, q_lens)]
    width = -(-max(seq_lens) // page)
    blocks = sum(-(-s // page) for s in seq_lens) + 8
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(blocks, generator=g)
    tables, used = torch.zeros(len(seq_lens), width, dtype=torch.int32), 0
    for i, s in enumerate(seq_lens):
        nb = -(-s // page)
        tables[i, :nb] = perm[used : used + nb]
        used += nb
    cu = torch.tensor([0] + [sum(q_lens[: i + 1]) for i in range(len(q_lens))], dtype=torch.int32)
    kv = [torch.randn(blocks, page, hk, dim, dtype=torch.bfloat16, device=DEVICE) for _ in range(2)]
    q = torch.randn(sum(q_lens), hq, dim, dtype=torch.bfloat16, device=DEVICE)
    heavy = [(c, q_len) for c, q_len in zip(ctxs, q_lens) if kind == "prefill" or q_len > 1]
    flops = sum(4 * hq * dim * (q_len * c + q_len * (q_len + 1) // 2) for c, q_len in heavy)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return q, *kv, cu.to(DEVICE), lens, tables.to(DEVICE), max(q_lens), flops


def time_us(fn, reps: int, warm_s: float = 0.2) -> float:
    """Mean device time per call over `reps` back-to-back calls, after calling fn for warm_s seconds:
    a call of under 100 us timed after one warm-up call varied up to 2x between device calls (clocks
    and caches still settling)."""
    import time

    import torch

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < warm_s:
        fn()
        torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / reps


def run_case(case, reps: int) -> list[dict]:
    """Every variant (default tiles) and every tile config (packed + split) of one case."""
    import torch

    from kernels import triton_prefill_attention as pre

    label, shape, kind, n, ctx, p = case
    q, kc, vc, cu, lens, tables, max_q, flops = build(shape, kind, n, ctx, p)
    scale, mixed, rows, ref = q.shape[-1] ** -0.5, kind == "mixed", [], None
    runs = [(name, pack, split, rule, None) for name, pack, split, rule in VARIANTS]
    runs += [(f"packed + split {c}", True, True, False, c) for c in CONFIGS]
    for name, pack, split, rule, config in runs:
        pre.PACK_GQA, pre.SPLIT_CAUSAL = pack, split
        saved, saved_waves = pre.prefill_config, pre.busy_waves
        if not rule:
            pre.busy_waves = lambda *a: None
        if config is not None:
            pre.prefill_config = lambda *a, _c=config, **kw: _c
        out = torch.zeros_like(q)

        def call(out=out):
            pre.prefill_attention(q, kc, vc, cu, lens, None if mixed else max_q, scale, block_tables=tables,
                                  out=out, mixed=mixed)  # fmt: skip

        try:
            us = time_us(call, reps)
        finally:
            pre.prefill_config, pre.busy_waves = saved, saved_waves
        heavy = out[n:] if mixed else out
        ref = heavy.float() if ref is None else ref
        err = (heavy.float() - ref).abs().max().item()
        rows.append({"case": label, "variant": name, "us": us, "tflops": flops / us / 1e6, "max_diff": err})
    pre.PACK_GQA, pre.SPLIT_CAUSAL = True, True
    return rows


def to_markdown(rows: list[dict], env: dict, command: str) -> str:
    lines = ["# Prefill attention kernel alone, by layout and tiles", "",
             f"{env['hardware'].get('gpu')}; torch {env['versions']['torch']}; "
             f"triton {env['versions']['triton']}.", "", f"`{command}`", "",
             "Tile configs are (BLOCK_M rows, BLOCK_N, warps, stages); max diff is against the first row "
             "of the case (the old layout).", "",
             "| case | variant | us / call | TFLOP/s | max diff |", "|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['case']} | {r['variant']} | {r['us']:,.1f} | {r['tflops']:,.1f} | "
                     f"{r['max_diff']:.1e} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=100)
    p.add_argument("--out", default="benchmarks/reports/gpu")
    args = p.parse_args()
    rows = []
    for case in CASES:
        rows += run_case(case, args.reps)
    env = environment()
    command = f"python -m benchmarks.prefill_kernel --reps {args.reps} --out {args.out}"
    md = to_markdown(rows, env, command)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "prefill_kernel.json", {"rows": rows, "env": env, "command": command})
    (out / "prefill_kernel.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
