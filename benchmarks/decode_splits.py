"""The decode attention kernel's time per split count, for the head shapes tensor parallelism gives.

    python -m benchmarks.decode_splits --out benchmarks/reports/gpu/decode_splits_h100

A rank of a TP=P group holds Hkv / P KV heads, so at the same batch its grid has 1 / P of TP=1's
programs, and kernels.triton_decode_attention.choose_num_splits picks its split count from that grid.
This times one layer's decode attention (bf16 cache, block size 16, one graph replay per timing) at
every split count up to 16, for each (batch, query heads, KV heads, context) case, and reports the
fastest count beside the rule's. Writes JSON and a markdown table.
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.common import environment, write_report

CASES = [  # (label, batch, q heads, kv heads, context)
    ("8B TP=1", 64, 32, 8, 1000),
    ("8B TP=2", 64, 16, 4, 1000),
    ("8B TP=4", 64, 8, 2, 1000),
    ("8B TP=1", 32, 32, 8, 1000),
    ("8B TP=2", 32, 16, 4, 1000),
    ("8B TP=1", 16, 32, 8, 1000),
    ("8B TP=2", 16, 16, 4, 1000),
    ("8B TP=1", 128, 32, 8, 1000),
    ("8B TP=2", 128, 16, 4, 1000),
    ("70B TP=4", 64, 16, 2, 1000),
    ("8B TP=2", 64, 16, 4, 4000),
]
SPLITS = [1, 2, 3, 4, 5, 6, 8, 12, 16]
BLOCK = 16


def time_case(batch: int, hq: int, hk: int, ctx: int, splits: list[int]) -> dict[int, float]:
    """Microseconds of one decode_attention call per split count (median of graph replays)."""
    import triton.testing

    from kernels.triton_decode_attention import decode_attention

    dev, dt = torch.device("cuda"), torch.bfloat16
    blocks = -(-ctx // BLOCK)
    k_cache = torch.randn(batch * blocks + 1, BLOCK, hk, 128, device=dev, dtype=dt)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(batch * blocks, device=dev) + 1  # scattered blocks, as a busy pool has
    tables = perm.view(batch, blocks).to(torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(batch, hq, 128, device=dev, dtype=dt)
    out = torch.empty_like(q)
    times = {}
    for s in splits:

        def call(s=s):
            decode_attention(q, k_cache, v_cache, tables, lens, 0.088, num_splits=s, out=out)

        call()
        times[s] = 1e3 * triton.testing.do_bench_cudagraph(call, rep=60)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="decode_splits", help="report stem (.json and .md)")
    args = parser.parse_args(argv)
    from kernels.triton_decode_attention import _sm_count, choose_num_splits, decode_config

    if not torch.cuda.is_available():
        print("decode_splits needs a CUDA GPU", file=sys.stderr)
        return 2
    sms = _sm_count(torch.device("cuda"))
    block_n = decode_config(128)[0]
    rows = []
    for label, batch, hq, hk, ctx in CASES:
        blocks = -(-ctx // BLOCK)
        splits = [s for s in SPLITS if s <= -(-ctx // block_n)]
        times = time_case(batch, hq, hk, ctx, splits)
        rule = choose_num_splits(batch, hk, blocks, BLOCK, block_n, sms)
        best = min(times, key=times.get)
        kv_bytes = batch * ctx * hk * 128 * 2 * 2
        rows.append({"label": label, "batch": batch, "q_heads": hq, "kv_heads": hk, "context": ctx,
                     "us": times, "rule": rule, "best": best, "kv_bytes": kv_bytes})  # fmt: skip
        print(f"{label} b{batch} ctx {ctx}: rule {rule} {times.get(rule, float('nan')):.1f} us, "
              f"best {best} {times[best]:.1f} us", flush=True)  # fmt: skip
    splits = " | ".join(f"{s}" for s in SPLITS)
    head = f"| case | batch | Hq/Hkv | ctx | {splits} | rule | best | GB/s at best |"
    lines = [
        "# Decode attention: microseconds per layer by split count",
        "",
        f"{torch.cuda.get_device_name()} ({sms} SMs), torch {torch.__version__}; bf16 cache, block {BLOCK}, "
        "head_dim 128, one graph replay per timing.",
        f"Command: `python -m benchmarks.decode_splits --out {args.out}`",
        "",
        head,
        "|" + "---|" * (len(SPLITS) + 7),
    ]
    for r in rows:
        cells = [f"{r['us'][s]:.1f}" if s in r["us"] else "" for s in SPLITS]
        gbs = r["kv_bytes"] / r["us"][r["best"]] / 1e3
        lines.append(f"| {r['label']} | {r['batch']} | {r['q_heads']}/{r['kv_heads']} | {r['context']} | "
                     + " | ".join(cells) + f" | {r['rule']} | {r['best']} | {gbs:.0f} |")  # fmt: skip
    write_report(args.out, {"env": environment(), "sm_count": sms, "rows": rows}, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
