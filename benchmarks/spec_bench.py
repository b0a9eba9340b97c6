"""Speculative decoding: decode tok/s against plain decoding of the same target, in the same run.

    python -m benchmarks.spec_bench --target llama-3.1-8b --draft llama-3.2-1b --batches 1,8,64 --out PREFIX

Random weights make real acceptance meaningless, so the mechanism is measured two ways:
* draft = target (the target's own checkpoint as its draft): greedy proposals are always accepted,
  which bounds the gain of each k and shows the cost of drafting and verifying;
* synthetic acceptance (SpeculativeConfig.synthetic_acceptance_rate, benchmarks only): each proposal
  is accepted with probability alpha whatever the models say, for the n-gram proposer (proposals
  padded to k) and for the draft model; alpha = 0 is the worst case, measured with the engine's
  low-acceptance cut-off off (every step verifies k wasted positions) and on (the default policy).
One engine per (proposer, k); alpha is switched between runs on the live engine (the spec sampler's
`synthetic` and the speculator's policy are runtime attributes). Greedy requests of `--prompt`
random tokens and exactly `--gen` new tokens. tok/s counts the tokens emitted after every request's
first token, up to the step in which the first request finishes (the batch stays full), over those
steps' wall time; median of `--reps` after a warm-up run.

The engines' tok/s move together from rep to rep (each rep's prompts meet the same acceptance coins in
every engine) and from process to process with the host's state (clocks, neighbours). `--rounds R`
runs the whole list of engines R times in turn; the table then gives each figure's median over the
rounds and, for every speculating engine, its ratio to n-gram at the same k, alpha and batch, paired
within a round and rep (the median of those ratios), which neither source of noise moves much.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import random
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import ckpt_path, environment, git_commit, write_report

ROOT = Path(__file__).resolve().parents[1]


def steady_tok_s(engine, prompts: list[list[int]], params) -> float:
    """Tokens per second while every request decodes (after all first tokens, before any finishes)."""
    ids = {engine.add_request(p, params) for p in prompts}
    started: set[str] = set()
    tokens, seconds, prev = 0, 0.0, time.perf_counter()
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        full = len(started) == len(ids)
        n = sum(len(d.token_ids) for o in outs for d in o.outputs)
        if any(d.error for o in outs for d in o.outputs):
            raise RuntimeError(f"a request failed: {[d.error for o in outs for d in o.outputs if d.error]}")
        if full and not any(o.finished for o in outs):
            tokens, seconds = tokens + n, seconds + (now - prev)
        started |= {o.request_id for o in outs if any(d.token_ids for d in o.outputs)}
        prev = now
    return tokens / seconds if seconds else 0.0


def run(llm, batch: int, args) -> dict:
    from engine import SamplingParams

    vocab, rng = llm.engine.runner.model_config.vocab_size, random.Random(batch)
    sp = SamplingParams(max_tokens=args.gen, temperature=0.0, ignore_eos=True)
    before = dict(llm.engine.get_stats())
    runs = []
    for _ in range(args.reps + 1):  # the first is a warm-up
        prompts = [[rng.randrange(8, vocab - 8) for _ in range(args.prompt)] for _ in range(batch)]
        runs.append(steady_tok_s(llm.engine, prompts, sp))
    stats = llm.engine.get_stats()
    drafts = stats.get("spec_draft_tokens", 0) - before.get("spec_draft_tokens", 0)
    accepted = stats.get("spec_accepted_tokens", 0) - before.get("spec_accepted_tokens", 0)
    rows = stats.get("spec_verify_rows", 0) - before.get("spec_verify_rows", 0)
    return {
        "tok_s": round(statistics.median(runs[1:]), 1),
        "runs": [round(r, 1) for r in runs[1:]],
        "acceptance": round(accepted / drafts, 3) if drafts else None,
        "mean_emitted": round((accepted + rows) / rows, 2) if rows else None,
    }


def profile_verify(llm, batch: int, args, steps: int = 24) -> list[dict]:
    """GPU time of verify steps by kernel (torch.profiler over `steps` steady steps, every proposal
    rejected so each step verifies k positions per row): where a verify step spends its time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from engine import SamplingParams

    eng, vocab, rng = llm.engine, llm.engine.runner.model_config.vocab_size, random.Random(7)
    sp = SamplingParams(max_tokens=args.gen, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        eng.add_request([rng.randrange(8, vocab - 8) for _ in range(args.prompt)], sp)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(4):  # prefill and the first verify steps
        eng.step()
    sync()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
        sync()
    wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    while eng.has_unfinished():
        eng.step()
    events = [e for e in prof.key_averages() if e.device_time_total > 0 and e.device_type.name == "CUDA"]
    events.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in events) / steps / 1e3
    rows = [{"batch": batch, "kernel": "(all GPU time per step)", "ms_per_step": round(total, 3),
             "wall_ms_per_step": round(wall_ms, 3)}]  # fmt: skip
    for e in events[:12]:
        rows.append(
            {"batch": batch, "kernel": e.key[:90], "ms_per_step": round(e.device_time_total / steps / 1e3, 3)}
        )
    return rows


