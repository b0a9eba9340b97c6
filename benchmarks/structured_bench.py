"""Structured output's cost in the engine: decode tok/s with no, half or all rows grammar-constrained,
grammar compile time (cold and cached), and the TTFT a cached schema adds at batch 1.

    python -m benchmarks.structured_bench --model llama-3.2-1b --batches 1,64,256 --out DIR
    python -m benchmarks.structured_bench --model tiny --batches 1,8 --steps small --out DIR   # CPU smoke

One process, one engine. The checkpoint has random weights in the named model's shapes
(scripts/make_model, written once under --ckpt-dir); its tokenizer is scripts/make_tokenizer's, whose
128k ids are mostly unreachable filler that flatters the mask fill. `--tokenizer DIR` puts another
tokenizer of the same size into a copy of the checkpoint (e.g. `bpe128k` from
`python -m benchmarks.grammar_libs_cpu tokenizers DIR`, a BPE trained to 128,256 ids).

Decode: per batch size, greedy requests with `prompt` random-token prompts and exactly `gen` tokens
each: unconstrained ones use ignore_eos; constrained ones use one of CONSTRAINTS (`--constraints`), which
no run can complete (an array with minItems 100000, a regex of exactly 4096 characters), so EOS is
never allowed and every request runs to max_tokens (checked). "half" constrains every other request.
tok/s counts the steps after every request's first token (benchmarks/engine_runs.decode_steps),
median over `reps` runs after a short warm-up. Compile: the 20 first schemas of
benchmarks/structured_cases.SCHEMAS with a fresh compiler (cold, ms each until the prototype exists)
and again from its cache. TTFT: add_request to the first token at batch 1, a cached schema
(json-array) vs none, median of `reps * 5` requests.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import environment, git_commit, random_prompts, write_report
from benchmarks.engine_runs import decode_steps, trace
from benchmarks.structured_cases import SCHEMAS

ROOT = Path(__file__).resolve().parents[1]
# constraints no run can complete, so EOS is never allowed and every request runs to max_tokens; the
# counted repetitions (maxLength, {4096}) are what makes llguidance's mask expensive, unbounded strings
# are cheap (benchmarks/reports/grammar_library_cpu.md)
CONSTRAINTS = {
    "json-array": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 100000},
    "json-free": {"type": "array", "items": {"type": "string"}, "minItems": 100000},
    "regex": "[a-z ]{4096}",
}
SIZES = {"small": dict(prompt=16, gen=12, reps=1), "full": dict(prompt=128, gen=256, reps=2)}


def ensure_llguidance() -> None:
    """A CUDA host usually lacks llguidance: install it from the wheelhouse (.gpuwheels, made by
    `python -m scripts.wheelhouse build`, which includes it) into /tmp/pylib, as serve_stack does for Ray."""
    try:
        import llguidance  # noqa: F401
    except ImportError:
        pass
    else:
        return
    from scripts.wheelhouse import DEFAULT_DIR, DEFAULT_TARGET, install_command

    wheels = sorted((ROOT / DEFAULT_DIR).glob("llguidance-*.whl"))
    if not wheels:
        sys.exit(
            "structured_bench: llguidance is missing: pip install llguidance, or bring the wheelhouse "
            f"({DEFAULT_DIR}, python -m scripts.wheelhouse build)"
        )
    subprocess.run(install_command(wheels, DEFAULT_TARGET), check=True)
    sys.path.insert(0, DEFAULT_TARGET)


def checkpoint(model: str, ckpt_dir: Path, tokenizer: Path | None) -> Path:
    from benchmarks.bench import make_checkpoint

    path = ckpt_dir / model
    make_checkpoint(model, path, smoke=False)
    if tokenizer is None:
        return path
    alt = ckpt_dir / f"{model}+{tokenizer.name}"
    shutil.copytree(path, alt, dirs_exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, alt / name)
    return alt


def structured(name: str):
    from engine.sampling_params import StructuredOutput

    spec = CONSTRAINTS[name]
    return StructuredOutput("regex" if isinstance(spec, str) else "json", spec)


def params(mode: str, constraint: str | None, batch: int, gen: int) -> list:
    """Greedy params for `batch` requests: mode none, half (every other request) or all constrained."""
    from engine import SamplingParams

    free = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
    if mode == "none":
        return [free] * batch
    constrained = SamplingParams(max_tokens=gen, temperature=0.0, structured=structured(constraint))
    if mode == "all":
        return [constrained] * batch
    return [constrained if i % 2 == 0 else free for i in range(batch)]


def decode_run(engine, prompts: list[list[int]], sps: list, gen: int) -> float:
    steps = trace(engine, prompts, sps)
    total = sum(s.tokens for s in steps)
    if total != len(prompts) * gen:
        raise RuntimeError(f"expected {len(prompts) * gen} tokens, got {total}: a request ended early")
    dec = decode_steps(steps, len(prompts))
    return len(prompts) * len(dec) / sum(s.seconds for s in dec)


def decode_table(llm, batches: list[int], constraints: list[str], size: dict) -> list[dict]:
    """Per batch size, every config (none, then half / all per constraint) warmed up once, then `reps`
    rounds that run each config once in turn: a config's tok/s is its median, and its ratio to none is
    the median of the rounds' ratios, so drift of the host between rounds cancels out (their quartiles
    show how far single rounds strayed)."""
    import random

    rng, vocab, rows = random.Random(0), llm.engine.runner.model_config.vocab_size, []
    configs = [("none", None)] + [(mode, c) for c in constraints for mode in ("half", "all")]
    for batch in batches:
        for mode, constraint in configs:  # untimed: the same shapes and constraint, fewer tokens
            prompts = random_prompts(rng, batch, size["prompt"], vocab)
            trace(llm.engine, prompts, params(mode, constraint, batch, min(size["gen"], 16)))
        runs: dict = {c: [] for c in configs}
        for _ in range(size["reps"]):
            for mode, constraint in configs:
                sps = params(mode, constraint, batch, size["gen"])
                prompts = random_prompts(rng, batch, size["prompt"], vocab)
                runs[(mode, constraint)].append(decode_run(llm.engine, prompts, sps, size["gen"]))
        base = runs[("none", None)]
        for (mode, constraint), each in runs.items():
            row = {"batch": batch, "constrained": mode, "constraint": constraint, "runs": each}
            ratios = sorted(r / b for r, b in zip(each, base))
            quartiles = [ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]]
            row.update(tok_s=statistics.median(each), vs_none=statistics.median(ratios))
            rows.append({**row, "vs_none_quartiles": quartiles})
            print(rows[-1], flush=True)
    return rows


def compile_times(llm) -> dict:
    from engine.sampling_params import StructuredOutput
    from engine.structured.compiler import GrammarCompiler

    compiler = GrammarCompiler(llm.engine.tokenizer, llm.engine.limits.vocab_size)
    cases = [StructuredOutput("json", s) for s in SCHEMAS[:20]]
    out = {}
    for label in ("cold", "cached"):
        times = []
        for so in cases:
            t0 = time.perf_counter()
            compiler.prototype(so)
            times.append((time.perf_counter() - t0) * 1e3)
        out[label] = {"ms_each": times, "ms_total": sum(times), "ms_max": max(times)}
    out["tokenizer_setup_ms"] = _timed(
        lambda: GrammarCompiler(llm.engine.tokenizer, llm.engine.limits.vocab_size)
    )
    return out


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def ttft(llm, size: dict) -> dict:
    """add_request to the first token at batch 1, a cached schema (json-array) against none, two ways:
    `step()` (offline: outputs trail tokens by one step, so two steps count) and `step_records()` (the
    engine core's loop under the server: a token leaves in the step that sampled it). The two requests
    alternate, and the added time is the median of each pair's difference, so the host's drift
    between seconds cancels out."""
    import random

    from engine import SamplingParams

    engine, rng = llm.engine, random.Random(1)
    vocab = engine.runner.model_config.vocab_size
    step_ways = {
        "offline": lambda: any(d.token_ids for o in engine.step() for d in o.outputs),
        "served": lambda: any(engine.step_records().token_ids),
    }
    labels = (("unconstrained", None), ("constrained_cached", structured("json-array")))

    def first_token_ms(step, sp) -> float:
        t0, first = time.perf_counter(), None
        engine.add_request(random_prompts(rng, 1, size["prompt"], vocab)[0], sp)
        while engine.has_unfinished():
            if step() and first is None:
                first = time.perf_counter() - t0
        return first * 1e3

    out = {}
    for way, step in step_ways.items():
        times: dict[str, list[float]] = {label: [] for label, _ in labels}
        for i in range(size["reps"] * 5 + 1):  # the first pair is a warm-up (and compiles)
            for label, so in labels:
                sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, structured=so)
                ms = first_token_ms(step, sp)
                times[label] += [ms] if i else []
        suffix = "" if way == "offline" else "_served"
        for label, each in times.items():
            out[label + suffix] = {"ms_median": statistics.median(each), "ms_each": each}
        pairs = zip(times["constrained_cached"], times["unconstrained"], strict=True)
        out["added_ms" + suffix] = statistics.median(c - u for c, u in pairs)
    return out


def markdown(report: dict) -> str:
    env, lines = report["environment"], []
    lines += [
        "# Structured output benchmark",
        "",
        f"git `{report['git']}`; command: `{report['command']}`",
        f"hardware: {env['hardware'].get('gpu') or env['hardware']['cpu']}; versions: {env['versions']}",
        f"model: {report['model']} ({report['checkpoint']}); sizes: {report['sizes']}",
        "",
        "| batch | constrained rows | constraint | decode tok/s (median) | vs none (median of rounds) "
        "| rounds' quartiles |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["decode"]:
        what = f"| {r['batch']} | {r['constrained']} | {r['constraint'] or ''} |"
        low, high = r["vs_none_quartiles"]
        lines.append(f"{what} {r['tok_s']:,.1f} | {r['vs_none']:.1%} | {low:.1%}-{high:.1%} |")
    c = report["compile"]
    lines += [
        "",
        f"Compile of {len(c['cold']['ms_each'])} schemas: cold {c['cold']['ms_total']:.1f} ms total "
        f"(max {c['cold']['ms_max']:.2f}), cached {c['cached']['ms_total']:.3f} ms total; "
        f"tokenizer setup {c['tokenizer_setup_ms']:.0f} ms.",
        f"Cold ms each: {', '.join(f'{x:.2f}' for x in c['cold']['ms_each'])}",
        "",
        f"TTFT at batch 1: unconstrained {report['ttft']['unconstrained']['ms_median']:.2f} ms, "
        f"cached schema {report['ttft']['constrained_cached']['ms_median']:.2f} ms "
        f"(added {report['ttft']['added_ms']:+.2f} ms, the median of alternating pairs' differences); "
        "through step_records (the served loop): "
        f"{report['ttft']['unconstrained_served']['ms_median']:.2f} ms, "
        f"{report['ttft']['constrained_cached_served']['ms_median']:.2f} ms "
        f"(added {report['ttft']['added_ms_served']:+.2f} ms).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--steps", choices=sorted(SIZES), default="full")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ckpt-dir", type=Path, default=Path("/tmp/minserve_bench"))
    ap.add_argument("--constraints", default=",".join(CONSTRAINTS), help=f"some of {', '.join(CONSTRAINTS)}")
    ap.add_argument("--tokenizer", type=Path, default=None, help="a tokenizer dir of the model's vocab size")
    ap.add_argument("--reps", type=int, default=None, help="rounds of every config (default: by --steps)")
    args = ap.parse_args(argv)
    batches, size = [int(b) for b in args.batches.split(",")], dict(SIZES[args.steps])
    if args.reps:
        size["reps"] = args.reps
    ensure_llguidance()
    import torch

    from engine import LLM

    path = checkpoint(args.model, args.ckpt_dir, args.tokenizer)
    opts = {"max_num_seqs": max(batches), "max_model_len": size["prompt"] + size["gen"] + 16}
    if not torch.cuda.is_available():
        opts.update(dtype="float32", device="cpu")
    llm = LLM(str(path), **opts)
    env = environment()
    env["versions"]["llguidance"] = _llguidance_version()
    report = {
        "command": "python -m benchmarks.structured_bench "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "git": git_commit(ROOT),
        "environment": env,
        "model": args.model,
        "checkpoint": str(path),
        "sizes": size,
        "engine_options": opts,
        "constraints": CONSTRAINTS,
        "decode": decode_table(llm, batches, args.constraints.split(","), size),
        "compile": compile_times(llm),
        "ttft": ttft(llm, size),
    }
    write_report(args.out / "structured_bench", report, markdown(report))


def _llguidance_version() -> str | None:
    from importlib.metadata import version

    return version("llguidance")


if __name__ == "__main__":
    main()
