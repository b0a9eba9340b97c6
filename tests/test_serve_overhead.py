"""benchmarks/serve_overhead.py's pieces without Ray: CPU roles and arithmetic (proc_cpu), the report's
ratios and acceptance lines (serve_summary), the served configuration, and the offline twin (tiny model)."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import pytest

from benchmarks import proc_cpu
from benchmarks.serve_overhead import parse_variant
from benchmarks.serve_stack import engine_options, replica_log_values, serve_config, with_app_args
from benchmarks.serve_summary import overhead_acceptance, overhead_markdown

CMDLINES = {
    "/opt/app/.venv/bin/python -m engine.core.process 13 7374": "engine core",
    "ray::ServeReplica:minserve:EngineDeployment ray::ServeRepli": "replica",
    "ray::ServeReplica:minserve:EngineDeployment.generate": "replica",
    "ray::ServeReplica:minserve:Ingress": "ingress",
    "ray::ServeReplica:app:Ingress.handle_request_with_rejection": "ingress",
    "ray::ProxyActor ray::ProxyActor": "proxy",
    "ray::ServeController.listen_for_change": "controller",
    "python -m benchmarks.serve_client --host http://127.0.0.1:8000 --users 64": "client",
    "/v/site-packages/ray/core/src/ray/gcs/gcs_server --log_dir=/tmp/ray gcs_server": "other ray",
    "/v/site-packages/ray/core/src/ray/raylet/raylet --raylet_socket_name=/tmp/x raylet": "other ray",
    "/usr/bin/python3 /v/site-packages/ray/dashboard/dashboard.py --host=127.0.0.1": "other ray",
    "ray::IDLE": "other ray",
    "python -c from ray.serve.scripts import cli; cli() run /tmp/serve_config.yaml": "other ray",
    "/bin/bash -c sleep 5 bash": "other",
}


@pytest.mark.parametrize("text,role", CMDLINES.items())
def test_classify(text: str, role: str) -> None:
    assert proc_cpu.classify(text) == role


def test_assign_roles_by_ancestry() -> None:
    procs = {
        10: {"ppid": 1, "text": "ray::ServeReplica:minserve:EngineDeployment"},
        11: {"ppid": 10, "text": "python -c from multiprocessing.spawn import spawn_main"},  # its core
        12: {"ppid": 11, "text": "python helper"},  # below the core: still the core's
        20: {"ppid": 1, "text": "python load.py"},
        21: {"ppid": 20, "text": "python worker"},
        30: {"ppid": 1, "text": "sleep 100"},
    }
    roles = proc_cpu.assign_roles(procs, clients={20})
    assert roles == {
        10: "replica",
        11: "engine core",
        12: "engine core",
        20: "client",
        21: "client",
        30: "other",
    }


def test_summarize_cpu_arithmetic() -> None:
    procs = {
        1: {"ppid": 0, "text": "ray::ServeReplica:m:EngineDeployment", "first": 10.0, "last": 14.0},
        2: {"ppid": 1, "text": "python -m engine.core.process", "first": 0.0, "last": 9.0},  # born in window
        3: {"ppid": 0, "text": "ray::ProxyActor", "first": 5.0, "last": 5.5},
        4: {"ppid": 0, "text": "ray::ProxyActor", "first": 1.0, "last": 2.5},
        5: {"ppid": 0, "text": "raylet", "first": 3.0, "last": 2.0},  # never negative
    }
    out = proc_cpu.summarize_cpu(procs, wall_s=10.0, clients=set())
    roles = out["roles"]
    assert roles["replica"]["cpu_s"] == pytest.approx(4.0) and roles["replica"]["cpu_pct"] == pytest.approx(
        40.0
    )
    assert roles["engine core"]["cpu_pct"] == pytest.approx(90.0)
    assert roles["proxy"] == {"cpu_s": pytest.approx(2.0), "cpu_pct": pytest.approx(20.0), "processes": 2}
    assert roles["other ray"]["cpu_s"] == 0.0 and roles["client"]["processes"] == 0
    assert [p["pid"] for p in out["processes"]][:2] == [2, 1]  # busiest first


def test_sampler_sees_a_busy_child() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 3: pass"]
    )
    try:
        sampler = proc_cpu.CpuSampler(clients={child.pid}, interval=0.2).start()
        time.sleep(0.8)
        out = sampler.stop()
    finally:
        child.kill()
        child.wait()
    assert out["roles"]["client"]["processes"] == 1 and out["roles"]["client"]["cpu_pct"] > 5
    assert out["wall_s"] == pytest.approx(0.8, abs=0.5)


def _run(variant: str, stack: str, users: int, tok_s: float, ttft_p50: float, **extra) -> dict:
    summary = {"output_tok_s": tok_s, "failures": 0, "ttft_ms": {"p50": ttft_p50, "p99": 2 * ttft_p50},
               "itl_ms": {"p50": 10.0, "p99": 30.0}}  # fmt: skip
    return {
        "variant": variant,
        "stack": stack,
        "users": users,
        "summary": summary,
        "cpu": {"replica": 50.0},
        **extra,
    }


def test_acceptance_and_markdown() -> None:
    runs = [
        _run("-", "offline", 64, 1000.0, 100.0),
        _run("-", "offline", 256, 2000.0, 300.0),
        _run("default", "served", 64, 900.0, 120.0),  # 90% >= 85%; +20 ms <= 25 ms
        _run("default", "served", 256, 1500.0, 500.0),  # 75% < 80%
        _run("default", "null", 64, 980.0, 50.0, null_step_ms=64.0, ideal_tok_s=1000.0),
        _run("tput", "served", 64, 800.0, 140.0),  # 80% < 85%; +40 ms > 25 ms
        {"variant": "tput", "stack": "served", "users": 256, "error": "RuntimeError: no answer"},
    ]
    checks = {(c["variant"], c["users"], c["unit"]): c for c in overhead_acceptance(runs)}
    assert (
        checks["default", 64, "ratio"]["value"] == pytest.approx(0.9)
        and checks["default", 64, "ratio"]["pass"]
    )
    assert checks["default", 256, "ratio"]["value"] == pytest.approx(0.75)
    assert checks["default", 256, "ratio"]["pass"] is False
    assert checks["default", 64, "ms"]["value"] == pytest.approx(20.0) and checks["default", 64, "ms"]["pass"]
    assert checks["tput", 64, "ratio"]["pass"] is False and checks["tput", 64, "ms"]["pass"] is False
    assert checks["tput", 256, "ratio"]["pass"] is None  # errored: not measurable
    md = overhead_markdown({"runs": runs, "acceptance": list(checks.values()), "model": "m", "settings": {}})
    assert "| default | served | 64 | 900 | 90.0% |" in md
    assert "| default | null | 64 | 980 | 98.0% | 1,000 (64.00 ms) |" in md
    assert "- PASS (default, 64 users) served out tok/s >= 85% of offline: 90.0%" in md
    assert "- FAIL (default, 256 users) served out tok/s >= 80% of offline: 75.0%" in md
    assert "- FAIL (tput, 64 users) served TTFT p50 <= offline TTFT p50 + 25 ms: +40.0 ms over offline" in md
    assert "- n/a (tput, 256 users)" in md and "RuntimeError: no answer" in md


def test_serve_config_and_variants() -> None:
    cfg = serve_config("cuda", "/ckpt", 8123, 256, null_step_ms=12.3456)
    args = cfg["applications"][0]["args"]
    assert cfg["http_options"]["port"] == 8123 and args["model"] == "/ckpt" and args["num_gpus"] == 1
    assert args["max_ongoing_requests"] == 512 and args["null_core_step_ms"] == 12.346
    assert args["engine"]["max_num_seqs"] == 256 and args["engine"]["gpu_memory_utilization"] == 0.85
    assert "cpu_kv_cache_bytes" not in args["engine"] and engine_options("cuda") == args["engine"]
    assert args["ingress_num_replicas"] == 2  # serve_config.yaml's GPU setting
    cpu = serve_config("cpu", "/ckpt", 8000, 4)["applications"][0]["args"]
    assert cpu["num_gpus"] == 0 and cpu["max_ongoing_requests"] == 256 and "null_core_step_ms" not in cpu
    assert cpu["ingress_num_replicas"] == 1
    assert "tensor_parallel_size" not in cpu["engine"]
    tp4 = serve_config("cuda", "/ckpt", 8000, 4, tp=4)["applications"][0]["args"]
    assert tp4["num_gpus"] == 4 and tp4["engine"]["tensor_parallel_size"] == 4
    tp2 = serve_config("cpu", "/ckpt", 8000, 4, tp=2)["applications"][0]["args"]  # gloo ranks on 2 cores
    assert (tp2["num_gpus"], tp2["engine_num_cpus"], tp2["engine"]["tensor_parallel_size"]) == (0, 0.5, 2)
    assert parse_variant("tput=RAY_SERVE_THROUGHPUT_OPTIMIZED=1,A=b=c") == (
        "tput",
        {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "A": "b=c"},
    )
    with pytest.raises(SystemExit):
        parse_variant("novalue")
    cfg = serve_config("cpu", "/ckpt", 8000, 4)
    variant = {"args.engine.max_num_batched_tokens": "8192", "args.stream_items_per_s": "1000"}
    args = with_app_args(cfg, variant)["applications"][0]["args"]
    assert args["engine"]["max_num_batched_tokens"] == 8192 and args["stream_items_per_s"] == 1000
    assert args["engine"]["max_num_seqs"] == engine_options("cpu")["max_num_seqs"]  # the rest kept


def test_replica_log_lines_of_old_and_new_trees(tmp_path) -> None:
    """The per-request timings parse from the log lines of this tree and of older baseline trees (no
    "in ingress", no "to replica", no "to core"); a "-" (never reached) is left out, not read as 0."""
    head = "INFO x -- request cmpl-1-0 length: prompt 5, completion 3, cached 0 tokens; "
    lines = [
        "in ingress 0.5 ms, to replica 1.0 ms, to core 1.5 ms, queue 2.5 ms, engine ttft 3.0 ms, "
        "ttft 3.5 ms, e2e 6.0 ms",
        "to replica 1.5 ms, to core 2.0 ms, queue 3.0 ms, engine ttft 4.0 ms, ttft 4.5 ms, e2e 9.0 ms",
        "to core 20.0 ms, queue 30.0 ms, engine ttft 40.0 ms, ttft 45.0 ms, e2e 90.0 ms",
        "queue 300.0 ms, engine ttft 400.0 ms, ttft 450.0 ms, e2e 900.0 ms",
        "to replica - ms, to core 7.0 ms, queue 8.0 ms, engine ttft - ms, ttft - ms, e2e 10.0 ms",
    ]
    (tmp_path / "replica_minserve_EngineDeployment_x.log").write_text("".join(head + t + "\n" for t in lines))
    values = replica_log_values({}, tmp_path)
    assert values["in_ingress_ms"] == [0.5]
    assert values["to_replica_ms"] == [1.0, 1.5]
    assert values["to_core_ms"] == [1.5, 2.0, 20.0, 7.0]
    assert values["queue_ms"] == [2.5, 3.0, 30.0, 300.0, 8.0]
    assert values["engine_ttft_ms"] == [3.0, 4.0, 40.0, 400.0]
    assert values["replica_e2e_ms"] == [6.0, 9.0, 90.0, 900.0, 10.0]


@pytest.mark.engine
def test_offline_twin_on_tiny_model(tiny_model_dir) -> None:
    from benchmarks.offline_twin import run_twin

    args = argparse.Namespace(model=str(tiny_model_dir), users=2, spawn_rate=16.0, duration=2.5, warmup=0.3,
                              workload="W2", gen_scale=0.05, prompt_scale=0.05, seed=0,
                              engine_json=None)  # fmt: skip
    out = run_twin(args)
    assert out["requests"] >= 1 and out["failures"] == 0
    # ignore_eos: a completed request emits exactly max_tokens, all of which the loop counted
    assert out["output_tok_s"] * out["elapsed_s"] == pytest.approx(out["completed_max_tokens"])
    assert out["ttft_ms"]["count"] == out["requests"] and out["ttft_ms"]["p99"] is not None
    assert out["itl_ms"]["count"] > 0 and out["itl_ms"]["p50"] > 0 and out["e2e_ms"]["p50"] > 0
    assert out["engine_options"] == engine_options("cpu") and out["cpu"]["offline twin"] > 0


def test_serve_client_think_time_paces_each_user(tmp_path) -> None:
    """benchmarks.serve_client against a stand-in server that answers at once: without a think time
    each user sends request after request; with a mean of 0.2 s a user sends about one request per
    0.2 s (its pauses are exponential draws from a seeded stream), and the prompts drawn are the same."""
    import asyncio
    import json as _json

    from aiohttp import web

    from benchmarks import serve_client

    prompts: list = []

    async def models(_request):
        return web.json_response({"data": [{"id": "m", "max_model_len": 4096, "vocab_size": 1000}]})

    async def completions(request):
        prompts.append((await request.json())["prompt"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {"choices": [{"text": "x"}], "usage": {"completion_tokens": 1}}
        await resp.write(f"data: {_json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())
        return resp

    async def load(think: float) -> dict:
        app = web.Application()
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        argv = ["--host", f"http://127.0.0.1:{port}", "--users", "2", "--spawn-rate", "100", "--duration",
                "2", "--workload", "W4", "--think-time", str(think), "--out", str(tmp_path)]  # fmt: skip
        p = argparse.ArgumentParser()
        p.add_argument("--host")
        p.add_argument("--think-time", type=float)
        serve_client.add_load_args(p, duration=2.0)
        try:
            return await serve_client.run(p.parse_args(argv))
        finally:
            await runner.cleanup()

    busy = asyncio.run(load(0.0))
    first = list(prompts)
    prompts.clear()
    paced = asyncio.run(load(0.2))
    assert busy["requests"] > 100  # a closed loop against an instant server
    assert 8 <= paced["requests"] <= 40, paced["requests"]  # 2 users x 2 s / 0.2 s = 20 expected
    assert prompts and all(p in first for p in prompts)  # each user's requests: the same stream
    with pytest.raises(ValueError, match="--think-time"):
        serve_client.think_seconds(serve_client.random.Random(0), -1.0)


def test_request_waits_bins_log_lines_by_arrival(tmp_path) -> None:
    """benchmarks.request_waits: arrival = the line's stamp less its e2e; each leg is the difference of two
    stamps; bins hold the requests that arrived in them; lines with a "-" are left out; gzip reads too."""
    import gzip

    from benchmarks.request_waits import binned, parse, read

    def line(stamp: str, ingress, replica, core, queue, ttft, e2e) -> str:
        return (
            f"INFO 2026-11-28 {stamp} minserve_EngineDeployment x -- request r-0 length: prompt 5, "
            f"completion 3, cached 0 tokens; in ingress {ingress} ms, to replica {replica} ms, "
            f"to core {core} ms, queue {queue} ms, engine ttft 1.0 ms, ttft {ttft} ms, e2e {e2e} ms\n"
        )

    text = (
        line("10:00:01,000", 0.5, 700.5, 704.5, 710.5, 730.5, 1000.0)  # arrived 10:00:00.000
        + line("10:00:01,150", 0.5, 500.5, 505.5, 600.5, 620.5, 1100.0)  # arrived 10:00:00.050
        + line("10:00:01,500", 0.5, 10.5, 12.5, 13.5, 30.5, 1000.0)  # arrived 10:00:00.500
        + line("10:00:01,600", 0.5, "-", 12.5, 13.5, 30.5, 1000.0)  # never reached the replica: left out
    )
    path = tmp_path / "replica.log.gz"
    with gzip.open(path, "wt") as f:
        f.write(text)
    rows = parse(read(path))
    assert [round(r.arrival % 60, 3) for r in rows] == [0.0, 0.05, 0.5]
    assert (rows[0].hop, rows[0].replica, rows[0].core_wait, rows[0].prefill) == (700.0, 4.0, 6.0, 20.0)
    bins = binned(rows, 0.2)
    assert [(b["t"], b["n"]) for b in bins] == [(0.0, 2), (0.4, 1)]
    assert bins[0]["hop"] == (700.0 + 500.0) / 2 and bins[0]["core wait"] == (6.0 + 95.0) / 2
    assert binned(rows, 0.2, start=0.3) == bins[1:]


def test_rounds_alternate_the_order_and_the_table_takes_each_variant_over_them() -> None:
    """--rounds: every variant N times, each round reversed from the one before; the report's rounds table
    gives each variant's median and range over its rounds, against a hand recompute."""
    from benchmarks.serve_overhead import parse_args, rounds
    from benchmarks.serve_summary import rounds_table

    variants = {"default": {}, "nocache": {"X": "0"}}
    assert rounds(variants, 1) == [("default", {}), ("nocache", {"X": "0"})]
    assert [name for name, _ in rounds(variants, 3)] == [
        "default#1", "nocache#1", "nocache#2", "default#2", "default#3", "nocache#3"
    ]  # fmt: skip
    runs = [
        {"variant": f"{v}#{i}", "stack": "served", "users": 256, "tree": "new",
         "summary": {"output_tok_s": tok, "ttft_ms": {"p50": ttft}}}
        for v, i, tok, ttft in [("default", 1, 100.0, 500.0), ("default", 2, 300.0, 400.0),
                                ("default", 3, 200.0, 450.0), ("nocache", 1, 150.0, 280.0)]
    ]  # fmt: skip
    table = rounds_table(runs + [{"variant": "default", "stack": "served", "users": 64, "summary": {}}])
    assert table[-2] == "| new | default | served | 256 | 3 | 200 (100-300) | 450.0 (400.0-500.0) |"
    assert table[-1] == "| new | nocache | served | 256 | 1 | 150 (150-150) | 280.0 (280.0-280.0) |"
    assert rounds_table(runs[:0]) == []
    with pytest.raises(SystemExit):
        parse_args(["--rounds", "0"])