def configs(args) -> list[tuple[str, dict | None, list]]:
    """(label, speculative_config, [(alpha label, alpha, cut-off on)]) per engine."""
    out = [("plain", None, [(None, None, False)])]
    alphas = [("0 (cut-off off)", 0.0, False), ("0 (default cut-off)", 0.0, True)]
    alphas += [(str(a), a, False) for a in args.alphas if a > 0]
    for k in args.ks:
        if "self" in args.proposers:
            cfg = {"method": "draft_model", "model": str(args.target_dir), "num_speculative_tokens": k}
            out.append((f"draft = target, k={k}", cfg, [("real", None, True)]))
        if "ngram" in args.proposers:
            cfg = {"method": "ngram", "num_speculative_tokens": k, "synthetic_acceptance_rate": 0.0}
            out.append((f"n-gram, k={k}", cfg, alphas))
        if "draft" in args.proposers:
            cfg = {"method": "draft_model", "model": str(args.draft_dir), "num_speculative_tokens": k,
                   "synthetic_acceptance_rate": 0.0}  # fmt: skip
            out.append((f"draft {args.draft}, k={k}", cfg, alphas))
        if "mtp" in args.proposers:
            label = f"gated-LoRA MTP, k={k}"
            heads = [(label, mtp_config(args, k), alphas)]
            if args.mtp_draft_vocab:
                label = f"gated-LoRA MTP, k={k}, draft vocabulary {args.mtp_draft_vocab}"
                heads.append((label, mtp_config(args, k, vocab=True), alphas))
            if args.mtp_fp8:  # the last MTP head above, its weights in float8
                cfg = mtp_config(args, k, vocab=bool(args.mtp_draft_vocab), quantization="fp8")
                heads.append((f"{label}, fp8 head", cfg, alphas))
            out += heads[-1:] if getattr(args, "mtp_heads", "all") == "last" else heads  # last: this k's last
    return out


def mtp_config(args, k: int, vocab: bool = False, **kw) -> dict:
    """gated_lora_mtp with the random head of the target's shape (batch cut-off: its default); `vocab`:
    the head with a draft vocabulary of --mtp-draft-vocab tokens."""
    path = args.mtp_vocab_dir if vocab else args.mtp_dir
    return {"method": "gated_lora_mtp", "model": str(path), "num_speculative_tokens": k,
            "synthetic_acceptance_rate": 0.0, **kw}  # fmt: skip


