"""The benchmark harness end to end on tiny checkpoints (CPU), and its workload / cost arithmetic.

References: nano-vllm's published output-token total for its workload (133,966) and a direct draw with
the `random` module; parameter counts from scripts.model_shapes (not from the checkpoint files the
roofline reads); the engine's own ignore_eos contract (every request yields exactly max_tokens).
"""

from __future__ import annotations

import json
import random

import pytest

from benchmarks.common import Sizes, nanovllm_workload
from benchmarks.roofline import model_cost
from scripts.make_model import make_model
from scripts.model_shapes import get_spec, param_count


def test_nanovllm_workload_matches_its_published_total_and_a_direct_draw():
    prompts, max_tokens = nanovllm_workload(Sizes(), vocab_size=151936)
    assert sum(max_tokens) == 133_966
    random.seed(0)  # nano-vllm's bench.py, verbatim in its order of draws
    ref_prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
    ref_max = [random.randint(100, 1024) for _ in range(256)]
    assert prompts == ref_prompts and max_tokens == ref_max


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen3"])  # untied and tied lm_head
def test_model_cost_counts_the_weights_a_decode_step_reads(tmp_path, name):
    spec = get_spec(name)
    cost = model_cost(make_model(name, tmp_path / name), dtype_bytes=2)
    embed = spec.vocab_size * spec.hidden_size
    assert cost.weight_bytes_total == 2 * param_count(spec)
    # the input embedding is a row gather; only a tied lm_head reads that matrix in full
    assert cost.step_weight_bytes == 2 * (param_count(spec) - (0 if spec.tie_word_embeddings else embed))
    assert cost.kv_bytes_per_token == spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * 2
    fp8_kv = model_cost(tmp_path / name, dtype_bytes=2, kv_dtype_bytes=1)  # kv_cache_dtype="fp8"
    assert fp8_kv.kv_bytes_per_token == spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim
    assert fp8_kv.step_weight_bytes == cost.step_weight_bytes


def test_model_cost_reads_a_quantised_checkpoint_at_its_stored_bytes(tmp_path):
    """FP8 block-scaled decoder weights cost one byte each; the float tensors (embedding, head, norms,
    scales) are costed in the serving dtype, as in the bf16 checkpoint of the same shape."""
    spec = get_spec("tiny")
    plain = model_cost(make_model("tiny", tmp_path / "plain"), dtype_bytes=2)
    fp8 = model_cost(make_model("tiny", tmp_path / "fp8", quant="fp8-block"), dtype_bytes=2)
    h, i = spec.hidden_size, spec.intermediate_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    linears = spec.num_layers * (h * (q + 2 * kv) + q * h + 3 * h * i)  # q, k, v, o, gate, up, down
    scales = fp8.matmul_params - plain.matmul_params  # the block scales' elements
    assert 0 < scales < linears / 1000
    assert fp8.step_weight_bytes == plain.step_weight_bytes - linears + 2 * scales


@pytest.mark.slow
def test_smoke_run_produces_every_figure(tmp_path):
    from benchmarks.bench import main

    out = tmp_path / "reports"
    main(
        ["--smoke", "--no-isolate", "--suite", "all", "--out", str(out), "--ckpt-dir", str(tmp_path / "ckpt")]
    )
    data = json.loads((out / "benchmark.json").read_text())
    bad = {k: v.get("error") for k, v in data["jobs"].items() if v["status"] != "ok"}
    assert not bad
    got = {(r["figure"], r["system"], r["model"]) for r in data["rows"] if r["value"] > 0}
    want = {("a", "engine", "llama-3.1-8b"), ("a", "engine", "llama-3.2-1b"), ("b", "engine", "llama-3.1-8b"),
            ("c", "engine", "qwen3-0.6b"), ("c-subset", "engine", "qwen3-0.6b"),
            ("a", "transformers", "llama-3.1-8b"), ("a", "transformers", "llama-3.2-1b"),
            ("c-subset", "transformers", "qwen3-0.6b"), ("a", "engine, eager", "llama-3.1-8b")}  # fmt: skip
    assert want <= got
    c = data["jobs"]["engine-qwen3-0.6b"]["results"]["c"]["full"]
    assert c["output_tokens"] == sum(nanovllm_workload(Sizes.smoke(), 2048)[1])  # ignore_eos: exact lengths
    assert all(0 < r["roofline"] < float("inf") for r in data["rows"])  # the env job's ceilings reached them
    md = (out / "benchmark.md").read_text()
    assert "| a | engine | llama-3.1-8b |" in md and "Measured ceilings" in md


