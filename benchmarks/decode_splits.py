"""The decode attention kernel's time per split count, for the head shapes tensor parallelism gives.

    python -m benchmarks.decode_splits --out benchmarks/reports/gpu/decode_splits_h100

A rank of a TP=P group holds Hkv / P KV heads, so at the same batch its grid has 1 / P of TP=1's
programs, and kernels.triton_decode_attention.choose_num_splits picks its split count from that grid.
This times one layer's decode attention (bf16 cache, block size 16, one graph replay per timing) at
every split count up to 16, for each (batch, query heads, KV heads, context) case, and reports the
fastest count beside the rule's. Writes JSON and a markdown table.

    python -m benchmarks.decode_splits --configs --out benchmarks/reports/gpu/decode_configs_h100

With --configs it times, for the 8B shape's batch-64 cases at TP=1 and 2, every (BLOCK_N, num_warps,
num_stages) of a small grid at the split counts around the rule's, against decode_config's choice (the
first row of each case).
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


CONFIGS = [(bn, w, st) for bn in (32, 64, 128) for w in (2, 4, 8) for st in (2, 3, 4)]


def time_case(batch: int, hq: int, hk: int, ctx: int, splits: list[int], config=None) -> dict[int, float]:
    """Microseconds of one decode_attention call per split count (median of graph replays); `config`
    (BLOCK_N, num_warps, num_stages) in place of decode_config's."""
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
            decode_attention(q, k_cache, v_cache, tables, lens, 0.088, num_splits=s, out=out, config=config)

        call()
        times[s] = 1e3 * triton.testing.do_bench_cudagraph(call, rep=60)
    return times


def sweep_configs(out: str) -> int:
    """Every config of CONFIGS at splits 1..4 (and the rule's) for the batch-64, 1k-context cases of
    the 8B shape at TP=1 and TP=2."""
    from kernels.triton_decode_attention import _sm_count, choose_num_splits, decode_config

    sms, rows = _sm_count(torch.device("cuda")), []
    default = decode_config(128)
    for label, batch, hq, hk, ctx in [c for c in CASES if c[1] == 64 and c[4] == 1000 and c[3] >= 4]:
        for config in [default] + [c for c in CONFIGS if c != default]:
            rule = choose_num_splits(batch, hk, -(-ctx // BLOCK), BLOCK, config[0], sms)
            try:
                times = time_case(batch, hq, hk, ctx, sorted({1, 2, 3, 4, rule}), config)
            except Exception as e:  # a config past the shared-memory limit
                print(f"{label} {config}: {type(e).__name__}", flush=True)
                continue
            best = min(times, key=times.get)
            rows.append({"label": label, "batch": batch, "q_heads": hq, "kv_heads": hk, "context": ctx,
                         "config": config, "us": times, "rule": rule, "best": best})  # fmt: skip
            print(f"{label} {config}: rule {rule} {times[rule]:.1f}, best {best} {times[best]:.1f}")
    lines = [
        "# Decode attention: microseconds per layer by (BLOCK_N, num_warps, num_stages) and split count",
        "",
        f"{torch.cuda.get_device_name()} ({sms} SMs), torch {torch.__version__}; bf16 cache, block {BLOCK}, "
        f"head_dim 128, context 1000. Command: `python -m benchmarks.decode_splits --configs --out {out}`",
        "",
        "| case | config | 1 | 2 | 3 | 4 | rule | at rule | best |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = " | ".join(f"{r['us'].get(s, float('nan')):.1f}" for s in (1, 2, 3, 4))
        lines.append(f"| {r['label']} b{r['batch']} | {r['config']} | {cells} | {r['rule']} | "
                     f"{r['us'][r['rule']]:.1f} | {r['best']} |")  # fmt: skip
    write_report(out, {"env": environment(), "sm_count": sms, "rows": rows}, "\n".join(lines) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="decode_splits", help="report stem (.json and .md)")
    parser.add_argument("--configs", action="store_true", help="sweep the kernel's tile configs instead")
    args = parser.parse_args(argv)
    from kernels.triton_decode_attention import _sm_count, choose_num_splits, decode_config

    if not torch.cuda.is_available():
        print("decode_splits needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.configs:
        return sweep_configs(args.out)
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
