"""Multi-LoRA decode tok/s against the base model, in the same run (issue 48).

    python -m benchmarks.lora_bench --model llama-3.1-8b --out benchmarks/reports/gpu/lora_bench_8b

One engine at a time (each freed before the next): the base model without LoRA; LoRA with
max_loras 8 and max_lora_rank 16; LoRA with max_lora_rank 64. Adapters are random (scripts.make_lora,
all seven modules, bf16; B not zero), written once under --ckpt-dir. Rows:
  * base: batch 1 and batch --batch (64);
  * rank 16: batch 1 with one adapter; batch 64 with no adapter (every row the base: what enabling LoRA
    costs), one adapter on every row, and each row a random one of 8 adapters;
  * rank 64: the same batch-1 and 8-adapter rows, for what a rank-64 adapter costs.
tok/s counts the tokens emitted after every request's first token, until the first request finishes
(the batch stays full), over those steps' wall time (benchmarks/spec_bench.steady_tok_s); median of
--reps after a warm-up. Greedy requests of --prompt random tokens and exactly --gen new tokens. The
issue's bars: 8 adapters at batch 64 >= 80% of the base, one adapter at batch 1 >= 85%. JSON plus a
markdown table.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import ckpt_path, environment, git_commit, write_report

ROOT = Path(__file__).resolve().parents[1]


def steady_tok_s(engine, prompts: list[list[int]], params, loras: list) -> float:
    """Tokens per second while every request decodes (after all first tokens, before any finishes)."""
    ids = {engine.add_request(p, params, lora_request=lora) for p, lora in zip(prompts, loras, strict=True)}
    started: set[str] = set()
    tokens, seconds, prev = 0, 0.0, time.perf_counter()
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        if any(d.error for o in outs for d in o.outputs):
            raise RuntimeError(f"a request failed: {[d.error for o in outs for d in o.outputs if d.error]}")
        if len(started) == len(ids) and not any(o.finished for o in outs):
            tokens += sum(len(d.token_ids) for o in outs for d in o.outputs)
            seconds += now - prev
        started |= {o.request_id for o in outs if any(d.token_ids for d in o.outputs)}
        prev = now
    return tokens / seconds if seconds else 0.0


def measure(llm, batch: int, pick, args) -> dict:
    """tok/s of `batch` requests, request i with adapter pick(rng) (None: the base model)."""
    from engine import SamplingParams

    vocab, rng = llm.engine.runner.model_config.vocab_size, random.Random(batch)
    sp = SamplingParams(max_tokens=args.gen, temperature=0.0, ignore_eos=True)
    runs = []
    for _ in range(args.reps + 1):  # the first is a warm-up
        prompts = [[rng.randrange(8, vocab - 8) for _ in range(args.prompt)] for _ in range(batch)]
        runs.append(steady_tok_s(llm.engine, prompts, sp, [pick(rng) for _ in range(batch)]))
    return {"tok_s": round(statistics.median(runs[1:]), 1), "runs": [round(r, 1) for r in runs[1:]]}


def adapters(model_dir: Path, rank: int, count: int, root: Path) -> list:
    from engine import LoRARequest
    from scripts.make_lora import make_lora

    out = []
    for i in range(count):
        path = root / f"{model_dir.name}-r{rank}-{i}"
        if not (path / "adapter_model.safetensors").exists():
            make_lora(model_dir, path, rank=rank, alpha=2 * rank, targets="all", seed=i, dtype="bf16")
        out.append(LoRARequest(f"r{rank}-{i}", 1000 * rank + i + 1, str(path)))
    return out


def engine_rows(args, label: str, options: dict, cases: list) -> list[dict]:
    """Build one engine, measure each (name, batch, pick) case, free the engine."""
    from engine import LLM

    opts = {"max_num_seqs": max(args.batch, 8), "max_model_len": args.prompt + args.gen + 32, **options}
    llm = LLM(str(args.model_dir), **opts)
    rows = [{"engine": label, "case": name, "batch": batch, **measure(llm, batch, pick, args)}
            for name, batch, pick in cases]  # fmt: skip
    llm.engine.runner.shutdown()
    del llm
    gc.collect()
    _empty_cache()
    return rows


def _empty_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def plan(args) -> list[tuple[str, dict, list]]:
    root = args.ckpt_dir / "loras"
    r16, r64 = adapters(args.model_dir, 16, 8, root), adapters(args.model_dir, 64, 8, root)
    b = args.batch
    return [
        ("base", {}, [("base", 1, lambda r: None), ("base", b, lambda r: None)]),
        ("lora r16", {"enable_lora": True, "max_loras": 8, "max_lora_rank": 16}, [
            ("1 adapter", 1, lambda r: r16[0]), ("0 adapters", b, lambda r: None),
            ("1 adapter", b, lambda r: r16[0]), ("8 adapters", b, lambda r: r.choice(r16)),
        ]),
        ("lora r64", {"enable_lora": True, "max_loras": 8, "max_lora_rank": 64}, [
            ("1 adapter", 1, lambda r: r64[0]), ("8 adapters", b, lambda r: r.choice(r64)),
        ]),
    ]  # fmt: skip


def markdown(report: dict) -> str:
    base = {r["batch"]: r["tok_s"] for r in report["rows"] if r["engine"] == "base"}
    sizes = f"prompt {report['prompt']}, gen {report['gen']}"
    gpu = report["environment"]["hardware"].get("gpu", "CPU")
    lines = [f"# Multi-LoRA decode ({report['model']}, {gpu})", "",
             f"`{report['command']}` (commit {report['commit']}); {sizes}.",
             "", "| engine | case | batch | tok/s | of the base |", "|---|---|---|---|---|"]  # fmt: skip
    for r in report["rows"]:
        share = f"{100 * r['tok_s'] / base[r['batch']]:.0f}%" if base.get(r["batch"]) else ""
        lines.append(f"| {r['engine']} | {r['case']} | {r['batch']} | {r['tok_s']} | {share} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ckpt-dir", type=Path, default=Path("/tmp/minserve_bench"))
    ap.add_argument("--smoke", action="store_true", help="the tiny stand-in of the shape (a CPU check)")
    ap.add_argument("--out", required=True, help="PREFIX for PREFIX.json and PREFIX.md")
    args = ap.parse_args(argv)
    from benchmarks.bench import make_checkpoint

    args.model_dir = ckpt_path(args.ckpt_dir, args.model, args.smoke)
    make_checkpoint(args.model, args.model_dir, smoke=args.smoke)
    command = "python -m benchmarks.lora_bench " + " ".join(sys.argv[1:] if argv is None else argv)
    report = {"command": command, "commit": git_commit(ROOT), "environment": environment(),
              "model": args.model, "prompt": args.prompt, "gen": args.gen, "rows": []}  # fmt: skip
    for label, options, cases in plan(args):
        report["rows"] += engine_rows(args, label, options, cases)
        write_report(args.out, report, markdown(report))  # after each: a timeout keeps what ran
    return 0


if __name__ == "__main__":
    sys.exit(main())