def test_decode_profile_splits_a_step_into_kernels_and_gaps():
    """Overlapping kernels count once as busy; short gaps are launch gaps, long ones host waits; the
    device-only step time is reported when there is one."""
    from benchmarks.decode_profile import HOST_GAP_US, busy_time, kernel_kind, summarise, to_markdown

    kernels = [  # (name, start us, end us) over 2 steps
        ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16>", 0.0, 10.0),
        ("_decode_split_kernel", 5.0, 12.0),  # overlaps the matmul by 5 us
        ("_gemv_kernel", 13.0, 20.0),  # a 1 us launch gap
        ("_rms_norm_kernel", 20.0 + HOST_GAP_US + 30.0, 100.0),  # a 50 us wait for the host
    ]
    assert busy_time([(s, e) for _, s, e in kernels]) == 12.0 + 7.0 + 30.0
    assert kernel_kind(kernels[0][0]) == kernel_kind("_gemv_kernel") == "matmul"
    s = summarise(kernels, steps=2, step_wall_us=60.0)
    assert s["gpu_busy_us"] == 49.0 / 2 and s["idle_us"] == 60.0 - 24.5
    assert s["launch_gaps_us"] == 0.5 and s["host_waits_us"] == 25.0
    assert [r["kind"] for r in s["kinds"]][:2] == ["_rms_norm_kernel", "matmul"]
    md = to_markdown("m", 2, 8, s, 10**9)
    assert "no host" not in md  # eager runs have no device-only figure
    s["device_step_us"] = 45.0
    md = to_markdown("m", 2, 8, s, 10**9)
    assert "(graph + logits + argmax, no host): 45 us;" in md and "(noise near zero): +15 us." in md
    assert s["kinds"][1]["calls"] == 1.0 and s["kinds"][1]["us"] == 8.5


def test_structured_bench_smoke(tmp_path):
    """benchmarks/structured_bench.py end to end on the tiny model (CPU): every table it reports."""
    from benchmarks.structured_bench import main

    out = tmp_path / "out"
    main(
        [
            "--model",
            "tiny",
            "--batches",
            "1,4",
            "--steps",
            "small",
            "--out",
            str(out),
            "--ckpt-dir",
            str(tmp_path),
        ]
    )
    data = json.loads((out / "structured_bench.json").read_text())
    modes = {(r["batch"], r["constrained"]) for r in data["decode"] if r["tok_s"] > 0}
    assert modes == {(b, m) for b in (1, 4) for m in ("none", "half", "all")}
    assert all(r["vs_none_quartiles"][0] <= r["vs_none"] <= r["vs_none_quartiles"][1] for r in data["decode"])
    assert len(data["compile"]["cold"]["ms_each"]) == 20 and data["compile"]["cached"]["ms_total"] >= 0
    assert data["ttft"]["constrained_cached"]["ms_median"] > 0
    assert data["ttft"]["constrained_cached_served"]["ms_median"] > 0
    served = [data["ttft"][k]["ms_each"] for k in ("unconstrained_served", "constrained_cached_served")]
    assert len(served[0]) == len(served[1]) > 0  # alternating pairs
    assert "| 4 | all |" in (out / "structured_bench.md").read_text()


def test_step_phases_smoke(tmp_path):
    """benchmarks/step_phases.py on the tiny model (CPU): the mask's phases appear only when rows are
    constrained, in the matcher process or on the thread as the mode says, and every engine step is
    counted once."""
    from benchmarks.step_phases import main

    out = tmp_path / "out"
    args = ["--model", "tiny", "--modes", "none,all,all/thread", "--runs", "1", "--gen", "6", "--batch", "4"]
    main(args + ["--out", str(out), "--ckpt-dir", str(tmp_path)])
    data = json.loads((out / "step_phases.json").read_text())
    none, remote, thread = (m["phases"] for m in data["modes"])
    assert none["LLMEngine._step"]["calls_per_step"] == 1.0
    assert not any("Bitmask" in k or "Grammar" in k or "child" in k for k in none)
    jobs = remote["GrammarProcess.submit"]["calls_per_step"]  # one consume and fill per draw
    assert 0.5 < jobs <= 1.0 and remote["GrammarProcess.wait"]["calls_per_step"] == jobs
    assert remote["child: consume + fill"]["us_per_step"] > 0 and "BitmaskFiller._run" not in remote
    runs = thread["BitmaskFiller._run"]["calls_per_step"]
    assert 0.5 < runs <= 1.0 and thread["BitmaskFiller._plan"]["calls_per_step"] == runs
    assert "GrammarProcess.submit" not in thread
    assert (
        remote["BitmaskFiller._device_rows"]["us_per_step"] > 0
        and thread["BitmaskFiller._device_rows"]["us_per_step"] > 0
    )
    assert "| BitmaskFiller._device_rows |" in (out / "step_phases.md").read_text()


