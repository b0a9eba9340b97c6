"""Before/after merging (benchmarks/ab_report.py), the baseline tree's command line and environment
(benchmarks/baseline_tree.py) and the GPU-busy probe (benchmarks/gpu_busy.py) against hand-computed values."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.ab_report import bench_ab, serve_ab, serve_ab_markdown, side_by_side
from benchmarks.baseline_tree import ROOT, forward_argv, tree_env
from benchmarks.gpu_busy import BusyProbe, dmon_summary, parse_dmon, tree_has_trace


def _run(tree: str, stack: str, users: int, tok_s: float, p50: float, p99: float, busy=None, sm=None) -> dict:
    return {"variant": "default" if stack != "offline" else "-", "stack": stack, "users": users, "tree": tree,
            "summary": {"output_tok_s": tok_s, "ttft_ms": {"p50": p50, "p99": p99}},
            "gpu_busy": {"trace": {"busy_fraction": busy}, "dmon": {"sm_mean": sm}}}  # fmt: skip


def test_side_by_side_ratios_and_order() -> None:
    old = {"a": {"x": 2.0, "y": 10.0}, "gone": {"x": 1.0}}
    new = {"b": {"x": 5.0}, "a": {"x": 3.0, "y": 0.0}}
    rows = side_by_side(old, new, ("x", "y"))
    assert [r["key"] for r in rows] == ["b", "a", "gone"]  # new's order, then old-only keys
    assert rows[0]["x"] == {"old": None, "new": 5.0, "ratio": None}
    assert rows[1]["x"] == {"old": 2.0, "new": 3.0, "ratio": 1.5} and rows[1]["y"]["ratio"] == 0.0
    assert rows[2]["x"] == {"old": 1.0, "new": None, "ratio": None}
    assert side_by_side({"k": {"x": 0.0}}, {"k": {"x": 1.0}}, ("x",))[0]["x"]["ratio"] is None  # old 0


def test_serve_ab_rows() -> None:
    runs = [
        _run("old", "offline", 64, 7335.0, 59.0, 120.0),
        _run("new", "offline", 64, 11002.5, 29.5, 60.0),
        _run("old", "served", 64, 9445.0, 48.0, 200.0, busy=None, sm=52.0),  # old core: no trace
        _run("new", "served", 64, 17001.0, 24.0, 50.0, busy=0.9, sm=91.0),
        {"variant": "default", "stack": "served", "users": 256, "tree": "new", "error": "RuntimeError: x"},
    ]
    rows = {(r["key"]["stack"], r["key"]["users"]): r for r in serve_ab(runs)}
    off, served = rows["offline", 64], rows["served", 64]
    assert off["out_tok_s"]["ratio"] == pytest.approx(1.5) and off["ttft_p50_ms"]["ratio"] == pytest.approx(
        0.5
    )
    assert served["out_tok_s"] == {"old": 9445.0, "new": 17001.0, "ratio": pytest.approx(1.8)}
    assert served["ttft_p50_ms"]["ratio"] == pytest.approx(0.5) and served["ttft_p99_ms"]["ratio"] == 0.25
    assert served["gpu_busy_trace"] == {"old": None, "new": 0.9, "ratio": None}
    assert served["gpu_sm_dmon"]["ratio"] == pytest.approx(1.75)
    assert rows["served", 256]["out_tok_s"] == {"old": None, "new": None, "ratio": None}
    trees = [
        {"name": "old", "root": "/b", "commit": "53138e1"},
        {"name": "new", "root": "/n", "commit": None},
    ]
    report = {"baseline": serve_ab(runs), "trees": trees}
    md = "\n".join(serve_ab_markdown(report))
    assert "| default | served | 64 | 9,445 | 17,001 | 1.80 | 48.0 | 24.0 | 0.50 |" in md
    assert "| - | 0.900 | - | 52.0 | 91.0 | 1.75 |" in md and "old: /b (commit 53138e1)" in md
    assert serve_ab_markdown({"runs": runs}) == []  # no baseline: no section


def test_bench_ab_rows() -> None:
    def row(fig: str, value: float, pct: float) -> dict:
        return {"figure": fig, "system": "engine", "model": "llama-3.2-1b", "metric": "decode tok/s, batch 1",
                "value": value, "pct_of_roofline": pct}  # fmt: skip

    old = {"rows": [row("a", 400.0, 40.0), row("c", 11123.0, 41.8)]}
    new = {"rows": [row("a", 392.0, 39.2), row("c", 16684.5, 62.7)]}
    rows = {r["key"]["figure"]: r for r in bench_ab(old, new)}
    assert rows["a"]["tok_s"]["ratio"] == pytest.approx(0.98) and rows["c"]["tok_s"][
        "ratio"
    ] == pytest.approx(1.5)
    assert rows["c"]["pct_of_roofline"] == {"old": 41.8, "new": 62.7, "ratio": pytest.approx(1.5)}


def test_forward_argv_keeps_what_the_old_cli_knows() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--suite")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--new-knob", type=int)
    p.add_argument("--out")
    argv = ["--suite", "a,c", "--smoke", "--new-knob", "3", "--out=/x", "--budget-s=60"]
    kept, left = forward_argv(argv, p, known={"--suite", "--smoke", "--budget-s"}, drop={"--out"})
    assert kept == ["--suite", "a,c", "--smoke", "--budget-s=60"] and left == ["--new-knob"]


def test_tree_env_puts_the_tree_in_place_of_this_repo() -> None:
    env = {"PYTHONPATH": os.pathsep.join(["/tmp/pylib", str(ROOT), "/other"]), "X": "1"}
    old = tree_env(env, Path("/base"))
    assert old["PYTHONPATH"].split(os.pathsep) == ["/tmp/pylib", "/base", "/other"] and old["X"] == "1"
    assert tree_env({"PYTHONPATH": "/a"}, Path("/base"))["PYTHONPATH"] == os.pathsep.join(["/base", "/a"])
    assert tree_env({}, Path("/base"))["PYTHONPATH"] == "/base"


DMON = """#Date       Time        gpu    sm   mem   enc   dec   jpg   ofa
#YYYYMMDD   HH:MM:SS    Idx     %     %     %     %     %     %
 20260101   12:00:00      0    10     1     0     0     0     0
 20260101   12:00:01      0    40     5     0     0     0     0
