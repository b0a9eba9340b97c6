"""benchmarks/tp_bench.py's report logic: speedups and top-1 against TP=1 (prefill and decode teacher
forcing), a run without TP=1 (a model one GPU cannot hold), and all-reduce estimates only from a table
measured on the same kind of GPU; decode teacher forcing itself against prompt_logprobs."""

from __future__ import annotations

import json

from benchmarks import tp_bench

CFG = {"num_hidden_layers": 2, "hidden_size": 4096}


def _fig(tok_s: float) -> dict:
    return {"tok_s": tok_s, "pct_of_roofline": 50.0, "roofline": {"tok_s": 2 * tok_s}, "step_ms_p50": 1.0}


def _run(tp: int, a: float, b: float, top1: list[list[int]]) -> dict:
    return {"tp": tp, "one_shot": True, "top1_batch": top1, "a": _fig(a), "b": _fig(b)}


def test_speedups_and_top1_are_against_tp1_and_absent_without_it():
    table = [{"world": 2, "kib": 8, "nccl_graph_us": 10.0, "one_shot_graph_us": 5.0},
             {"world": 2, "kib": 512, "nccl_graph_us": 20.0, "one_shot_graph_us": 12.0}]  # fmt: skip
    runs = [_run(1, 100.0, 1000.0, [[1, 2, 3, 4]]), _run(2, 160.0, 1500.0, [[1, 2, 3, 5]])]
    rows = tp_bench.summarize(runs, table, CFG)
    assert (
        rows[1]["a"]["speedup"] == 1.6 and rows[1]["b"]["speedup"] == 1.5 and rows[1]["top1_vs_tp1"] == 0.75
    )
    # 2 layers x 2 + 1 all-reduces of 8 KiB (batch 1) and 512 KiB (batch 64)
    assert rows[1]["a"]["allreduce"]["one_shot_ms"] == 5 * 5.0 / 1e3
    assert rows[1]["b"]["allreduce"]["nccl_ms"] == 5 * 20.0 / 1e3
    alone = tp_bench.summarize([_run(4, 70.0, 3000.0, [[1]])], table, CFG)
    assert alone[0]["a"]["speedup"] is None and alone[0]["top1_vs_tp1"] is None
    env = {"hardware": {}, "versions": {"torch": "x"}}
    md = tp_bench.render({"env": env, "device": {"copy_bw_GBps": 3000.0}, "model_name": "m", "command": "c",
                          "top1_tp1_alone_vs_batch": None, "rows": alone})  # fmt: skip
    assert "| 4 | one-shot | 70.0 | - |" in md
    assert "| 3,000.0 | - | 50.0 | 1.00 / - |" in md  # (b): its step p50, and p90 absent in this run
    rows = tp_bench.summarize(
        [_run(1, 100.0, 1000.0, [[1]]) | {"b": _fig(1000.0) | {"step_ms_p90": 2.5}}], [], CFG
    )
    assert rows[0]["b"]["step_ms_p90"] == 2.5


def test_decode_mode_top1_is_against_tp1_at_the_same_batch_size():
    """Decode teacher forcing: each TP size against TP=1 at batch 64 and at batch 1, and TP=1 at batch 1
    against its own batch-64 lists (the first sequences, those also run alone); a run from before these
    lists reads as absent."""
    base = _run(1, 100.0, 1000.0, [[1]]) | {"top1_decode_batch": [[1, 2], [3, 4], [5, 6]],
                                             "top1_decode_alone": [[1, 9]]}  # fmt: skip
    tp2 = _run(2, 160.0, 1500.0, [[1]]) | {"top1_decode_batch": [[1, 2], [3, 0], [0, 0]],
                                            "top1_decode_alone": [[1, 9]]}  # fmt: skip
    rows = tp_bench.summarize([base, tp2, _run(4, 200.0, 2000.0, [[1]])], [], CFG)
    assert rows[1]["top1_decode_vs_tp1"] == 0.5 and rows[1]["top1_decode_alone_vs_tp1"] == 1.0
    assert rows[2]["top1_decode_vs_tp1"] is None
    assert tp_bench.decode_self_agreement(base) == 0.5 and tp_bench.decode_self_agreement(None) is None
    env = {"hardware": {}, "versions": {"torch": "x"}}
    md = tp_bench.render({"env": env, "device": {"copy_bw_GBps": 3000.0}, "model_name": "m", "command": "c",
                          "top1_tp1_alone_vs_batch": 1.0, "top1_decode_tp1_alone_vs_batch": 0.5,
                          "rows": rows})  # fmt: skip
    assert "100.00% (prefill); 50.00% (decode steps, batch 1 against batch 64)" in md
    assert "| 50.00% | 100.00% |" in md


def test_an_allreduce_table_from_another_gpu_is_not_used(tmp_path):
    path = tmp_path / "ar.json"
    path.write_text(json.dumps({"env": {"hardware": {"gpu": "NVIDIA H200"}}, "rows": [{"world": 2}]}))
    assert tp_bench.allreduce_table(path, "NVIDIA H200") == [{"world": 2}]
    assert tp_bench.allreduce_table(path, "NVIDIA H100 80GB HBM3") == []
    assert tp_bench.allreduce_table(tmp_path / "missing.json", "NVIDIA H200") == []


