"""Unconstrained greedy decode tok/s of whichever engine is on the import path: an A/B of two commits
on one host, in one device call (the older tree extracted elsewhere and put first on PYTHONPATH).

    python benchmarks/decode_ab.py --ckpt /tmp/minserve_bench/llama-3.2-1b --batches 1,64 --label HEAD
    PYTHONPATH=/tmp/base python benchmarks/decode_ab.py --ckpt ... --label base

Run as a script (not -m), so that `engine` and `benchmarks` come from PYTHONPATH when it is set. Uses
only what both trees have: engine.LLM, benchmarks.engine_runs.trace / decode_steps. Prints one JSON
line per batch size: median tok/s of `--reps` runs after one warm-up, over the steps where every request
decoded (as structured_bench and bench.py count them).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

if __name__ == "__main__" and not any(Path(p, "engine").is_dir() for p in sys.path[1:] if p):
    sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # no PYTHONPATH: this tree


def run(llm, batch: int, prompt: int, gen: int, vocab: int, rng: random.Random) -> float:
    from benchmarks.engine_runs import decode_steps, trace
    from engine import SamplingParams

    prompts = [[rng.randrange(8, vocab) for _ in range(prompt)] for _ in range(batch)]
    sp = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
    dec = decode_steps(trace(llm.engine, prompts, sp), batch)
    return batch * len(dec) / sum(s.seconds for s in dec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--label", default="")
    ap.add_argument("--no-grammar-warm-up", action="store_true", help="skip the token-trie build")
    ap.add_argument("--settle", type=float, default=0.0, help="seconds to wait after start-up threads")
    args = ap.parse_args()
    import engine
    from engine import LLM

    if args.no_grammar_warm_up:
        import engine.structured.compiler

        engine.structured.warm_up = lambda *_: None
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(args.ckpt, max_num_seqs=max(batches), max_model_len=args.prompt + args.gen + 16)
    vocab, rng = llm.engine.runner.model_config.vocab_size, random.Random(0)
    time.sleep(args.settle)  # e.g. a background build at start-up (structured output's token trie)
    for batch in batches:
        run(llm, batch, args.prompt, args.gen, vocab, rng)  # warm-up: graphs, allocator, kernels
        runs = [run(llm, batch, args.prompt, args.gen, vocab, rng) for _ in range(args.reps)]
        row = {"label": args.label, "engine": str(Path(engine.__file__).parent), "batch": batch}
        print(json.dumps({**row, "tok_s": statistics.median(runs), "runs": runs}), flush=True)


if __name__ == "__main__":
    main()
