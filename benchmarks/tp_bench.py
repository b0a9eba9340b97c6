"""Tensor parallelism against one GPU in the same run: decode tok/s, rooflines, all-reduce share, top-1.

    python -m benchmarks.tp_bench --model CKPT --tp 1,2,4 --out benchmarks/reports/gpu/tp_bench_8b

For each TP size (each in turn, its workers stopped before the next starts):
  * (a) batch-1 decode and (b) batch-64 decode at 1k context, timed step by step as benchmarks/bench.py
    does (benchmarks/engine_runs.decode_figure), with TP > 1 twice: the one-shot all-reduce on and off
    (`disable_custom_all_reduce`);
  * the roofline of each: the bytes one GPU reads per step (its share of the weights and of the KV) over
    the measured copy bandwidth;
  * the all-reduce time a step holds: 2 per layer and 1 for the embedding, each of batch x hidden bf16,
    timed per message size by benchmarks/tp_allreduce.py, NCCL and one-shot in a graph: measured in
    this run after the decode runs (--allreduce measure, the default), or from a table it wrote on
    the same kind of GPU (--allreduce FILE);
  * teacher-forced top-1: the greedy choice at every position of 64 fixed prompts (prompt_logprobs),
    all 64 in one batch, against TP=1's; TP=1 is also compared with itself one prompt at a time. A
    prefill treats each row alike at any batch size, so TP=1 agrees with itself there bit for bit;
  * the same through decode steps (benchmarks/teacher_forcing.py): all 64 sequences a step, and the
    first --tf-alone one at a time, each against TP=1's at the same batch size; TP=1 at batch 1 against
    TP=1 at batch 64 is the agreement the decode kernels' summation order alone leaves on random
    weights (one row takes the GEMV, 64 rows a cuBLAS GEMM).
JSON plus a markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import environment, random_prompts, write_report
from benchmarks.engine_runs import decode_figure
from benchmarks.roofline import ModelCost, measure_device, model_cost
from benchmarks.teacher_forcing import decode_top1

TOP1_PROMPTS, TOP1_LEN = 64, 256
TF_START, TF_ALONE = 16, 8  # decode teacher forcing: from each prompt's first 16 tokens; 8 of them alone


def share(cost: ModelCost, tp: int) -> ModelCost:
    """What one of `tp` GPUs reads and computes per step (heads, MLP columns, vocab rows and KV heads
    split; the norms' few replicated bytes are left out)."""
    return dataclasses.replace(
        cost,
        step_weight_bytes=cost.step_weight_bytes / tp,
        matmul_params=cost.matmul_params / tp,
        kv_bytes_per_token=cost.kv_bytes_per_token / tp,
        attn_flops_per_ctx_token=cost.attn_flops_per_ctx_token / tp,
    )


def top1(llm, prompts: list[list[int]], alone: bool) -> list[list[int]]:
    """The greedy token at each prompt position (teacher forcing), the prompts in one batch or one by one."""
    from engine import SamplingParams

    sp = SamplingParams(max_tokens=0, prompt_logprobs=1, temperature=0.0)
    groups = [[p] for p in prompts] if alone else [prompts]
    results = [r for g in groups for r in llm.generate(g, [sp] * len(g), use_tqdm=False)]
    return [[lp.top[0][0] for lp in r.prompt_logprobs if lp is not None] for r in results]


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    return sum(x == y for x, y in pairs) / len(pairs)


def allreduce_us(table: list[dict], tp: int, kib: float, path: str) -> float | None:
    """Microseconds of one all-reduce of `kib` KiB on `tp` GPUs, from the nearest measured size above."""
    rows = sorted((r for r in table if r["world"] == tp), key=lambda r: r["kib"])
    for r in rows:
        if r["kib"] >= kib:
            return r[f"{path}_graph_us"]
    return None


def message_kib(cfg: dict, batches: tuple[int, ...] = (1, 64)) -> tuple[int, ...]:
    """The all-reduce message sizes (KiB, rounded up) of a decode step at each batch size."""
    return tuple(sorted({-(-b * cfg["hidden_size"] * 2 // 1024) for b in batches}))


def measured_table(worlds: list[int], cfg: dict, measure=None) -> list[dict]:
    """benchmarks/tp_allreduce.py's rows for `worlds`, measured now at this model's message sizes; a
    world that fails to measure is reported and left out (its columns stay empty)."""
    if measure is None:
        from benchmarks.tp_allreduce import measure
    rows = []
    for world in worlds:
        try:
            rows += measure(world, message_kib(cfg))
        except Exception as exc:  # the decode figures stand without it
            print(f"all-reduce timing on {world} GPUs failed: {exc}", file=sys.stderr, flush=True)
    return rows


def allreduce_table(path: Path, gpu: str | None) -> list[dict]:
    """benchmarks/tp_allreduce.py's rows, if measured on this kind of GPU (another GPU's timings would
    be a guess, and the columns stay empty)."""
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    if data.get("env", {}).get("hardware", {}).get("gpu") != gpu:
        print(f"--allreduce {path}: measured on another GPU than {gpu}; all-reduce columns left empty")
        return []
    return data["rows"]


def step_allreduce(table: list[dict], tp: int, cfg: dict, batch: int) -> dict:
    count = 2 * cfg["num_hidden_layers"] + 1
    kib = batch * cfg["hidden_size"] * 2 / 1024
    out = {"count": count, "message_kib": kib}
    for path in ("nccl", "one_shot"):
        us = allreduce_us(table, tp, kib, path)
        out[f"{path}_ms"] = None if us is None else count * us / 1e3
    return out


def run_tp(args, tp: int, one_shot: bool, fp32_reduce: bool = False) -> dict:
    """One TP size's figures, in this process (a job of its own: the GPUs are whole again after it)."""
    from engine import LLM

    cfg = json.loads((Path(args.model) / "config.json").read_text())
    prompts = random_prompts(random.Random(30), TOP1_PROMPTS, TOP1_LEN, cfg["vocab_size"])
    device = json.loads(args.device_json)
    t0 = time.perf_counter()
    llm = LLM(
        args.model,
        max_num_batched_tokens=16384,
        enable_prefix_caching=False,  # the top-1 passes must not reuse each other's KV
        tensor_parallel_size=tp,
        dtype="bfloat16",
        max_num_seqs=64,
        gpu_memory_utilization=args.gpu_memory_utilization,
        disable_custom_all_reduce=not one_shot,
        tensor_parallel_fp32_reduce=fp32_reduce,
    )
    out = {"tp": tp, "one_shot": one_shot, "fp32_reduce": fp32_reduce, "load_s": time.perf_counter() - t0}
    mine = share(model_cost(args.model), tp)
    out["a"] = decode_figure(llm, mine, device, 1, 128, 256, 3, seed=10)
    out["b"] = decode_figure(llm, mine, device, 64, 1000, 128, 2, seed=20)
    out["top1_batch"] = top1(llm, prompts, alone=False)
    if tp == 1:
        out["top1_alone"] = top1(llm, prompts, alone=True)
    out["top1_decode_batch"] = decode_top1(llm, prompts, TF_START, batch=len(prompts))
    out["top1_decode_alone"] = decode_top1(llm, prompts[: args.tf_alone], TF_START, batch=1)
    Path(args.job_out).write_text(json.dumps(out))  # before the workers stop: a hang there loses nothing
    llm.engine.runner.shutdown()
    return out


def run_job(args, tp: int, one_shot: bool, device: dict, fp32_reduce: bool = False) -> dict | None:
    """run_tp in a child process; None (and its error on stderr) if it failed. With --jobs-dir, a job
    whose result is already there is not run again, and a new result stays there."""
    name = f"tp{tp}_{'one_shot' if one_shot else 'nccl'}_{'fp32' if fp32_reduce else 'bf16'}.json"
    kept = Path(args.jobs_dir) / name if args.jobs_dir else None
    if kept is not None and kept.exists():
        return json.loads(kept.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        result = kept or Path(tmp) / "job.json"
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.tp_bench",
            "--model",
            args.model,
            "--job",
            f"{tp},{int(one_shot)},{int(fp32_reduce)}",
            "--job-out",
            str(result),
            "--device-json",
            json.dumps(device),
            "--gpu-memory-utilization",
            str(args.gpu_memory_utilization),
            "--tf-alone",
            str(args.tf_alone),
        ]
        try:
            code = subprocess.run(cmd, timeout=args.job_timeout_s).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
        if not result.exists():
            print(f"tp={tp} one_shot={one_shot}: job failed ({code})", file=sys.stderr, flush=True)
            return None
        return json.loads(result.read_text())


def summarize(runs: list[dict], table: list[dict], cfg: dict) -> list[dict]:
    """Per run: its figures, and against TP=1 where TP=1 ran (a model too large for one GPU has none)."""
    base = next((r for r in runs if r["tp"] == 1), None)
    rows = []
    for r in runs:
        row = {
            "tp": r["tp"],
            "one_shot": r["one_shot"],
            "fp32_reduce": r.get("fp32_reduce", False),
            "top1_vs_tp1": None if base is None else agreement(r["top1_batch"], base["top1_batch"]),
            "top1_decode_vs_tp1": _against(r, base, "top1_decode_batch"),
            "top1_decode_alone_vs_tp1": _against(r, base, "top1_decode_alone"),
        }
        for fig, batch in (("a", 1), ("b", 64)):
            f = r[fig]
            row[fig] = {
                "tok_s": f["tok_s"],
                "speedup": None if base is None else f["tok_s"] / base[fig]["tok_s"],
                "pct_of_roofline": f["pct_of_roofline"],
                "roofline_tok_s": f["roofline"]["tok_s"],
                "step_ms_p50": f["step_ms_p50"],
                "step_ms_p90": f.get("step_ms_p90"),  # tok/s follows the mean step: the tail shows here
                "allreduce": step_allreduce(table, r["tp"], cfg, batch) if r["tp"] > 1 else None,
            }
        rows.append(row)
    return rows


def _against(run: dict, base: dict | None, key: str) -> float | None:
    """Agreement of `run`'s top-1 list `key` with TP=1's (None without TP=1, or in a run from before the
    decode-mode lists)."""
    if base is None or key not in run or key not in base:
        return None
    return agreement(run[key], base[key])


def decode_self_agreement(base: dict | None) -> float | None:
    """TP=1's decode-mode top-1 at batch 1 against its own at batch 64, on the sequences run alone."""
    if base is None or "top1_decode_alone" not in base:
        return None
    alone = base["top1_decode_alone"]
    return agreement(alone, base["top1_decode_batch"][: len(alone)])


def render(report: dict) -> str:
    env = report["env"]
    lines = [
        f"# Tensor parallelism: {report['model_name']}, decode against TP=1 in the same run",
        "",
        f"{env['hardware'].get('gpu_count')} x {env['hardware'].get('gpu')}, torch "
        f"{env['versions']['torch']}; copy bandwidth {report['device']['copy_bw_GBps']:.0f} GB/s",
        f"Command: `{report['command']}`",
        "",
        f"Teacher-forced top-1, TP=1 one prompt at a time against TP=1 in one batch: "
        f"{_pct(report['top1_tp1_alone_vs_batch'])} (prefill); "
        f"{_pct(report.get('top1_decode_tp1_alone_vs_batch'))} (decode steps, batch 1 against batch 64)",
        "",
        "| TP | all-reduce | (a) tok/s | x TP=1 | % roofline | step ms "
        "| all-reduce ms/step (NCCL / one-shot) | (b) tok/s | x TP=1 | % roofline | step ms p50 / p90 "
        "| all-reduce ms/step | top-1 vs TP=1: prefill | decode, batch 64 | decode, batch 1 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        path = "-" if r["tp"] == 1 else "one-shot" if r["one_shot"] else "NCCL"
        cells = [str(r["tp"]), path + (", fp32 sums" if r.get("fp32_reduce") else "")]
        for fig in ("a", "b"):
            f, ar = r[fig], r[fig]["allreduce"]
            ar_text = "-" if ar is None else f"{_ms(ar['nccl_ms'])} / {_ms(ar['one_shot_ms'])}"
            speedup = "-" if f["speedup"] is None else f"{f['speedup']:.2f}"
            cells += [f"{f['tok_s']:,.1f}", speedup, f"{f['pct_of_roofline']:.1f}"]
            p90 = "" if fig == "a" else f" / {_ms(f.get('step_ms_p90'))}"
            cells += [f"{f['step_ms_p50']:.2f}{p90}"]
            cells += [ar_text]
        cells.append(_pct(r["top1_vs_tp1"]))
        cells += [_pct(r.get("top1_decode_vs_tp1")), _pct(r.get("top1_decode_alone_vs_tp1"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.2f}%"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--allreduce", default="measure", help="'measure' (in this run) or a tp_allreduce JSON")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--paths", default="one-shot,nccl", help="all-reduce paths to run at TP > 1, in order")
    ap.add_argument("--job-timeout-s", type=float, default=300)
    ap.add_argument(
        "--tf-alone", type=int, default=TF_ALONE, help="sequences teacher-forced one at a time (of 64)"
    )
    ap.add_argument("--out", default="benchmarks/reports/gpu/tp_bench")
    ap.add_argument(
        "--reduce", default="bf16", help="at TP > 1, partial sums to all-reduce: bf16, fp32 or both, in order"
    )
    ap.add_argument(
        "--jobs-dir",
        help="keep each job's result here, skipping jobs already there: one run over calls on one host",
    )
    ap.add_argument("--job", help=argparse.SUPPRESS)  # internal: "TP,ONE_SHOT,FP32" run in this process
    ap.add_argument("--job-out", help=argparse.SUPPRESS)
    ap.add_argument("--device-json", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.jobs_dir:
        Path(args.jobs_dir).mkdir(parents=True, exist_ok=True)
    if args.job:
        tp, one_shot, fp32_reduce = (int(v) for v in args.job.split(","))
        run_tp(args, tp, bool(one_shot), bool(fp32_reduce))
        return
    cfg = json.loads((Path(args.model) / "config.json").read_text())
    device = measure_device()
    runs = []
    paths = [p.strip() for p in args.paths.split(",")]
    if not paths or set(paths) - {"one-shot", "nccl"}:
        ap.error("--paths: a comma-separated list of one-shot and nccl")
    sums = [v.strip() for v in args.reduce.split(",")]
    if not sums or set(sums) - {"bf16", "fp32"}:
        ap.error("--reduce: a comma-separated list of bf16 and fp32")
    for tp in (int(t) for t in args.tp.split(",")):
        jobs = [(True, False)] if tp == 1 else [(p == "one-shot", s == "fp32") for p in paths for s in sums]
        for one_shot, wide in jobs:
            if (run := run_job(args, tp, one_shot, device, wide)) is not None:
                runs.append(run)
                a, b = run["a"]["tok_s"], run["b"]["tok_s"]
                print(f"tp={tp} one_shot={one_shot} fp32={wide}: (a) {a:.1f} (b) {b:.1f} tok/s", flush=True)
    env = environment()
    if args.allreduce == "measure":
        table = measured_table(sorted({r["tp"] for r in runs if r["tp"] > 1}), cfg)
    else:
        table = allreduce_table(Path(args.allreduce), env["hardware"].get("gpu"))
    base = next((r for r in runs if r["tp"] == 1), None)
    report = {
        "env": env,
        "device": device,
        "model_name": Path(args.model).name,
        "command": "python -m benchmarks.tp_bench " + " ".join(argv or sys.argv[1:]),
        "top1_tp1_alone_vs_batch": base and agreement(base["top1_alone"], base["top1_batch"]),
        "top1_decode_tp1_alone_vs_batch": decode_self_agreement(base),
        "rows": summarize(runs, table, cfg),
        "runs": [{k: v for k, v in r.items() if not k.startswith("top1")} for r in runs],
    }
    write_report(args.out, report, render(report))


if __name__ == "__main__":
    main()
