"""The transformers baseline, on the same checkpoint directories as the engine.

(a) `model.generate` with a static KV cache (`cache_implementation="static"`), greedy, batch 1, bf16,
    eager PyTorch (no torch.compile: transformers as most people call it), SDPA attention. Decode is
    timed like the engine's: a streamer stamps every new token (after a device sync) and decode
    tok/s = (tokens - 1) / (last stamp - first generated token's stamp), so prefill never enters.
(c) transformers' continuous batching (`ContinuousBatchingManager`, the machinery behind
    `model.generate_batch`) on the first `hf_c_requests` requests of the nano-vllm workload. Requests
    go in one by one through `manager.add_request` because each has its own max_new_tokens
    (`generate_batch` takes a single one); EOS is disabled (eos_token_id=-1), as ignore_eos does for
    the engine; sampling at the same temperature. Timed from the first add to the last result, after
    the manager's own warm-up.

    python -m benchmarks.bench --suite hf-a,hf-c [--smoke]   # this module has no entry point of its own
"""

from __future__ import annotations

import inspect
import random
import statistics
import time

from tqdm import tqdm

from benchmarks.common import Sizes, nanovllm_workload, random_prompts
from benchmarks.roofline import ModelCost, decode_roofline, offline_roofline


class _Stamps:
    """A generate() streamer recording when each step's token exists (the first put is the prompt)."""

    def __init__(self, sync):
        self.sync, self.times = sync, []

    def put(self, value) -> None:
        self.sync()
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def load_hf(path: str, device: str):
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval()


def _generate_once(model, prompt: list[int], gen: int, device: str) -> list[float]:
    import torch
    from transformers import GenerationConfig

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    config = GenerationConfig(max_new_tokens=gen, min_new_tokens=gen, do_sample=False,
                              cache_implementation="static", pad_token_id=0, eos_token_id=None)  # fmt: skip
    stamps = _Stamps(sync)
    ids = torch.tensor([prompt], device=device)
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), generation_config=config, streamer=stamps
        )
    if out.shape[1] - len(prompt) != gen:
        raise RuntimeError(f"transformers generated {out.shape[1] - len(prompt)} tokens, expected {gen}")
    return stamps.times[1:]  # one stamp per generated token


def hf_decode_figure(
    model, cost: ModelCost, device_caps: dict, s: Sizes, device: str, seed: int = 10
) -> dict:
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    _generate_once(model, random_prompts(rng, 1, s.a_prompt, vocab)[0], min(s.a_gen, 16), device)  # warm-up
    runs = []
    for _ in tqdm(range(s.a_reps), desc="transformers decode batch 1"):
        stamps = _generate_once(model, random_prompts(rng, 1, s.a_prompt, vocab)[0], s.a_gen, device)
        steps = [b - a for a, b in zip(stamps, stamps[1:])]
        runs.append({"tok_s": len(steps) / (stamps[-1] - stamps[0]), "step_s": steps})
    steps = sorted(t for r in runs for t in r["step_s"])
    tok_s = statistics.median(r["tok_s"] for r in runs)
    roof = decode_roofline(cost, 1, s.a_prompt + s.a_gen / 2, device_caps)
    return {
        "batch": 1, "prompt_tokens": s.a_prompt, "gen_tokens": s.a_gen, "reps": s.a_reps,
        "tok_s": tok_s, "tok_s_runs": [r["tok_s"] for r in runs],
        "step_ms_p50": 1e3 * statistics.median(steps),
        "step_ms_p90": 1e3 * steps[int(0.9 * (len(steps) - 1))],
        "weight_GBps": cost.step_weight_bytes * tok_s / 1e9,
        "roofline": roof, "pct_of_roofline": 100 * tok_s / roof["tok_s"],
        "method": "generate, static cache, greedy, no torch.compile, sdpa",
    }  # fmt: skip


def _call_with_supported(fn, **kwargs):
    """Call fn with the keywords its signature has (the continuous-batching API moves between versions)."""
    params = inspect.signature(fn).parameters
    return fn(**{k: v for k, v in kwargs.items() if k in params})