def test_serve_warnings_count_the_lines_after_the_marks(tmp_path) -> None:
    """Serve's router and replica warnings are counted in every Serve log, only past the window's marks,
    and listed for the windows that had any."""
    from benchmarks.serve_stack import replica_log_marks, serve_warnings
    from benchmarks.serve_summary import warning_lines

    ingress, replica = (
        tmp_path / "replica_minserve_Ingress_a.log",
        tmp_path / "replica_minserve_EngineDeployment_b.log",
    )
    ingress.write_text("WARNING Failed to get queue length from R within 0.1s.\n")
    replica.write_text("")
    marks = replica_log_marks(tmp_path, pattern="*.log")
    with ingress.open("a") as f:
        f.write("WARNING Failed to get queue length from R within 0.2s.\nINFO routed\n" * 2)
        f.write("WARNING Failed to route request after 50 attempts over 3.00s. Retrying.\n")
    replica.write_text("WARNING Replica at capacity of max_ongoing_requests=8, rejecting request x.\n")
    counts = serve_warnings(marks, tmp_path)
    assert counts == {"probe_timeouts": 2, "route_retries": 1, "rejections": 1}
    quiet = dict.fromkeys(counts, 0)
    runs = [{"variant": "default", "stack": "served", "users": 256, "serve_warnings": counts},
            {"variant": "nocache", "stack": "served", "users": 256, "serve_warnings": quiet}]  # fmt: skip
    assert warning_lines(runs)[-1] == (
        "- new default served 256 users: probe timeouts 2, route retries 1, rejections 1"
    )
    assert warning_lines(runs[1:]) == []