garbage line
 20260101   12:00:01      1     2     0     0     0     0     0
#Date       Time        gpu    sm   mem   enc   dec   jpg   ofa
 20260101   12:00:02      0    -      5     0     0     0     0
 20260101   12:00:03      0    60     5     0     0     0     0
 20260101   12:00:04      0    95     5     0     0     0     0
 20260101   12:00:05      0    99     5     0     0     0     0
"""


def test_dmon_parse_and_window() -> None:
    samples = parse_dmon([(0.0, line) for line in DMON.splitlines()])
    assert len(samples) == 7 and samples[3]["sm"] is None and samples[2]["gpu"] == "1"
    t0 = time.mktime(time.strptime("20260101 12:00:00", "%Y%m%d %H:%M:%S")) + 0.4
    s = dmon_summary(samples, t0, t0 + 4.0)  # samples stamped 12:00:01 .. 12:00:04
    assert s["gpu"] == "0" and s["samples"] == 3  # 40, 60, 95 ('-' left out)
    assert s["sm_mean"] == pytest.approx(65.0) and s["sm_p50"] == 60
    assert s["gpus"]["1"] == {"samples": 1, "sm_mean": 2.0, "sm_p50": 2}
    plain = parse_dmon([(5.0, "# gpu    sm   mem"), (5.0, "# Idx     %     %"), (6.0, "    0    33     1")])
    assert plain == [{"ts": 6.0, "gpu": "0", "sm": 33}]  # no Date / Time: the read time
    assert dmon_summary(plain, 7.0, 9.0)["sm_mean"] is None


FAKE_CORE = """
import json, os, signal, sys, time
d, n, t = sys.argv[1], [0], [None]
def start(*_): t[0] = time.monotonic()
def stop(*_):
    w = time.monotonic() - t[0]
    r = {"pid": os.getpid(), "window_s": w, "busy_s": w / 4, "busy_fraction": 0.25, "kernels": 7}
    r["device"] = "fake"
    open(os.path.join(d, f"kernel_busy_{os.getpid()}_{n[0]}.json"), "w").write(json.dumps(r)); n[0] += 1
signal.signal(signal.SIGUSR1, start); signal.signal(signal.SIGUSR2, stop)
print("ready", flush=True)
while True: time.sleep(0.05)
"""


def test_busy_probe_signals_a_core_and_reads_its_window(tmp_path: Path) -> None:
    """A stand-in core (its command line names engine.core.process, as the real one's does) in a session
    of its own answers SIGUSR1 / SIGUSR2 with its window file."""
    cmd = [sys.executable, "-c", FAKE_CORE, str(tmp_path), "engine.core.process"]
    core = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert core.stdout.readline().strip() == "ready"
        probe = BusyProbe(core.pid, tmp_path, wait_s=10).start()
        time.sleep(0.3)
        busy = probe.stop()
        assert busy["trace"]["busy_fraction"] == 0.25 and busy["trace"]["cores"][0]["pid"] == core.pid
        assert json.loads((tmp_path / f"kernel_busy_{core.pid}_0.json").read_text())["kernels"] == 7
        assert busy["window_s"] >= 0.3 and "sm_mean" in busy["dmon"]
        again = BusyProbe(core.pid, tmp_path, wait_s=10).start().stop()  # the next window: file _1
        assert (tmp_path / f"kernel_busy_{core.pid}_1.json").exists() and again["trace"][
            "busy_fraction"
        ] == 0.25
        unsignalled = BusyProbe(core.pid, None, "old core").start().stop()
        assert unsignalled["trace"] == {"busy_fraction": None, "reason": "old core"} and core.poll() is None
    finally:
        core.kill()
        core.wait()


def test_tree_has_trace(tmp_path: Path) -> None:
    assert tree_has_trace(ROOT) is ("SIGUSR1" in (ROOT / "engine/core/process.py").read_text())
    (tmp_path / "engine" / "core").mkdir(parents=True)
    assert not tree_has_trace(tmp_path)
    (tmp_path / "engine" / "core" / "process.py").write_text("def main(): pass\n")
    assert not tree_has_trace(tmp_path)


def test_overhead_markdown_shows_both_busy_figures() -> None:
    from benchmarks.serve_summary import overhead_markdown

    run = _run("new", "served", 64, 900.0, 20.0, 40.0, busy=0.9, sm=91.4)
    run["gpu_busy"]["dmon"] |= {"sm_p50": 93, "reason": None}
    old = _run("old", "served", 64, 500.0, 40.0, 80.0)
    old["gpu_busy"]["trace"]["reason"] = "not measured: no SIGUSR1 handler"
    report = {"runs": [old, run], "trees": [{"name": "old"}, {"name": "new"}], "model": "m", "settings": {}}
    md = overhead_markdown(report)
    assert "| new | default | served | 64 | 900 | - | - | 90.0% | 91 / 93 | 20.0 | 40.0 |" in md
    assert "| old | default | served | 64 | 500 | - | - | - | - | 40.0 |" in md
    assert "- trace: not measured: no SIGUSR1 handler (old served 64)" in md