def test_a_jobs_dir_keeps_each_result_and_runs_no_job_twice(tmp_path, monkeypatch):
    """--jobs-dir: a job's result lands there under its (tp, path, sums) name; a later run (the next call
    on the same host) reads it back instead of running the job, and runs only the missing ones."""
    ran = []

    def fake_run(cmd, timeout):
        job = cmd[cmd.index("--job") + 1]
        ran.append(job)
        out = cmd[cmd.index("--job-out") + 1]
        with open(out, "w") as f:
            json.dump({"job": job}, f)
        return type("Done", (), {"returncode": 0})()

    monkeypatch.setattr(tp_bench.subprocess, "run", fake_run)
    args = tp_bench.argparse.Namespace(model="m", gpu_memory_utilization=0.8, tf_alone=1, job_timeout_s=1,
                                       jobs_dir=str(tmp_path))  # fmt: skip
    assert tp_bench.run_job(args, 2, True, {}, True) == {"job": "2,1,1"}
    assert (tmp_path / "tp2_one_shot_fp32.json").exists()
    assert tp_bench.run_job(args, 2, True, {}, True) == {"job": "2,1,1"}
    assert tp_bench.run_job(args, 4, False, {}) == {"job": "4,0,0"}
    assert ran == ["2,1,1", "4,0,0"]
    args.jobs_dir = None  # without it every call runs its job and keeps nothing
    assert tp_bench.run_job(args, 2, True, {}, True) == {"job": "2,1,1"}
    assert ran[-1] == "2,1,1" and len(ran) == 3


def test_the_allreduce_table_is_measured_at_the_models_message_sizes(capsys):
    """--allreduce measure: one tp_allreduce run per TP size at the step's message sizes (batch 1 and 64
    of the hidden size in bf16), whose rows then give each step's estimate; a size that fails to
    measure is reported and its columns stay empty."""
    calls = []

    def measure(world, sizes):
        calls.append((world, sizes))
        if world == 4:
            raise RuntimeError("no peer access")
        return [{"world": world, "kib": kib, "nccl_graph_us": 2.0 * kib, "one_shot_graph_us": 1.0 * kib}
                for kib in sizes]  # fmt: skip

    table = tp_bench.measured_table([2, 4], CFG, measure)
    assert calls == [(2, (8, 512)), (4, (8, 512))]  # 1 x 4096 and 64 x 4096 bf16 values
    assert "4 GPUs failed: no peer access" in capsys.readouterr().err
    assert tp_bench.step_allreduce(table, 2, CFG, 64)["one_shot_ms"] == 5 * 512.0 / 1e3
    assert tp_bench.step_allreduce(table, 4, CFG, 1)["nccl_ms"] is None
    assert tp_bench.message_kib({"hidden_size": 8192}) == (16, 1024)  # the 70B shape


def test_teacher_forcing_through_decode_steps_equals_the_prefills_top1(tiny_model_dir):
    """In float64 on the CPU, where no summation order shows, the greedy tokens of decode steps fed the
    sequences' own tokens (one at a time, or four sequences a step) equal prompt_logprobs' top-1 at the
    same positions; and they are not just the sequences' own next tokens."""
    import random

    from benchmarks.common import random_prompts
    from benchmarks.teacher_forcing import decode_top1
    from engine import LLM

    llm = LLM(str(tiny_model_dir), dtype="float64", device="cpu", enable_prefix_caching=False, max_num_seqs=4)
    seqs = random_prompts(random.Random(3), 4, 24, llm.engine.runner.model_config.vocab_size)
    start = 6
    want = [row[start:] for row in tp_bench.top1(llm, seqs, alone=False)]  # after positions start..22
    assert all(len(w) == 24 - start - 1 for w in want)
    assert decode_top1(llm, seqs, start, batch=4) == want
    assert decode_top1(llm, seqs, start, batch=1) == want
    assert sum(w != s[start + 1 :] for w, s in zip(want, seqs)) > 0
    assert llm.engine.audit() == [] and llm.engine.block_manager.num_used == 0


def test_the_numerics_emulation_sums_over_k_as_each_variant_says():
    """benchmarks/tp_numerics: every variant is the same product up to bf16 rounding (float64 reference);
    tp1 is the plain GEMM, and rounding each partial sum to bf16 (TP today) changes some outputs that
    fp32 partial sums leave alone."""
    import torch

    from benchmarks.tp_numerics import VARIANTS, row_parallel

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 512, generator=gen).bfloat16()
    w = (torch.randn(256, 512, generator=gen) * 0.05).bfloat16()
    ref = x.double() @ w.double().t()
    out = {v: row_parallel(x, w, v) for v in VARIANTS}
    for y in out.values():
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y.double(), ref, atol=0.02, rtol=0.02)
    assert torch.equal(out["tp1"], torch.nn.functional.linear(x, w))
    assert not torch.equal(out["tp2_bf16"], out["tp2_fp32"])
