"""Our engine on figures (a) batch-1 decode, (b) batch-64 decode at 1k context, (c) nano-vllm offline.

Decode is timed step by step: the requests are added to `LLM.engine` and `engine.step()` is driven
here, with a wall-clock stamp after every step (a step ends with the sampled ids on the host, so the
GPU work of that step is finished). A decode step is one that comes after every request's first
token and emits one token for each request of the batch; decode tok/s = tokens of those steps / their
summed durations. Prefill never enters (a) or (b). (c) is end to end: total output tokens / wall time
of `LLM.generate`, as nano-vllm's bench measures it.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

from tqdm import tqdm

from benchmarks.common import Sizes, nanovllm_workload, random_prompts
from benchmarks.gpu_power import PowerSampler, summarize
from benchmarks.roofline import ModelCost, decode_roofline, offline_roofline


@dataclass
class Step:
    seconds: float  # since the previous step ended
    tokens: int  # tokens emitted by this step over all requests
    first_tokens: int  # requests whose first token came in this step


def trace(engine, prompts: list[list[int]], params) -> list[Step]:
    """Run the prompts to completion through engine.step(); one Step per engine step."""
    for p, sp in zip(prompts, params if isinstance(params, list) else [params] * len(prompts), strict=True):
        engine.add_request(p, sp)
    seen: set[str] = set()
    steps: list[Step] = []
    prev = time.perf_counter()
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        tokens = first = 0
        for out in outs:
            n = sum(len(d.token_ids) for d in out.outputs)
            errors = [d.error for d in out.outputs if d.error]
            if errors:
                raise RuntimeError(f"request {out.request_id} failed: {errors[0]}")
            tokens += n
            if n and out.request_id not in seen:
                seen.add(out.request_id)
                first += 1
        steps.append(Step(now - prev, tokens, first))
        prev = now
    return steps


def decode_steps(steps: list[Step], batch: int) -> list[Step]:
    """Steps after the last first token in which all `batch` requests decoded one token each."""
    started = 0
    for i, s in enumerate(steps):
        started += s.first_tokens
        if started == batch:
            return [s for s in steps[i + 1 :] if s.tokens == batch]
    raise RuntimeError(f"only {started} of {batch} requests produced a token")


def _decode_run(engine, prompts, gen: int) -> dict:
    from engine import SamplingParams

    sp = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
    steps = trace(engine, prompts, sp)
    total = sum(s.tokens for s in steps)
    if total != len(prompts) * gen:
        raise RuntimeError(f"expected {len(prompts) * gen} tokens (ignore_eos), got {total}")
    end = time.time()
    dec = decode_steps(steps, len(prompts))
    secs = [s.seconds for s in dec]
    # the decode steps are the run's last steps: they span the sum of their durations before `end`
    return {"tok_s": len(prompts) * len(dec) / sum(secs), "step_s": secs, "window": (end - sum(secs), end)}


def decode_figure(
    llm, cost: ModelCost, device: dict, batch: int, prompt: int, gen: int, reps: int, seed: int
) -> dict:
    """Batch-`batch` greedy decode after `prompt`-token prompts; median over `reps` timed runs."""
    rng = random.Random(seed)
    vocab = llm.engine.runner.model_config.vocab_size
    _decode_run(llm.engine, random_prompts(rng, batch, prompt, vocab), min(gen, 16))  # warm-up: same shapes
    with PowerSampler() as power:
        runs = [_decode_run(llm.engine, random_prompts(rng, batch, prompt, vocab), gen)
                for _ in tqdm(range(reps), desc=f"decode batch {batch}")]  # fmt: skip
    steps = sorted(t for r in runs for t in r["step_s"])
    tok_s = statistics.median(r["tok_s"] for r in runs)
    mean_ctx = prompt + gen / 2  # context of the average decode step
    roof = decode_roofline(cost, batch, mean_ctx, device)
    return {
        "batch": batch, "prompt_tokens": prompt, "gen_tokens": gen, "reps": reps,
        "tok_s": tok_s, "tok_s_runs": [r["tok_s"] for r in runs],
        "step_ms_p50": 1e3 * statistics.median(steps),
        "step_ms_p90": 1e3 * steps[int(0.9 * (len(steps) - 1))],
        "decode_steps_timed": len(steps),
        # weights a step reads / step time: how close the step gets to streaming the weights once
        "weight_GBps": cost.step_weight_bytes * tok_s / batch / 1e9,
        "bytes_GBps": roof["bytes_per_step"] * tok_s / batch / 1e9,
        "roofline": roof, "pct_of_roofline": 100 * tok_s / roof["tok_s"],
        # SM clock and board power over the timed decode steps (None off a GPU host)
        "power": summarize(power.samples, [r["window"] for r in runs]),
    }  # fmt: skip


def _offline_run(llm, prompts, max_tokens, temperature: float) -> dict:
    from engine import SamplingParams

    params = [SamplingParams(max_tokens=m, temperature=temperature, ignore_eos=True) for m in max_tokens]
    t0 = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=True)
    wall = time.perf_counter() - t0
    out = sum(len(r.outputs[0].token_ids) for r in results)
    errors = [r.outputs[0].error for r in results if r.outputs[0].error]
    if errors or out != sum(max_tokens):
        raise RuntimeError(f"expected {sum(max_tokens)} output tokens, got {out}; first error: {errors[:1]}")
    return {"requests": len(prompts), "prompt_tokens": sum(map(len, prompts)), "output_tokens": out,
            "wall_s": wall, "tok_s": out / wall}  # fmt: skip


def offline_figure(llm, cost: ModelCost, device: dict, s: Sizes) -> dict:
    """Workload (c) end to end, `c_reps` times (the median run is reported, every run's rate listed),
    then its first `hf_c_requests` requests (the transformers comparison)."""
    vocab = llm.engine.runner.model_config.vocab_size
    prompts, max_tokens = nanovllm_workload(s, vocab)
    warm = random_prompts(random.Random(1), 4, s.c_max_len // 2, vocab)
    _offline_run(llm, warm, [8] * len(warm), s.c_temperature)  # compile / warm every kernel once
    runs = [_offline_run(llm, prompts, max_tokens, s.c_temperature) for _ in range(max(1, s.c_reps))]
    full = sorted(runs, key=lambda r: r["tok_s"])[(len(runs) - 1) // 2]  # the median run (lower middle)
    full["tok_s_runs"] = [r["tok_s"] for r in runs]
    k = min(s.hf_c_requests, len(prompts))
    subset = _offline_run(llm, prompts[:k], max_tokens[:k], s.c_temperature)
    roof = offline_roofline(cost, [len(p) for p in prompts], max_tokens, device)
    sub_roof = offline_roofline(cost, [len(p) for p in prompts[:k]], max_tokens[:k], device)
    full.update(
        temperature=s.c_temperature, roofline=roof, pct_of_roofline=100 * full["tok_s"] / roof["tok_s"]
    )
    subset.update(
        temperature=s.c_temperature,
        roofline=sub_roof,
        pct_of_roofline=100 * subset["tok_s"] / sub_roof["tok_s"],
    )
    return {"full": full, "subset": subset}


def engine_options(args, figures: list[str], eager: bool, kv_cache_dtype: str = "auto") -> dict:
    """LLM(...) keywords for one job; bf16 on a GPU, the engine's own default (fp32) on a CPU."""
    import torch

    opts = {
        "dtype": "bfloat16" if torch.cuda.is_available() else "auto",
        "kv_cache_dtype": kv_cache_dtype,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs if "c" in figures else max(args.sizes.b_batch, 1),
        "enforce_eager": eager,
    }
    if torch.cuda.is_available():
        opts["gpu_memory_utilization"] = args.gpu_memory_utilization
        opts["blas_library"] = args.blas_library
    if "c" in figures:
        opts["max_waiting"] = max(1024, args.sizes.c_requests)  # every request is queued at once
        # random prompts share no prefix; off, so that the subset rerun cannot reuse the full run's KV
        opts["enable_prefix_caching"] = False
    return opts


def run_engine_job(
    path: str, figures: list[str], eager: bool, kv_cache_dtype: str, args, cost: ModelCost, device: dict
) -> dict:
    from engine import LLM

    opts = engine_options(args, figures, eager, kv_cache_dtype)
    t0 = time.perf_counter()
    llm = LLM(str(path), **opts)
    out: dict = {"engine_options": opts, "load_s": time.perf_counter() - t0,
                 "kv_blocks": llm.engine.block_manager.num_blocks}  # fmt: skip
    s = args.sizes
    if "a" in figures:
        out["a"] = decode_figure(llm, cost, device, 1, s.a_prompt, s.a_gen, s.a_reps, seed=10)
    if "b" in figures:
        out["b"] = decode_figure(llm, cost, device, s.b_batch, s.b_prompt, s.b_gen, s.b_reps, seed=20)
    if "c" in figures:
        out["c"] = offline_figure(llm, cost, device, s)
    return out
