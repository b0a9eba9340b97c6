"""Preemption with the host KV tier off and on: what preempted sequences recompute (docs/kv_offload.md).

    python -m benchmarks.kv_offload_preempt                  # GPU host: Llama-3.2-1B shape
    python -m benchmarks.kv_offload_preempt --smoke          # CPU: the tiny model, seconds

The same requests (random prompts, no shared prefix; ignore_eos, so every request generates its
max_tokens) run offline through LLMEngine on a pool too small for them all, so the scheduler preempts.
A preempted sequence's full blocks go back to the prefix cache; with the tier on, those evicted before
it returns come back from host memory by hash instead of being recomputed (the engine has no separate
swap path: the decision and its reason are in docs/kv_offload.md). Per variant: preemptions, tokens
computed (every scheduled chunk) against the work without any preemption (prompts + outputs),
host-tier hits, and wall time. Writes OUT/kv_offload_preempt_<cpu|cuda>.{json,md}.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

from benchmarks.common import write_report
from benchmarks.serve_stack import ROOT


def run(args, gib: float) -> dict:
    import torch

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = LLMEngine(EngineConfig.from_kwargs(
        str(args.ckpt), device=device, num_blocks=args.num_blocks, block_size=16, kv_offloading_size=gib,
        max_num_seqs=args.requests, max_num_batched_tokens=args.batch_tokens, grammar_process=False,
    ))  # fmt: skip
    computed = [0]
    execute = engine.runner.execute

    def counted(out, prev=None):
        computed[0] += out.num_batched_tokens
        return execute(out, prev)

    engine.runner.execute = counted
    rng = random.Random(args.seed)
    vocab = engine.runner.model_config.vocab_size
    params = SamplingParams(max_tokens=args.gen, ignore_eos=True, temperature=0)
    for i in range(args.requests):
        engine.add_request([rng.randrange(8, vocab) for _ in range(args.prompt)], params, f"r{i}")
    began = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    seconds = time.perf_counter() - began
    stats = engine.get_stats()
    ideal = args.requests * (args.prompt + args.gen - 1)  # the last output token is sampled, not computed
    return {"tier_gib": gib, "seconds": seconds, "computed_tokens": computed[0], "ideal_tokens": ideal,
            "recomputed_tokens": computed[0] - ideal, "num_preemptions": stats["num_preemptions"],
            "kv_host_hit_blocks": stats.get("kv_host_hit_blocks", 0),
            "kv_reload_blocks": stats.get("kv_reload_blocks", 0), "audit": engine.audit()}  # fmt: skip


def markdown(report: dict) -> str:
    s = report["settings"]
    ratio = s["requests"] * (s["prompt"] + s["gen"]) / 16 / s["num_blocks"]
    lines = [
        f"# Preemption with the host KV tier off and on ({report['device']})",
        "",
        f"`python -m benchmarks.kv_offload_preempt {report['argv']}`".replace(" `", "`"),
        "",
        f"{s['requests']} requests of {s['prompt']} prompt + {s['gen']} output tokens on "
        f"{s['num_blocks']} blocks of 16 tokens (the requests' KV: {ratio:.1f}x the pool).",
        "",
        "| tier GiB | preemptions | tokens computed | recomputed (beyond prompts + outputs) "
        "| recomputed per preemption | host-tier blocks reloaded | seconds |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        per = r["recomputed_tokens"] / r["num_preemptions"] if r["num_preemptions"] else 0.0
        lines.append(
            f"| {r['tier_gib']} | {r['num_preemptions']} | {r['computed_tokens']} "
            f"| {r['recomputed_tokens']} | {per:.1f} | {r['kv_reload_blocks']} | {r['seconds']:.1f} |"
        )
    clean = all(not r["audit"] for r in report["runs"])
    lines += ["", f"Leak audit after each run: {'clean' if clean else 'PROBLEMS (see the JSON)'}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--ckpt", type=Path, default=Path("/tmp/minserve_bench/llama-3.2-1b"), help="a checkpoint directory")
    add("--requests", type=int, default=128)
    add("--prompt", type=int, default=1024)
    add("--gen", type=int, default=512)
    add("--num-blocks", type=int, default=4096, help="the GPU pool (16-token blocks)")
    add("--batch-tokens", type=int, default=2048)
    add("--tier-gib", type=float, default=16.0)
    add("--seed", type=int, default=0)
    add("--smoke", action="store_true", help="the tiny model and sizes (CPU, seconds)")
    add("--out", type=Path, default=ROOT / "benchmarks" / "reports", help="a folder")
    args = p.parse_args(argv)
    if args.smoke:
        args.ckpt, args.requests, args.prompt, args.gen = ROOT / "models" / "tiny-llama", 16, 96, 96
        args.num_blocks, args.batch_tokens, args.tier_gib = 32, 256, 0.01
    import torch

    runs = [run(args, 0.0), run(args, args.tier_gib)]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    report = {"device": device, "checkpoint": str(args.ckpt),
              "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "argv": " ".join(sys.argv[1:] if argv is None else argv), "runs": runs}  # fmt: skip
    write_report(args.out.resolve() / f"kv_offload_preempt_{device}", report, markdown(report))


if __name__ == "__main__":
    main()
