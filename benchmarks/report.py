"""Merge the job parts of a benchmark run into benchmark.json, benchmark.md and benchmark.png.

    python -m benchmarks.report --out benchmarks/reports            # rebuild from <out>/parts/
    python -m benchmarks.report --out benchmarks/reports --replot   # markdown + PNG from benchmark.json only
    python -m benchmarks.report --out DIR --serve RUN               # add a serving run (serve_client's)
    python -m benchmarks.report --out DIR --merge RUN1 RUN2         # one report from split GPU runs

The PNG needs matplotlib; without it the PNG is skipped with a note (re-plot elsewhere with --replot).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from benchmarks.serve_summary import summarize_serving

NAN = float("nan")


def _row(fig, system, model, metric, value, roof=NAN, pct=NAN, note=""):
    return {"figure": fig, "system": system, "model": model, "metric": metric, "value": value,
            "roofline": roof, "pct_of_roofline": pct, "note": note}  # fmt: skip


def _measured(fig: str, system: str, model: str, metric: str, d: dict, note: str) -> dict:
    return _row(fig, system, model, metric, d["tok_s"], d["roofline"]["tok_s"], d["pct_of_roofline"], note)


def _decode_note(d: dict) -> str:
    note = (
        f"step p50 {d['step_ms_p50']:.2f} ms, p90 {d['step_ms_p90']:.2f} ms; weights read "
        f"{d['weight_GBps']:.4g} GB/s ({d['roofline']['bound']}-bound roofline)"
    )
    return note + _power_note(d.get("power"), d["step_ms_p50"])


def _power_note(p: dict | None, step_ms: float) -> str:
    """SM clock, board power and energy per step (power x step time) over the timed steps, when sampled."""
    if not p:
        return ""
    return (
        f"; SM clock p50 {p['sm_mhz_p50']:,.0f} of {p['max_sm_mhz']:,.0f} MHz, board {p['watts_p50']:.0f} W "
        f"p50 of a {p['limit_watts']:.0f} W limit, power-capped in {p['power_capped_pct']:.0f}% of samples, "
        f"~{p['watts_p50'] * step_ms:,.0f} mJ per step"
    )


def rows_for(part: dict) -> list[dict]:
    """Table rows of one job part; a failed job gives one row that says why."""
    kind, model, res = part.get("kind"), part.get("model"), part.get("results") or {}
    if kind in ("env", "ckpt"):
        return []
    system = "transformers" if kind == "hf" else ("engine, eager" if part.get("eager") else "engine")
    if part.get("kv_cache_dtype", "auto") != "auto":
        system += f", {part['kv_cache_dtype']} KV"
    if part.get("status") != "ok":
        figs = ",".join(part.get("figures") or [])
        why = f"{part.get('status')}: {part.get('error', '')[:160]}"
        return [_row(figs, system, model, "-", NAN, note=why)]
    rows = []
    labels = {"a": "decode tok/s, batch 1", "b": "decode tok/s, batch {batch} @ {prompt_tokens}+ ctx"}
    for fig, label in labels.items():
        if fig in res:
            rows.append(
                _measured(fig, system, model, label.format(**res[fig]), res[fig], _decode_note(res[fig]))
            )
    c = res.get("c", {})
    for key, fig in (("full", "c"), ("subset", "c-subset")):
        if key in c:
            d = c[key]
            note = (
                f"{d['output_tokens']:,} output tokens in {d['wall_s']:.1f} s, T={d.get('temperature', '')}"
            )
            if len(d.get("tok_s_runs", [])) > 1:
                note += "; median of runs at " + ", ".join(f"{t:,.0f}" for t in d["tok_s_runs"]) + " tok/s"
            note += f"; WARNING: {d['warning']}" if d.get("warning") else ""
            rows.append(_measured(fig, system, model, f"output tok/s, {d['requests']} requests", d, note))
    return rows


def collect(out: Path) -> dict:
    parts_dir = out / "parts"
    meta = json.loads((parts_dir / "_meta.json").read_text()) if (parts_dir / "_meta.json").exists() else {}
    parts = {p.stem: json.loads(p.read_text()) for p in sorted(parts_dir.glob("*.json")) if p.stem != "_meta"}
    order = meta.get("plan") or list(parts)
    env = parts.get("env", {}).get("results", {})
    rows = [r for name in order if name in parts for r in rows_for(parts[name])]
    old = out / "benchmark.json"
    serving = json.loads(old.read_text()).get("serving") if old.exists() else None
    jobs = {k: parts[k] for k in order if k in parts}
    return {"meta": meta, "environment": env, "rows": rows, "jobs": jobs, "serving": serving}


def _fmt(x, digits=0) -> str:
    if isinstance(x, (int, float)) and not (isinstance(x, float) and math.isnan(x)):
        return f"{x:,.{digits}f}"
    return "-"


def table(rows: list[dict], with_notes: bool = True) -> str:
    head = ["figure", "system", "model", "metric", "measured", "roofline", "% of roofline"]
    head += ["notes"] if with_notes else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [
            r["figure"],
            r["system"],
            r["model"] or "",
            r["metric"],
            _fmt(r["value"], 1),
            _fmt(r["roofline"], 0),
            _fmt(r["pct_of_roofline"], 1),
        ]
        lines.append("| " + " | ".join(cells + ([r["note"]] if with_notes else [])) + " |")
    return "\n".join(lines)


def _header(data: dict) -> list[str]:
    meta, env = data["meta"], data["environment"]
    hw, ver, dev = env.get("hardware", {}), env.get("versions", {}), env.get("device", {})
    gpu = (
        f"{hw.get('gpu')} ({hw.get('sm_count')} SMs, {hw.get('gpu_memory_GiB')} GiB)"
        if hw.get("gpu")
        else "CPU"
    )
    smoke = " (SMOKE: tiny models on CPU, not real figures)" if meta.get("smoke") else ""
    lines = ["# minserve benchmarks" + smoke, ""]
    if meta:
        lines.append(
            f"- Command: `{meta.get('command', '?')}` (git {meta.get('git')}, {meta.get('started')}, "
            f"{_fmt(meta.get('wall_s'), 0)} s)"
        )
        lines.append(f"- Sizes: `{json.dumps(meta.get('sizes', {}))}`")
    if env:
        lines += [
            f"- Hardware: {gpu}; host {env.get('hostname')}, {hw.get('cpu_count')} CPUs; "
            f"{hw.get('nvidia_smi') or ''}",
            "- Versions: " + ", ".join(f"{k} {v}" for k, v in ver.items()),
            f"- Measured ceilings: copy {_fmt(dev.get('copy_bw_GBps'), 0)} GB/s (read + write of a "
            f"{_fmt((dev.get('copy_bytes') or 0) / 2**20, 0)} MiB device copy), matmul "
            f"{_fmt(dev.get('matmul_TFLOPs'), 1)} TFLOP/s "
            f"({dev.get('matmul_dtype')} n={dev.get('matmul_n')})",
        ]
    return lines + [""]


NOTES = """Method. (a)/(b): greedy, ignore_eos, random prompts; decode timed per engine step after every
request's first token (prefill excluded); median of the timed repetitions after a warm-up. Roofline of a
decode step: max(bytes / copy bandwidth, FLOPs / matmul rate), bytes = the weights a step multiplies with
(once per step) + every sequence's KV cache; "weights read" = those weight bytes / time per step.
(c): nano-vllm's workload (random.seed(0); 256 prompts of randint(100, 1024) ids, then 256 max_tokens
randint(100, 1024): 133,966 output tokens), ignore_eos, temperature 0.6, output tokens / wall time of
generate. Its roofline is a lower bound for the whole batch: max(output) weight reads + every generated
token's KV read, or FLOPs, whichever takes longer. c-subset: the first requests only, run by both
systems (transformers' continuous batching is too slow for all 256 in the time budget)."""


def render(data: dict, out: Path) -> str:
    lines = _header(data) + [table(data["rows"]), ""]
    bad = {k: v for k, v in data["jobs"].items() if v.get("status") != "ok"}
    lines += [f"- job {k}: {v.get('status')}: {v.get('error', '')}" for k, v in bad.items()]
    cfg = {k: v["results"].get("engine_options") for k, v in data["jobs"].items()
           if v.get("status") == "ok" and "engine_options" in v.get("results", {})}  # fmt: skip
    lines += ["", "Engine options per job: `" + json.dumps(cfg) + "`", ""]
    if data.get("serving"):
        from benchmarks.serve_summary import serving_markdown

        lines += [serving_markdown(data["serving"]), ""]
    lines += [NOTES, ""]
    text = "\n".join(lines)
    (out / "benchmark.md").write_text(text)
    return text


def plot(data: dict, out: Path) -> str:
    """One panel per figure: measured tok/s per system next to its roofline. Returns a status line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "benchmark.png skipped: matplotlib is not installed (re-plot with --replot where it is)"
    rows = [r for r in data["rows"] if isinstance(r["value"], (int, float)) and not math.isnan(r["value"])]
    panels = sorted({(r["figure"], r["model"]) for r in rows})
    if not panels:
        return "benchmark.png skipped: no measured rows"
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.8), squeeze=False)
    for ax, (f, model) in zip(axes[0], panels):
        sel = [r for r in rows if (r["figure"], r["model"]) == (f, model)]
        bars = ax.bar([r["system"] for r in sel], [r["value"] for r in sel], color="tab:blue")
        pct = ["" if math.isnan(r["pct_of_roofline"]) else f"\n{r['pct_of_roofline']:.0f}%" for r in sel]
        labels = [f"{r['value']:,.0f}{p}" for r, p in zip(sel, pct)]
        ax.bar_label(bars, labels=labels, fontsize=7)
        roof = max((r["roofline"] for r in sel if not math.isnan(r["roofline"])), default=NAN)
        if not math.isnan(roof):
            ax.axhline(roof, color="tab:red", linestyle="--", label=f"roofline {roof:,.0f}")
            ax.legend(fontsize=7)
        ax.set_title(f"({f}) {model}", fontsize=9)
        ax.set_ylabel("tok/s")
        ax.tick_params(axis="x", labelsize=7, rotation=15)
    gpu = data["environment"].get("hardware", {}).get("gpu") or "CPU"
    fig.suptitle(f"minserve vs transformers on {gpu}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "benchmark.png", dpi=120)
    plt.close(fig)
    return f"wrote {out / 'benchmark.png'}"


def short_table(data: dict) -> str:
    lines = [f"{'figure':9} {'system':14} {'model':13} {'measured':>11} {'roofline':>10} {'%':>6}"]
    for r in data["rows"]:
        lines.append(
            f"{r['figure']:9} {r['system']:14} {r['model'] or '':13} {_fmt(r['value'], 1):>11} "
            f"{_fmt(r['roofline'], 0):>10} {_fmt(r['pct_of_roofline'], 1):>6}"
        )
    if data.get("serving"):
        s = data["serving"]
        for m in ("ttft_ms", "itl_ms"):
            q = s.get(m) or {}
            lines.append(f"serve {m}: " + " ".join(f"{k} {_fmt(q.get(k), 1)}" for k in ("p50", "p90", "p99")))
    return "\n".join(lines)


def write(data: dict, out: Path) -> None:
    (out / "benchmark.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
    render(data, out)
    print(plot(data, out))


def merge(runs: list[Path], out: Path) -> None:
    """Copy the parts of several runs into <out>/parts (a later run's job replaces an earlier one's
    unless the later one did not succeed), with a meta listing every run; then build the report."""
    parts: dict[str, dict] = {}
    metas, serving = [], None
    for run in map(Path, runs):
        src = run / "parts"
        if (src / "_meta.json").exists():
            metas.append(json.loads((src / "_meta.json").read_text()))
        for f in sorted(src.glob("*.json")):
            part = json.loads(f.read_text())
            if f.stem != "_meta" and (f.stem not in parts or part.get("status") == "ok"):
                parts[f.stem] = part
        old = run / "benchmark.json"
        serving = (json.loads(old.read_text()).get("serving") if old.exists() else None) or serving
    if not metas:
        raise SystemExit(f"--merge: no parts/_meta.json under {', '.join(map(str, runs))}")
    meta = {**metas[-1], "command": " ; ".join(m.get("command", "?") for m in metas), "runs": metas,
            "plan": list(dict.fromkeys(n for m in metas for n in m.get("plan", []))),
            "wall_s": sum(m.get("wall_s") or 0 for m in metas)}  # fmt: skip
    (out / "parts").mkdir(parents=True, exist_ok=True)
    for stale in (out / "parts").glob("*.json"):
        stale.unlink()  # everything was read above, so --out may be one of the runs
    for name, part in {"_meta": meta, **parts}.items():
        (out / "parts" / f"{name}.json").write_text(json.dumps(part, indent=2, default=str) + "\n")
    if serving:
        (out / "benchmark.json").write_text(json.dumps({"serving": serving}) + "\n")
    build(out)


def build(out: Path) -> dict:
    """Rebuild everything from <out>/parts and print the short table (the last thing a run prints)."""
    out = Path(out)
    data = collect(out)
    write(data, out)
    print(f"\nreport: {out / 'benchmark.md'}\n" + short_table(data), flush=True)
    return data


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/reports")
    p.add_argument("--replot", action="store_true", help="markdown + PNG from benchmark.json only")
    p.add_argument("--serve", help="a directory holding a serve_client summary.json")
    p.add_argument(
        "--merge", nargs="+", metavar="RUN", help="output directories of runs to combine into --out"
    )
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.merge:
        merge(args.merge, out)
        return
    if args.replot or args.serve:
        data = json.loads((out / "benchmark.json").read_text()) if (out / "benchmark.json").exists() else None
        if data is None:
            data = collect(out) if (out / "parts").exists() else {"meta": {}, "environment": {}, "rows": [],
                                                                   "jobs": {}, "serving": None}  # fmt: skip
        if args.serve:
            data["serving"] = summarize_serving(Path(args.serve))
        write(data, out)
        print(short_table(data))
    else:
        build(out)


if __name__ == "__main__":
    main()