def measure(label: str, spec: dict | None, alphas, args, batches: list[int]) -> list[dict]:
    """The rows of one engine, built and run in a process of its own: an engine left behind in this
    process (its graphs, pool and threads) would take memory and host time from the next one."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_measure, (label, spec, alphas, args, batches))


def _measure(label: str, spec: dict | None, alphas, args, batches: list[int]) -> list[dict]:
    from engine import LLM

    opts = {"max_num_seqs": max(batches), "max_model_len": args.prompt + args.gen + 32}
    if spec is not None:
        opts["speculative_config"] = spec
    t0 = time.perf_counter()
    llm = LLM(str(args.target_dir), **opts)
    print(f"[{label}] engine ready in {time.perf_counter() - t0:.0f} s", flush=True)
    rows = []
    for alpha_label, alpha, cut_off in alphas:
        if spec is not None:
            eng = llm.engine
            eng.runner.spec.verifier.synthetic = alpha
            rate = eng.config.speculative.disable_below_acceptance if cut_off else 0.0
            eng.speculator.config = dataclasses.replace(eng.speculator.config, disable_below_acceptance=rate)
        for batch in batches:
            row = {"config": label, "alpha": alpha_label, "batch": batch, **run(llm, batch, args)}
            print(row, flush=True)
            rows.append(row)
    return rows


def _k_of(config: str) -> str | None:
    return next((part for part in config.split(", ") if part.startswith("k=")), None)


def summary(rows: list[dict]) -> list[dict]:
    """One row per (config, alpha, batch): tok/s the median over rounds, and `vs_ngram` the median of
    the per-round, per-rep ratios to n-gram's row of the same k, alpha, batch and round."""
    ngram = {(_k_of(r["config"]), r["alpha"], r["batch"], r.get("round", 0)): r for r in rows
             if r["config"].startswith("n-gram")}  # fmt: skip
    out: dict[tuple, dict] = {}
    for r in rows:
        key = (r["config"], r["alpha"], r["batch"])
        agg = out.setdefault(key, {**r, "rounds": [], "ratios": []})
        agg["rounds"].append(r["tok_s"])
        ref = ngram.get((_k_of(r["config"]), r["alpha"], r["batch"], r.get("round", 0)))
        if ref is not None and ref is not r and r.get("runs") and ref.get("runs"):
            agg["ratios"] += [a / b for a, b in zip(r["runs"], ref["runs"]) if b]
    for agg in out.values():
        agg["tok_s"] = round(statistics.median(agg["rounds"]), 1)
        agg["vs_ngram"] = round(statistics.median(agg["ratios"]), 3) if agg["ratios"] else None
    return list(out.values())


