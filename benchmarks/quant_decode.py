"""Decode tok/s of quantised weights against bf16, end to end through the engine, each against its own
byte roofline, and the GPU memory its weights take.

    python -m benchmarks.quant_decode --models llama-3.1-8b,llama-3.2-1b --batches 1,64 --out PREFIX

Per model shape: the bf16 checkpoint (random weights, benchmarks.bench.make_checkpoint), the same
weights written in hub formats by scripts.make_model --quant (fp8-block: block-wise FP8 with
per-128-group activations; int8: compressed-tensors W8A8), and the bf16 checkpoint quantised at load
(`quantization="fp8"`: per-channel FP8, dynamic per-token activations). One engine at a time in this
process; greedy requests of `--prompt` random tokens and exactly `--gen` new tokens; tok/s over the
steps where every request decodes (benchmarks/engine_runs), median of `--reps` after a warm-up.

Roofline of a decode step: the bytes it must read (every weight it multiplies with, scales included,
plus every sequence's KV cache at the mean context) over the copy bandwidth measured in the same run
(benchmarks/roofline.measure_device).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import environment, git_commit, write_report
from benchmarks.roofline import measure_device, model_cost

ROOT = Path(__file__).resolve().parents[1]
FORMATS = ("bf16", "fp8-block", "fp8-channel", "int8")


def checkpoint(model: str, fmt: str, ckpt_dir: Path) -> tuple[Path, dict]:
    """(checkpoint dir, extra engine options) of one format; written once, then reused."""
    import torch

    from benchmarks.bench import make_checkpoint
    from scripts.make_model import make_model

    plain = ckpt_dir / model
    make_checkpoint(model, plain, smoke=False)
    if fmt == "bf16":
        return plain, {}
    if fmt == "fp8-channel":
        return plain, {"quantization": "fp8"}  # quantised at load
    path = ckpt_dir / f"{model}-{fmt}"
    if not (path / "config.json").exists():
        t0 = time.perf_counter()
        make_model(model, path, seed=0, device="cuda" if torch.cuda.is_available() else "cpu", quant=fmt)
        print(f"wrote {path} in {time.perf_counter() - t0:.0f} s", flush=True)
    return path, {}


def weight_bytes(model) -> tuple[int, int]:
    """(bytes of every weight, bytes a decode step reads: all but an untied embedding table)."""
    params = dict(model.named_parameters())
    total = sum(p.numel() * p.element_size() for p in params.values())
    total += sum(b.numel() * b.element_size() for n, b in model.named_buffers() if "row_block" in n)
    tied = not any("lm_head" in n for n in params)
    embed = next(p for n, p in params.items() if "embed_tokens" in n)
    return total, total - (0 if tied else embed.numel() * embed.element_size())


def decode_tok_s(llm, batch: int, prompt: int, gen: int, reps: int) -> list[float]:
    from benchmarks.engine_runs import decode_steps, trace
    from engine import SamplingParams

    vocab, rng = llm.engine.runner.model_config.vocab_size, random.Random(batch)
    sp = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
    runs = []
    for _ in range(reps + 1):  # the first is a warm-up
        prompts = [[rng.randrange(8, vocab - 8) for _ in range(prompt)] for _ in range(batch)]
        dec = decode_steps(trace(llm.engine, prompts, sp), batch)
        runs.append(batch * len(dec) / sum(s.seconds for s in dec))
    return runs[1:]


def measure(model: str, fmt: str, args, device: dict) -> list[dict]:
    import torch

    from engine import LLM

    path, opts = checkpoint(model, fmt, args.ckpt_dir)
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(str(path), max_num_seqs=max(batches), max_model_len=args.prompt + args.gen + 16, **opts)
    total, step = weight_bytes(llm.engine.runner.model)
    kv_per_token = model_cost(args.ckpt_dir / model).kv_bytes_per_token
    mean_ctx = args.prompt + args.gen / 2
    rows = []
    for batch in batches:
        runs = decode_tok_s(llm, batch, args.prompt, args.gen, args.reps)
        tok_s = statistics.median(runs)
        roof = batch / ((step + batch * mean_ctx * kv_per_token) / (device["copy_bw_GBps"] * 1e9))
        row = {"model": model, "format": fmt, "batch": batch, "tok_s": round(tok_s, 1), "runs": runs}
        row |= {"weight_GiB": round(total / 2**30, 3), "step_bytes": step, "roofline_tok_s": round(roof, 1)}
        print(row, flush=True)
        rows.append(row)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def markdown(report: dict) -> str:
    lines = [
        "# Quantised weights: decode tok/s against bf16 (same run)",
        "",
        f"Command: `{report['command']}`  ",
        f"Commit {report['commit']}; {report['environment']['hardware'].get('gpu')}; "
        f"copy bandwidth {report['device']['copy_bw_GBps']:.0f} GB/s; {report['environment']['versions']}",
        "",
        "| model | format | batch | weights GiB | tok/s | vs bf16 | roofline tok/s | % of roofline |",
        "|---|---|---|---|---|---|---|---|",
    ]
    base = {(r["model"], r["batch"]): r["tok_s"] for r in report["rows"] if r["format"] == "bf16"}
    for r in report["rows"]:
        ref = base.get((r["model"], r["batch"]))
        vs = f"{r['tok_s'] / ref:.2f}x" if ref else ""
        lines.append(
            f"| {r['model']} | {r['format']} | {r['batch']} | {r['weight_GiB']} | {r['tok_s']:,.1f} | {vs} | "
            f"{r['roofline_tok_s']:,.1f} | {r['tok_s'] / r['roofline_tok_s']:.0%} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama-3.1-8b,llama-3.2-1b")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ckpt-dir", type=Path, default=Path("/tmp/minserve_bench"))
    ap.add_argument("--out", required=True, help="PREFIX for PREFIX.json and PREFIX.md")
    args = ap.parse_args(argv)
    device = measure_device()
    report = {
        "command": "python -m benchmarks.quant_decode " + " ".join(sys.argv[1:] if argv is None else argv)
    }
    report |= {"commit": git_commit(ROOT), "environment": environment(), "device": device, "rows": []}
    for model in args.models.split(","):
        for fmt in args.formats.split(","):
            report["rows"] += measure(model, fmt, args, device)
            write_report(args.out, report, markdown(report))  # after each: a timeout keeps what ran
    return 0


if __name__ == "__main__":
    sys.exit(main())