def test_step_phases_times_rank_0s_tensor_parallel_calls(tmp_path):
    """--tp 2 (gloo): rank 0's commands, logits calls and the runner's launch get rows of their own; a
    decode step scores its own rows (no broadcast), a prompt step the rows it samples; each launched step
    sends the workers two commands (eager on CPU: its forward, then its logits)."""
    from benchmarks.step_phases import main

    out = tmp_path / "out"
    args = [
        "--model",
        "tiny",
        "--modes",
        "none",
        "--runs",
        "1",
        "--gen",
        "6",
        "--batch",
        "4",
        "--prompt",
        "40",
    ]
    main(args + ["--tp", "2", "--out", str(out), "--ckpt-dir", str(tmp_path)])
    (phases,) = (m["phases"] for m in json.loads((out / "step_phases.json").read_text())["modes"])
    assert (
        phases["TPModel.compute_own_logits"]["calls_per_step"]
        > phases["TPModel.compute_logits"]["calls_per_step"]
    )
    launched = phases["ModelRunner.execute"]["calls_per_step"]
    assert phases["TPGroup.send"]["calls_per_step"] == pytest.approx(2 * launched)  # a forward, its logits


def test_step_phases_names_only_methods_that_exist(monkeypatch):
    """Every phase step_phases times exists in this tree, and a stale name stops the benchmark with
    that name instead of leaving its row out of the report."""
    from benchmarks import step_phases

    current = step_phases.checked_phases()
    assert all(callable(getattr(owner, name)) for owner, name in current)
    monkeypatch.setattr(step_phases, "phases", lambda: [*current, (step_phases.PhaseTimer, "_gone")])
    with pytest.raises(AttributeError, match=r"PhaseTimer\._gone"):
        step_phases.checked_phases()
    with pytest.raises(AttributeError, match=r"PhaseTimer\._gone"):
        step_phases.main(["--model", "tiny", "--out", "unused"])


def test_sched_host_times_steps_on_this_tree_and_a_baseline(tmp_path):
    """benchmarks/sched_host.py end to end on two copies of this tree's engine: a row per size."""
    import shutil

    from benchmarks import sched_host
    from benchmarks.baseline_tree import ROOT

    base = tmp_path / "base"
    for part in ("engine", "kernels", "benchmarks"):
        shutil.copytree(ROOT / part, base / part, ignore=shutil.ignore_patterns("__pycache__", "reports"))
    out = tmp_path / "sched"
    sched_host.main(
        ["--seqs", "4,8", "--steps", "5", "--reps", "1", "--baseline-tree", str(base), "--out", str(out)]
    )
    report = json.loads(out.with_suffix(".json").read_text())
    assert set(report["us"]) == {"old", "new"} and all(
        v > 0 for t in report["us"].values() for v in t.values()
    )


def test_replica_host_times_tokens_on_this_tree_and_a_baseline(tmp_path):
    """benchmarks/replica_host.py end to end on two copies of this tree's engine: a row per size."""
    import shutil

    from benchmarks import replica_host
    from benchmarks.baseline_tree import ROOT

    base = tmp_path / "base"
    for part in ("engine", "kernels", "benchmarks", "scripts"):
        shutil.copytree(ROOT / part, base / part, ignore=shutil.ignore_patterns("__pycache__", "reports"))
    out = tmp_path / "replica"
    args = ["--streams", "4", "--steps", "3", "--reps", "1", "--baseline-tree", str(base), "--out", str(out)]
    replica_host.main(args)
    report = json.loads(out.with_suffix(".json").read_text())
    assert set(report["us"]) == {"old", "new"} and all(
        v > 0 for t in report["us"].values() for v in t.values()
    )
    assert "| 4 |" in out.with_suffix(".md").read_text()
