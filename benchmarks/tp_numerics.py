"""How much of tensor parallelism's top-1 disagreement is summation order alone: a CPU emulation.

    python -m benchmarks.tp_numerics --model CKPT --tokens 512 --prompts 8 --out PREFIX

A bf16 model scores fixed random sequences in one prefill each (teacher forcing). Only the row-parallel
projections (o_proj, down_proj), where tensor parallelism splits the sum over K, are computed another
way; every other layer is left as it is. Each variant's greedy token at every position is compared with
the plain model's:
  * tp1_fp32_gemm: one fp32 GEMM rounded once to bf16, i.e. another kernel for the same sum (as a decode
    step's GEMV and a batch's GEMM are);
  * tp1_split_k8: the sum as 8 fp32 partial sums added in order (a split-K kernel);
  * tpN_bf16: N partial sums, each rounded to bf16, added in fp32 (what TP=N does today);
  * tpN_fp32: N fp32 partial sums added, rounded once.
JSON plus a markdown table.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks.common import environment, write_report

VARIANTS = ("tp1", "tp1_fp32_gemm", "tp1_split_k8", "tp2_bf16", "tp2_fp32", "tp4_bf16", "tp4_fp32")


def row_parallel(x: torch.Tensor, w: torch.Tensor, variant: str) -> torch.Tensor:
    """x [T, K] @ w[N, K]^T in bf16, summed over K as `variant` says."""
    if variant == "tp1":
        return F.linear(x, w)
    if variant == "tp1_fp32_gemm":
        return F.linear(x.float(), w.float()).to(x.dtype)
    parts = 8 if variant == "tp1_split_k8" else int(variant[2])
    k = w.shape[1] // parts
    chunks = [(x[:, i * k : (i + 1) * k], w[:, i * k : (i + 1) * k]) for i in range(parts)]
    if variant.endswith("_bf16"):
        return sum(F.linear(a, b).float() for a, b in chunks).to(x.dtype)
    return sum(F.linear(a.float(), b.float()) for a, b in chunks).to(x.dtype)


def top1_all(model, sequences: list[torch.Tensor]) -> torch.Tensor:
    """The greedy token after every position of every sequence, one prefill each."""
    from engine.models.attention_context import AttentionMetadata, attention_context

    out = []
    with torch.inference_mode():
        for seq in sequences:
            with attention_context(AttentionMetadata.for_full_sequences([len(seq)])):
                out.append(model.compute_logits(model(seq, torch.arange(len(seq)))).float().argmax(-1))
    return torch.cat(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a checkpoint directory (bf16)")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--out", required=True, help="PREFIX for PREFIX.json and PREFIX.md")
    args = ap.parse_args(argv)
    from engine.models.loader import load_model

    model, cfg = load_model(args.model, dtype=torch.bfloat16, progress=False)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(8, cfg.vocab_size - 8, (args.tokens,), generator=gen) for _ in range(args.prompts)]
    variant = ["tp1"]
    for layer in model.model.layers:
        for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
            proj.forward = lambda x, w=proj.weight: row_parallel(x, w, variant[0])
    rows, ref = [], None
    for name in VARIANTS:
        variant[0] = name
        t0 = time.perf_counter()
        got = top1_all(model, seqs)
        ref = got if ref is None else ref
        rows.append({"variant": name, "agreement": (got == ref).float().mean().item(),
                     "seconds": round(time.perf_counter() - t0, 1)})  # fmt: skip
        print(f"{name:14s} {100 * rows[-1]['agreement']:6.2f}%", flush=True)
    command = "python -m benchmarks.tp_numerics " + " ".join(argv if argv is not None else sys.argv[1:])
    report = {"command": command, "env": environment(), "positions": args.tokens * args.prompts, "rows": rows}
    env = report["env"]
    lines = ["# Top-1 agreement with the plain bf16 model when only the row-parallel sums change", "",
             f"Command: `{command}`; {report['positions']} positions", "",
             f"CPU: {env['hardware'].get('cpu')}; torch {env['versions']['torch']}", "",
             "| variant | top-1 agreement |", "|---|---|"]  # fmt: skip
    lines += [f"| {r['variant']} | {100 * r['agreement']:.2f}% |" for r in rows]
    write_report(args.out, report, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
