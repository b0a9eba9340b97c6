"""Running a benchmark with the code of another tree (`--baseline-tree DIR`), for a before/after on one host.

    git worktree add /tmp/base 53138e1        # or: git archive 53138e1 | tar -x -C /tmp/base
    python -m benchmarks.serve_overhead --baseline-tree /tmp/base ...
    python -m benchmarks.bench --baseline-tree /tmp/base ...

The old code runs in subprocesses with cwd=DIR and DIR in place of this repo on PYTHONPATH (an entry
ahead of the editable install, which Python consults last), so `import engine` there is DIR's engine;
load clients and reports stay this tree's. An old CLI may lack newer flags: `forward_argv` passes it only
the flags its `--help` lists, and says which it left out.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import git_commit
from benchmarks.gpu_busy import tree_has_trace

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Tree:
    """One side of a before/after: "new" (this repo) or "old" (the baseline tree)."""

    name: str
    root: Path
    commit: str | None
    has_trace: bool  # its engine core handles the kernel-trace signals (benchmarks/gpu_busy.py)

    def describe(self) -> dict:
        return {
            "name": self.name,
            "root": str(self.root),
            "commit": self.commit,
            "kernel_trace": self.has_trace,
        }


def tree_commit(root: Path) -> str | None:
    """The commit checked out at `root` when it is a git work tree of its own (an extract has none)."""
    out = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=root, capture_output=True, text=True)
    if out.returncode or Path(out.stdout.strip()).resolve() != Path(root).resolve():
        return None
    return git_commit(root)


def make_trees(baseline: Path | None) -> list[Tree]:
    """The trees to measure, in the order they run: the baseline first (when given), then this one."""
    new = Tree("new", ROOT, git_commit(ROOT), tree_has_trace(ROOT))
    if baseline is None:
        return [new]
    root = Path(baseline).resolve()
    if not (root / "engine").is_dir() or not (root / "benchmarks").is_dir():
        raise SystemExit(f"--baseline-tree {baseline}: no engine/ and benchmarks/ there (a minserve tree?)")
    if root == ROOT:
        raise SystemExit("--baseline-tree: that is this tree")
    return [Tree("old", root, tree_commit(root), tree_has_trace(root)), new]


def tree_env(env: dict, root: Path) -> dict:
    """`env` with `root` in place of this repo (or of any other tree) on PYTHONPATH."""
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    trees = {str(ROOT), str(root)}
    at = next((i for i, p in enumerate(path) if p in trees), 0)
    path = [p for p in path if p not in trees]
    path.insert(min(at, len(path)), str(root))
    return {**env, "PYTHONPATH": os.pathsep.join(path)}


def cli_flags(root: Path, module: str, env: dict | None = None) -> set[str]:
    """The long options that `python -m MODULE --help` of the tree at `root` lists."""
    env = tree_env(dict(os.environ) if env is None else env, root)
    cmd = [sys.executable, "-m", module, "--help"]
    out = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    if out.returncode:
        raise RuntimeError(f"{module} --help in {root} failed: {out.stderr[-800:]}")
    return set(re.findall(r"(?<![\w-])(--[A-Za-z0-9][\w-]*)", out.stdout))


def forward_argv(
    argv: list[str], parser: argparse.ArgumentParser, known: set[str], drop: set[str]
) -> tuple[list[str], list[str]]:
    """argv for an older CLI: this CLI's options (split by `parser`, which knows which take a value)
    that `known` lists and `drop` does not; returns (kept, left out). Positionals are kept."""
    takes_value = {opt: action.nargs != 0 for action in parser._actions for opt in action.option_strings}
    kept, left, i = [], [], 0
    while i < len(argv):
        flag, eq, _ = argv[i].partition("=")
        n = 1 if eq or flag not in takes_value or not takes_value[flag] else 2
        group, i = argv[i : i + n], i + n
        if not flag.startswith("-"):
            kept += group
        elif flag in known and flag not in drop:
            kept += group
        elif flag not in drop:
            left.append(flag)
    return kept, left
