"""Host-time A/B of one pure-Python function across trees (benchmarks/sched_host.py, replica_host.py).

The function's source is sent to a subprocess run on each tree's code (the other tree may not have the
benchmark), which prints the median of the per-unit seconds it returns; sizes and trees alternate for
--reps rounds, so that drift on a shared host hits both alike. Reported: the best run per tree and size
(`us`) and the median run (`median_us`), in microseconds, plus a markdown table.
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from benchmarks.baseline_tree import Tree, tree_env
from benchmarks.common import environment, write_report


def parser(doc: str, sizes: str, steps: int, reps: int, out: str) -> argparse.ArgumentParser:
    """The options both benchmarks take: --SIZES (comma-separated), --steps, --reps, --baseline-tree,
    --out."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument(f"--{sizes}", default="64,256")
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--reps", type=int, default=reps)
    ap.add_argument("--baseline-tree", type=Path)
    ap.add_argument("--out", default=out)
    return ap


def write(out: str, module: str, argv: list[str] | None, trees: list[Tree], facts: dict, markdown) -> None:
    """The report: host, command, trees and `facts` (the sizes, reps and alternate()'s figures), as
    JSON, and the markdown `markdown(report)` makes of it."""
    command = f"python -m benchmarks.{module} " + " ".join(argv or sys.argv[1:])
    report = {"env": environment(), "command": command, "trees": [t.describe() for t in trees], **facts}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    write_report(out, report, markdown(report))


def run_source(root: Path, func: Callable, args: tuple, prelude: str = "") -> float:
    """Median microseconds of `func(*args)`'s list of seconds, run in a subprocess on `root`'s code."""
    call = f"print(statistics.median({func.__name__}(*{args!r})))"
    code = f"import statistics, time\n{prelude}\n{inspect.getsource(func)}\n{call}"
    env = tree_env(dict(os.environ), root)
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{root}: {out.stderr[-2000:]}")
    return 1e6 * float(out.stdout.strip().splitlines()[-1])


def alternate(trees: list[Tree], sizes: list[int], reps: int, measure: Callable[[Path, int], float]) -> dict:
    """{"runs", "us", "median_us"}: per tree name and size, every run's microseconds, the best, the median."""
    runs: dict[str, dict[str, list[float]]] = {t.name: {str(n): [] for n in sizes} for t in trees}
    for _ in range(reps):
        for n in sizes:
            for tree in trees:
                runs[tree.name][str(n)].append(measure(tree.root, n))
    return {
        "runs": runs,
        "us": {t: {n: min(v) for n, v in by.items()} for t, by in runs.items()},
        "median_us": {t: {n: statistics.median(v) for n, v in by.items()} for t, by in runs.items()},
    }


def table(report: dict, title: str, what: str, sizes: list[int], digits: int) -> str:
    """The report's markdown: title, command and host, trees, then one row per size (best runs)."""
    names = [t["name"] for t in report["trees"]]
    lines = [f"# {title}", "", f"`{report['command']}`; Python {report['env']['versions']['python']}, "
             f"{report['env']['hardware']['cpu']}; best of {report['reps']} runs, median of each", "",
             "Trees: " + ", ".join(f"{t['name']} = {t.get('commit')}" for t in report["trees"]), "",
             f"| {what} | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]  # fmt: skip
    for n in sizes:
        lines.append(f"| {n} | " + " | ".join(f"{report['us'][t][str(n)]:.{digits}f}" for t in names) + " |")
    return "\n".join(lines) + "\n"
