"""Shared pieces of the benchmark harness: sizes, workloads, model locations, environment facts.

Workload (c) is nano-vllm's offline benchmark, drawn exactly as its bench.py does: with Python's
`random.seed(0)`, first all 256 prompts (for each, a length randint(100, 1024), then that many token
ids randint(0, 10000)), then all 256 max_tokens randint(100, 1024). That order gives 133,966 output
tokens in total (drawing each request's max_tokens right after its prompt gives 140,084 instead).
"""

from __future__ import annotations

import json
import os
import platform
import random
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

NANO_VLLM_OUTPUT_TOKENS = 133_966  # sum of max_tokens of the full (c) workload: a check on the draw order
REAL_MODELS = ("llama-3.2-1b", "llama-3.1-8b", "qwen3-0.6b")
SMOKE_MODELS = {"llama-3.2-1b": "tiny", "llama-3.1-8b": "tiny", "qwen3-0.6b": "tiny-qwen3"}


@dataclass
class Sizes:
    """Every workload size; `Sizes.full()` are the published figures' sizes, `smoke()` a CPU check."""

    a_prompt: int = 128  # (a) batch-1 decode
    a_gen: int = 256
    a_reps: int = 3  # timed repetitions (after one warm-up); medians reported
    b_batch: int = 64  # (b) batched decode at long context
    b_prompt: int = 1000
    b_gen: int = 128
    b_reps: int = 2
    c_requests: int = 256  # (c) nano-vllm offline workload
    c_min_len: int = 100
    c_max_len: int = 1024
    c_token_max: int = 10000
    c_temperature: float = 0.6  # as nano-vllm's bench
    c_reps: int = 3  # full (c) runs; the median run is reported (one 7-s run varied by ~15% across hosts)
    hf_c_requests: int = 64  # transformers' continuous batching runs the first K requests of (c)

    @staticmethod
    def smoke() -> Sizes:
        return Sizes(
            a_prompt=16,
            a_gen=12,
            a_reps=2,
            b_batch=4,
            b_prompt=40,
            b_gen=8,
            b_reps=1,
            c_requests=6,
            c_min_len=8,
            c_max_len=40,
            c_reps=1,
            hf_c_requests=3,
        )

    def as_dict(self) -> dict:
        return asdict(self)


def model_name(logical: str, smoke: bool) -> str:
    """The scripts.make_model shape that stands in for a logical model (a tiny one in smoke runs)."""
    return SMOKE_MODELS[logical] if smoke else logical


def ckpt_path(ckpt_dir: str | Path, logical: str, smoke: bool) -> Path:
    return Path(ckpt_dir) / model_name(logical, smoke)


def nanovllm_workload(s: Sizes, vocab_size: int) -> tuple[list[list[int]], list[int]]:
    """(prompts, max_tokens) of workload (c); ids are folded into the vocabulary when it is smaller."""
    rng = random.Random(0)  # the same stream as random.seed(0) + random.randint
    prompts = [[rng.randint(0, s.c_token_max) for _ in range(rng.randint(s.c_min_len, s.c_max_len))]
               for _ in range(s.c_requests)]  # fmt: skip
    max_tokens = [rng.randint(s.c_min_len, s.c_max_len) for _ in range(s.c_requests)]
    if (s.c_requests, s.c_min_len, s.c_max_len, s.c_token_max) == (256, 100, 1024, 10000):
        assert sum(max_tokens) == NANO_VLLM_OUTPUT_TOKENS, "the draw order no longer matches nano-vllm"
    if vocab_size <= s.c_token_max:
        prompts = [[t % vocab_size for t in p] for p in prompts]
    return prompts, max_tokens


def random_prompts(rng: random.Random, count: int, length: int, vocab_size: int) -> list[list[int]]:
    """Distinct random prompts (ids above the few special ones at the bottom), so no prefix is shared."""
    low = min(8, vocab_size - 1)
    return [[rng.randrange(low, vocab_size) for _ in range(length)] for _ in range(count)]


def vocab_size(path: str | Path) -> int:
    return json.loads((Path(path) / "config.json").read_text())["vocab_size"]


def _try(fn, default=None):
    try:
        return fn()
    except Exception:
        return default


def _version(module: str) -> str | None:
    return _try(lambda: __import__(module).__version__)


def environment() -> dict:
    """Hardware and software facts for the report header (call in a process that may touch CUDA)."""
    import torch

    hw: dict = {"cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        hw.update(
            gpu=p.name,
            sm_count=p.multi_processor_count,
            gpu_memory_GiB=round(p.total_memory / 2**30, 1),
            compute_capability=f"{p.major}.{p.minor}",
            gpu_count=torch.cuda.device_count(),
        )
        smi = ["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,power.limit", "--format=csv,noheader"]
        hw["nvidia_smi"] = _try(
            lambda: subprocess.run(smi, capture_output=True, text=True, timeout=20).stdout.strip()
        )
    else:
        hw["gpu"] = None
    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "safetensors": _version("safetensors"),
    }
    return {"hardware": hw, "versions": versions, "hostname": platform.node()}


def git_commit(root: Path) -> str | None:
    out = _try(
        lambda: subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        )
    )
    if out is None or out.returncode:
        return None
    dirty = _try(
        lambda: subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    )
    return out.stdout.strip() + ("+dirty" if dirty else "")


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    tmp.replace(path)  # a reader never sees half a file


def write_report(stem: str | Path, report: dict, text: str) -> None:
    """A probe's output: STEM.json (the data), STEM.md (its table), and the table on stdout."""
    stem = Path(stem)
    write_json(stem.with_suffix(".json"), report)
    stem.with_suffix(".md").write_text(text)
    print(text)
