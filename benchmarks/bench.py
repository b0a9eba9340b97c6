"""Engine vs transformers benchmarks with rooflines; writes JSON + markdown + PNG under --out.

    python -m benchmarks.bench --suite all --out benchmarks/reports          # GPU host (see run_gpu.sh)
    python -m benchmarks.bench --smoke --suite all --out /tmp/bench-smoke    # CPU check, tiny models

Suites (comma-separated, or `all`): a (batch-1 decode, Llama-3.1-8B and Llama-3.2-1B shapes),
b (batch-64 decode at 1k context, 8B), c (nano-vllm offline workload, Qwen3-0.6B), b-fp8 / c-fp8 (b / c
with kv_cache_dtype="fp8": weights still bf16, the KV cache in float8 e4m3), hf-a / hf-c (transformers
on a / c), eager (a with CUDA graphs off). The env job (hardware, versions, measured
copy bandwidth and matmul rate, from which the rooflines are computed) always runs first.
Random-weight checkpoints are written once into --ckpt-dir and reused.

Every job runs in its own Python process (so GPU memory is whole again for the next, and a crash or
a hang costs one figure, not the run) under a deadline: the job's cap, cut to what is left of
--budget-s. Each job writes <out>/parts/<job>.json; the report is built from whatever is there.
--baseline-tree DIR: DIR's bench runs first, then this one; the report adds both side by side
(benchmarks/bench_ab.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.common import Sizes, ckpt_path, environment, git_commit, model_name, write_json

ROOT = Path(__file__).resolve().parents[1]
SUITES = ("a", "b", "b-fp8", "c", "c-fp8", "hf-a", "hf-c", "eager")
L8, L1, Q = "llama-3.1-8b", "llama-3.2-1b", "qwen3-0.6b"


@dataclass
class Job:
    name: str
    kind: str  # env | ckpt | engine | hf
    model: str | None = None
    figures: list[str] = field(default_factory=list)
    eager: bool = False
    kv_cache_dtype: str = "auto"  # engine jobs: CacheConfig.kv_cache_dtype
    cap_s: float = 300.0


def plan(suites: set[str], smoke: bool) -> list[Job]:
    """Jobs in priority order (the 8B figures first), each checkpoint made just before its first use."""
    wanted = [
        Job("env", "env", cap_s=120),
        Job(f"engine-{L8}", "engine", L8, [f for f in ("a", "b") if f in suites], cap_s=300),
        Job(f"hf-{L8}", "hf", L8, ["a"] if "hf-a" in suites else [], cap_s=200),
        Job(f"engine-{L1}", "engine", L1, ["a"] if "a" in suites else [], cap_s=150),
        Job(f"engine-{Q}", "engine", Q, ["c"] if "c" in suites else [], cap_s=360),
        Job(f"hf-{L1}", "hf", L1, ["a"] if "hf-a" in suites else [], cap_s=120),
        Job(f"hf-{Q}", "hf", Q, ["c"] if "hf-c" in suites else [], cap_s=200),
        Job(f"engine-fp8kv-{L8}", "engine", L8, ["b"] if "b-fp8" in suites else [], kv_cache_dtype="fp8",
            cap_s=240),
        Job(f"engine-fp8kv-{Q}", "engine", Q, ["c"] if "c-fp8" in suites else [], kv_cache_dtype="fp8",
            cap_s=300),
        Job(f"engine-eager-{L8}", "engine", L8, ["a"] if "eager" in suites else [], eager=True, cap_s=200),
        Job(f"engine-eager-{L1}", "engine", L1, ["a"] if "eager" in suites else [], eager=True, cap_s=120),
    ]  # fmt: skip
    jobs = [j for j in wanted if j.figures or j.kind == "env"]  # env always: its ceilings make the rooflines
    out, made = [], set()
    for job in jobs:
        if job.model and model_name(job.model, smoke) not in made:
            made.add(model_name(job.model, smoke))
            out.append(Job(f"ckpt-{job.model}", "ckpt", job.model, cap_s=300 if job.model == L8 else 120))
        out.append(job)
    return out


# ----------------------------------------------------------------------------------------- one job
def _device_caps(out_dir: Path) -> dict:
    """The measured ceilings of this run (the env job's), or nominal ones if env did not run."""
    env = out_dir / "parts" / "env.json"
    if env.exists():
        data = json.loads(env.read_text())
        if data.get("status") == "ok":
            return data["results"]["device"]
    return {"copy_bw_GBps": float("nan"), "matmul_TFLOPs": float("nan"), "note": "env job missing"}


def run_job(job: Job, args) -> dict:
    """Run one job in this process and return its results (raises on failure)."""
    import torch

    from benchmarks.roofline import measure_device, model_cost

    if job.kind == "env":
        return {**environment(), "device": measure_device(args.smoke)}
    path = ckpt_path(args.ckpt_dir, job.model, args.smoke)
    if job.kind == "ckpt":
        return make_checkpoint(job.model, path, args.smoke)
    dtype_bytes = 2 if torch.cuda.is_available() else 4  # bf16 on a GPU, fp32 on a CPU
    cost = model_cost(path, dtype_bytes, kv_dtype_bytes=1 if job.kv_cache_dtype == "fp8" else None)
    caps = _device_caps(Path(args.out))
    if job.kind == "engine":
        from benchmarks.engine_runs import run_engine_job

        eager = job.eager or args.enforce_eager
        return run_engine_job(str(path), job.figures, eager, job.kv_cache_dtype, args, cost, caps)
    from benchmarks.hf_baseline import run_hf_job

    return run_hf_job(str(path), job.figures, args, cost, caps)


def make_checkpoint(logical: str, path: Path, smoke: bool) -> dict:
    """Write the random-weight checkpoint unless a complete one of the same shape is there already."""
    import torch

    from scripts.make_model import make_model
    from scripts.model_shapes import get_spec

    name = model_name(logical, smoke)
    spec = get_spec(name)
    want = {
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "vocab_size": spec.vocab_size,
        "intermediate_size": spec.intermediate_size,
        "num_key_value_heads": spec.num_kv_heads,
    }
    cfg_file = path / "config.json"  # make_model writes it last: its presence marks a complete checkpoint
    if cfg_file.exists():
        have = json.loads(cfg_file.read_text())
        if all(have.get(k) == v for k, v in want.items()):
            return {"path": str(path), "shape": name, "reused": True}
    t0 = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    make_model(name, path, seed=0, device=device)
    return {"path": str(path), "shape": name, "reused": False, "write_s": time.perf_counter() - t0}


def job_main(args) -> None:
    """Child-process entry: run the job given by --job (a Job as JSON) and write its part file."""
    job = Job(**json.loads(args.job))
    part = Path(args.out) / "parts" / f"{job.name}.json"
    t0 = time.perf_counter()
    try:
        record = {"status": "ok", "results": run_job(job, args)}
    except Exception as exc:
        traceback.print_exc()
        record = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
    record.update(job=job.name, kind=job.kind, model=job.model, figures=job.figures, eager=job.eager,
                  kv_cache_dtype=job.kv_cache_dtype, elapsed_s=time.perf_counter() - t0)  # fmt: skip
    write_json(part, record)


# ----------------------------------------------------------------------------------------- the run
def _die_with_parent() -> None:
    """In the child: get SIGKILL when the parent dies (Linux), so a killed run leaves no GPU job behind."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except OSError:
        pass


def _spawn(job: Job, argv: list[str], timeout: float) -> int | None:
    """Run the job in a child process group; on timeout stop that group. Returns the exit code or None."""
    cmd = [sys.executable, "-m", "benchmarks.bench", *argv, "--job", json.dumps(asdict(job))]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    # same cwd, so relative paths agree; a session of its own, so a deadline can stop the whole job
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        return None


def run_one(job: Job, args, argv: list[str], out: Path, left: float) -> None:
    """Run one job under min(its cap, the budget left) and make sure its part file says how it went."""
    part = out / "parts" / f"{job.name}.json"
    if left < 20:
        write_json(part, {"job": job.name, "kind": job.kind, "model": job.model, "figures": job.figures,
                          "status": "skipped", "error": "time budget spent"})  # fmt: skip
        return
    print(
        f"\n=== {job.name} (deadline {min(job.cap_s, left):.0f} s, {left:.0f} s of budget left)", flush=True
    )
    t0 = time.time()
    if args.no_isolate:
        job_main(argparse.Namespace(**{**vars(args), "job": json.dumps(asdict(job))}))
        rc = 0
    else:
        rc = _spawn(job, argv, min(job.cap_s, left))
    if rc is None or not part.exists():  # killed at its deadline, or died without a word
        write_json(part, {"job": job.name, "kind": job.kind, "model": job.model, "figures": job.figures,
                          "status": "timeout" if rc is None else "error",
                          "error": "deadline reached" if rc is None else f"exit code {rc}",
                          "elapsed_s": time.time() - t0})  # fmt: skip
    print(f"=== {job.name}: {json.loads(part.read_text())['status']} in {time.time() - t0:.0f} s", flush=True)


def run_all(args, argv: list[str]) -> None:
    from benchmarks import bench_ab, report

    out = Path(args.out)
    base = bench_ab.run_old(args, argv, build_parser()) if args.baseline_tree else None
    suites = set(SUITES) if args.suite == "all" else set(args.suite.split(","))
    jobs = plan(suites, args.smoke)
    start = time.time()
    meta = {"command": "python -m benchmarks.bench " + shlex.join(argv), "argv": argv, "smoke": args.smoke,
            "suites": sorted(suites), "budget_s": args.budget_s, "sizes": args.sizes.as_dict(),
            "ckpt_dir": str(args.ckpt_dir), "git": git_commit(ROOT), "plan": [j.name for j in jobs],
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}  # fmt: skip
    for stale in (out / "parts").glob("*.json"):
        stale.unlink()  # a report must never mix two runs
    write_json(out / "parts" / "_meta.json", meta)
    for job in jobs:
        run_one(job, args, argv, out, args.budget_s - (time.time() - start))
    meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    meta["wall_s"] = time.time() - start
    write_json(out / "parts" / "_meta.json", meta)
    data = report.build(out)
    if base is not None:
        bench_ab.write_ab(out, data, base)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", default="all", help=f"all, or a comma-separated subset of {', '.join(SUITES)}")
    p.add_argument("--out", default="benchmarks/reports", help="report directory")
    p.add_argument("--smoke", action="store_true", help="tiny models and workloads (runs on a CPU)")
    p.add_argument("--ckpt-dir", default=None, help="checkpoints (default /tmp/minserve_bench[_smoke])")
    p.add_argument("--budget-s", type=float, default=540.0, help="wall-time budget for all jobs")
    p.add_argument("--enforce-eager", action="store_true", help="engine without CUDA graphs in every job")
    p.add_argument("--no-isolate", action="store_true", help="run jobs in this process (tests)")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--max-num-seqs", type=int, default=256, help="engine max_num_seqs for (c)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--blas-library", choices=["cublas", "cublaslt"], default="cublaslt", help="engine GEMMs")
    for key, value in Sizes().as_dict().items():  # --a-gen 256, --hf-c-requests 64, ...
        p.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=None)
    p.add_argument(
        "--baseline-tree", default=None, help="run this tree's bench first; report both side by side"
    )
    p.add_argument("--job", help=argparse.SUPPRESS)
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    bad = set() if args.suite == "all" else set(args.suite.split(",")) - set(SUITES)
    if bad:
        p.error(f"--suite: unknown suite(s) {sorted(bad)}; choose from all, {', '.join(SUITES)}")
    sizes = Sizes.smoke() if args.smoke else Sizes()
    for key in sizes.as_dict():
        if getattr(args, key) is not None:
            setattr(sizes, key, getattr(args, key))
    args.sizes = sizes
    args.ckpt_dir = args.ckpt_dir or ("/tmp/minserve_bench_smoke" if args.smoke else "/tmp/minserve_bench")
    return args


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.job:
        job_main(args)
    else:
        run_all(args, argv)


if __name__ == "__main__":
    main()
