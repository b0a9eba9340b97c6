"""`python -m benchmarks.bench --baseline-tree DIR`: the old tree's figures and this tree's, on one host in
one invocation, side by side.

Order: the old tree's whole `python -m benchmarks.bench` runs first (cwd DIR, DIR on PYTHONPATH, the
flags of this command that its CLI knows, into OUT/baseline, with this run's --ckpt-dir so that the
random-weight checkpoints are made once and shared), then this tree's run as usual. This tree's
benchmarks.report reads both runs' parts; OUT/benchmark.json gains "baseline" (the trees and the rows
with old, new and new / old) and OUT/benchmark.md a "Before / after" section.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks import report
from benchmarks.ab_report import bench_ab, bench_ab_markdown
from benchmarks.baseline_tree import Tree, cli_flags, forward_argv, make_trees, tree_env

# this run's own: where it writes and what it compares with; the old run gets its own --out
NOT_FORWARDED = {"--out", "--ckpt-dir", "--baseline-tree", "--job"}


def old_command(
    args, argv: list[str], parser: argparse.ArgumentParser, tree: Tree
) -> tuple[list[str], list[str]]:
    """The old tree's bench command line, and the flags it was not given (its CLI lacks them)."""
    known = cli_flags(tree.root, "benchmarks.bench")
    kept, left = forward_argv(argv, parser, known, NOT_FORWARDED)
    out = (Path(args.out) / "baseline").resolve()
    cmd = [sys.executable, "-m", "benchmarks.bench", *kept, "--out", str(out)]
    return cmd + ["--ckpt-dir", str(Path(args.ckpt_dir).resolve())], left


def run_old(args, argv: list[str], parser: argparse.ArgumentParser) -> dict:
    """Run the baseline tree's bench to completion (before this tree's); returns what the report needs."""
    trees = make_trees(Path(args.baseline_tree))
    old = trees[0]
    cmd, left = old_command(args, argv, parser, old)
    print(f"\n=== baseline tree {old.root} (commit {old.commit}): {' '.join(cmd)}", flush=True)
    if left:
        print(f"=== not passed to the baseline (its CLI lacks them): {' '.join(left)}", flush=True)
    rc = subprocess.run(cmd, cwd=old.root, env=tree_env(dict(os.environ), old.root),
                        timeout=args.budget_s + 600).returncode  # fmt: skip
    print(f"=== baseline tree run: exit code {rc}", flush=True)
    return {"trees": [t.describe() for t in trees], "command": cmd, "cwd": str(old.root), "not_passed": left,
            "exit_code": rc, "out": cmd[cmd.index("--out") + 1]}  # fmt: skip


def write_ab(out: Path, new: dict, base: dict) -> list[dict]:
    """Add the before/after rows to OUT/benchmark.json and OUT/benchmark.md (the old run's parts read
    by this tree's report); returns the rows."""
    old_out = Path(base["out"])
    old = report.collect(old_out) if (old_out / "parts").exists() else {"rows": [], "meta": {}}
    rows = bench_ab(old, new)
    path = Path(out) / "benchmark.json"
    data = json.loads(path.read_text())
    data["baseline"] = {**base, "meta": old.get("meta"), "environment": old.get("environment"), "rows": rows}
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    text = bench_ab_markdown(rows, base["trees"])
    if base["not_passed"]:
        text += f"\n- flags not passed to the baseline (its CLI lacks them): {' '.join(base['not_passed'])}\n"
    with open(Path(out) / "benchmark.md", "a") as f:
        f.write("\n" + text)
    print("\n" + text, flush=True)
    return rows