def markdown(report: dict) -> str:
    rows = summary(report["rows"])
    base = {r["batch"]: r["tok_s"] for r in rows if r["config"] == "plain"}
    lines = [
        "# Speculative decoding: decode tok/s against plain decoding (same run)",
        "",
        f"Command: `{report['command']}`  ",
        f"Commit {report['commit']}; {report['environment']['hardware'].get('gpu')}; "
        f"{report['environment']['versions']}",
        "",
        f"Rounds: {report.get('rounds', 1)} (tok/s: the median over rounds; per round: their figures in "
        "order; vs n-gram: the median of the ratios paired by round and rep)",
        "",
        "| config | alpha | batch | tok/s | vs plain | vs n-gram | per round | acceptance "
        "| tokens per verify |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        vs = f"{r['tok_s'] / base[r['batch']]:.2f}x" if base.get(r["batch"]) else ""
        vs_ngram = "" if r["vs_ngram"] is None else f"{r['vs_ngram']:.3f}x"
        rounds = " / ".join(f"{t:,.1f}" for t in r["rounds"])
        lines.append(
            f"| {r['config']} | {r['alpha'] or ''} | {r['batch']} | {r['tok_s']:,.1f} | {vs} | {vs_ngram} | "
            f"{rounds} | {'' if r['acceptance'] is None else r['acceptance']} | {r['mean_emitted'] or ''} |"
        )
    if report.get("profile"):
        lines += ["", "GPU time per step by kernel (torch.profiler; verify steps reject every proposal):", ""]
        lines += ["| step | batch | kernel | ms per step | wall ms per step |", "|---|---|---|---|---|"]
        for r in report["profile"]:
            wall = r.get("wall_ms_per_step", "")
            lines.append(f"| {r['step']} | {r['batch']} | {r['kernel']} | {r['ms_per_step']} | {wall} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="llama-3.1-8b")
    ap.add_argument("--draft", default="llama-3.2-1b")
    ap.add_argument(
        "--proposers",
        default="self,ngram,draft",
        help="any of self (draft = target), ngram, draft, mtp (gated_lora_mtp, a random head)",
    )
    ap.add_argument("--ks", default="2,4")
    ap.add_argument("--alphas", default="0.5,0.7,0.9", help="synthetic acceptance rates beside 0")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=192)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--ckpt-dir", type=Path, default=Path("/tmp/minserve_bench"))
    ap.add_argument("--smoke", action="store_true", help="tiny stand-ins of both shapes (a CPU check)")
    ap.add_argument(
        "--profile", action="store_true", help="also profile plain decode and verify steps by kernel"
    )
    ap.add_argument(
        "--mtp-draft-vocab", type=int, default=0, help="also the MTP head drafting among N tokens"
    )
    ap.add_argument(
        "--mtp-fp8",
        action="store_true",
        help="also the last MTP head with its weights in float8 (quantization)",
    )
    ap.add_argument("--rounds", type=int, default=1, help="run the list of engines this many times in turn")
    ap.add_argument(
        "--mtp-heads",
        choices=["all", "last"],
        default="all",
        help="last: only the last MTP engine (the draft-vocabulary or fp8 head when asked for)",
    )
    ap.add_argument("--out", required=True, help="PREFIX for PREFIX.json and PREFIX.md")
    args = ap.parse_args(argv)
    from benchmarks.bench import make_checkpoint

    args.ks = [int(k) for k in args.ks.split(",")]
    args.alphas = [float(a) for a in args.alphas.split(",")]
    args.target_dir = ckpt_path(args.ckpt_dir, args.target, args.smoke)
    args.draft_dir = ckpt_path(args.ckpt_dir, args.draft, args.smoke)
    make_checkpoint(args.target, args.target_dir, smoke=args.smoke)
    if "draft" in args.proposers:
        make_checkpoint(args.draft, args.draft_dir, smoke=args.smoke)
    if "mtp" in args.proposers:
        from scripts.make_mtp import write_mtp_dir

        args.mtp_dir = write_mtp_dir(Path(f"{args.target_dir}-mtp"), args.target_dir, max(args.ks))
        if args.mtp_draft_vocab:
            path, n = Path(f"{args.target_dir}-mtp-vocab{args.mtp_draft_vocab}"), args.mtp_draft_vocab
            args.mtp_vocab_dir = write_mtp_dir(path, args.target_dir, max(args.ks), draft_vocab_size=n)
    batches = [int(b) for b in args.batches.split(",")]
    report = {
        "command": "python -m benchmarks.spec_bench " + " ".join(sys.argv[1:] if argv is None else argv)
    }
    report |= {"commit": git_commit(ROOT), "environment": environment(), "rows": []}
    report["rounds"] = args.rounds
    for round_ in range(args.rounds):
        for label, spec, alphas in configs(args):
            report["rows"] += [r | {"round": round_} for r in measure(label, spec, alphas, args, batches)]
            write_report(args.out, report, markdown(report))  # after each: a timeout keeps what ran
    if args.profile:
        report["profile"] = profile_all(args, batches)
        write_report(args.out, report, markdown(report))
    return 0


def profile_all(args, batches: list[int]) -> list[dict]:
    from engine import LLM

    k = max(args.ks)
    spec = {"method": "ngram", "num_speculative_tokens": k, "synthetic_acceptance_rate": 0.0,
            "disable_below_acceptance": 0.0}  # fmt: skip
    steps = [("plain decode", None), (f"verify k={k}", spec)]
    if "mtp" in args.proposers:  # no batch cut-off: the MTP step itself at every batch
        cut = {"disable_below_acceptance": 0.0, "disable_by_batch_size": max(batches)}
        steps.append((f"MTP verify+draft k={k}", mtp_config(args, k, **cut)))
    out = []
    for name, cfg in steps:
        opts = {"max_num_seqs": max(batches), "max_model_len": args.prompt + args.gen + 32}
        llm = LLM(str(args.target_dir), **opts, **({"speculative_config": cfg} if cfg else {}))
        for batch in [b for b in batches if b <= 8]:  # where a step's cost is the weights' read
            out += [{"step": name, **r} for r in profile_verify(llm, batch, args)]
        del llm
        gc.collect()
    return out


if __name__ == "__main__":
    sys.exit(main())