def _cb_hints(prompts, max_tokens):
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints
    except ImportError:
        return None
    return WorkloadHints(max_prompt_length=max(map(len, prompts)), max_generated_length=max(max_tokens),
                         num_requests=len(prompts))  # fmt: skip


def _cpu_cb_config(model):
    """On a CPU (smoke runs) a small KV pool: sized from free host memory it takes many GB to set up."""
    if model.device.type != "cpu":
        return None  # on a GPU: transformers sizes its cache from free GPU memory, as it does by default
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    return ContinuousBatchingConfig(num_blocks=32, max_batch_tokens=512)


def _collect(manager, k: int) -> dict[str, int]:
    """Wait for k finished requests; request id -> generated tokens."""
    done: dict[str, int] = {}
    with tqdm(total=k, desc="transformers continuous batching") as bar:
        while len(done) < k:
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError(f"transformers' generation thread stopped after {len(done)} of {k}")
                continue
            if result.is_finished():
                if result.error:
                    raise RuntimeError(f"transformers request {result.request_id} failed: {result.error}")
                done[result.request_id] = len(result.generated_tokens)
                bar.update()
    return done


def hf_offline_figure(model, cost: ModelCost, device_caps: dict, s: Sizes) -> dict:
    from transformers import GenerationConfig

    prompts, max_tokens = nanovllm_workload(s, model.config.vocab_size)
    k = min(s.hf_c_requests, len(prompts))
    prompts, max_tokens = prompts[:k], max_tokens[:k]
    sample = s.c_temperature > 0
    config = GenerationConfig(
        max_new_tokens=max(max_tokens),
        do_sample=sample,
        eos_token_id=-1,
        pad_token_id=0,
        **({"temperature": s.c_temperature, "top_k": 0, "top_p": 1.0} if sample else {}),
    )
    cm = _call_with_supported(model.continuous_batching_context_manager, generation_config=config, block=True,
                              timeout=30, warmup=True, workload_hints=_cb_hints(prompts, max_tokens),
                              continuous_batching_config=_cpu_cb_config(model))  # fmt: skip
    with cm as manager:  # not under inference_mode: the manager's thread updates tensors made here in place
        t0 = time.perf_counter()
        for i, (p, m) in enumerate(zip(prompts, max_tokens)):
            _call_with_supported(
                manager.add_request, input_ids=p, request_id=f"r{i}", max_new_tokens=m, eos_token_id=-1
            )
        done = _collect(manager, k)
        wall = time.perf_counter() - t0
        attn = getattr(model.config, "_attn_implementation", None)  # CB may switch to flash attention
    out = sum(done.values())
    roof = offline_roofline(cost, [len(p) for p in prompts], max_tokens, device_caps)
    result = {
        "requests": k,
        "prompt_tokens": sum(map(len, prompts)),
        "output_tokens": out,
        "wall_s": wall,
        "tok_s": out / wall,
        "temperature": s.c_temperature,
        "roofline": roof,
        "pct_of_roofline": 100 * out / wall / roof["tok_s"],
        "method": "ContinuousBatchingManager (generate_batch's engine), per-request max_new_tokens",
        "attn_implementation": attn,
    }
    if out != sum(max_tokens):  # another transformers version may ignore a per-request limit or EOS=-1
        result["warning"] = f"transformers produced {out} tokens, the workload asks for {sum(max_tokens)}"
    return result


def run_hf_job(path: str, figures: list[str], args, cost: ModelCost, device_caps: dict) -> dict:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    model = load_hf(str(path), device)
    out: dict = {"load_s": time.perf_counter() - t0, "dtype": str(model.dtype).removeprefix("torch.")}
    if "a" in figures:
        out["a"] = hf_decode_figure(model, cost, device_caps, args.sizes, device)
    if "c" in figures:
        out["c"] = {"subset": hf_offline_figure(model, cost, device_caps, args.sizes)}
    return out
