"""`minserve serve` (app/cli.py): flags to config keys, --print-config, errors, and one real server.

The flags are generated from AppArgs and the engine's config dataclasses (app/cli_flags.py), so these
tests check the generation, not a list: every field has its flag, vLLM's names, booleans and JSON. The
end-to-end test starts `.venv/bin/minserve` as a user would, in a Ray of its own (RAY_ADDRESS=local, as
tests/test_serving_lifecycle.py starts `serve run`), on free ports (serve_test_env), and Ctrl-C's it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from app.builder import AppArgs
from app.cli import as_yaml, load, main
from app.cli_flags import all_flags, engine_options
from engine.config import EngineConfig
from scripts.restart_check import port_bindable
from tests.serving_fixtures import ROOT, _free_port, serve_test_env, wait_until

BASE = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
SPEC = {"method": "ngram", "num_speculative_tokens": 4}
ARGV = [
    "serve", "models/tiny-llama", "--port", "8123", "--host", "127.0.0.1", "--max-model-len", "512",
    "--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--gpu-memory-utilization", "0.5",
    "--block-size", "8", "--no-enable-prefix-caching", "--kv-cache-dtype", "fp8", "--enforce-eager",
    "--dtype", "float32", "--seed", "7", "--served-model-name", "tiny", "--speculative-config",
    json.dumps(SPEC), "--num-gpu-blocks-override", "64", "--reasoning-parser", "think",
    "--autoscaling-config", '{"min_replicas": 1, "max_replicas": 2}', "--no-prefix-aware-routing",
]  # fmt: skip
ENGINE_OVERRIDES = {
    "max_model_len": 512, "max_num_seqs": 8, "max_num_batched_tokens": 256, "gpu_memory_utilization": 0.5,
    "block_size": 8, "enable_prefix_caching": False, "kv_cache_dtype": "fp8", "enforce_eager": True,
    "dtype": "float32", "seed": 7, "speculative_config": SPEC, "num_blocks": 64,
}  # fmt: skip
ARGS_OVERRIDES = {
    "model": str(ROOT / "models" / "tiny-llama"), "served_model_name": "tiny", "reasoning_parser": "think",
    "autoscaling_config": {"min_replicas": 1, "max_replicas": 2}, "prefix_aware_routing": False,
}  # fmt: skip


@pytest.fixture(autouse=True)
def _in_root(monkeypatch, tiny_model_dir):
    monkeypatch.chdir(ROOT)  # MODEL and the README's paths are relative to the repository
    if not (ROOT / "models" / "tiny-llama" / "config.json").exists():
        pytest.skip("models/tiny-llama missing: `make model`")


def expected_config() -> dict:
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    config["http_options"].update(port=8123, host="127.0.0.1")
    args = config["applications"][0]["args"]
    args.update(ARGS_OVERRIDES)
    args["engine"].update(ENGINE_OVERRIDES)
    return config


def test_every_field_has_a_flag_named_as_vllm_names_it():
    names = {name for flag in all_flags() for name in flag.names}
    fields = set(AppArgs.model_fields) - {"model", "engine"}
    assert {"--" + key.replace("_", "-") for key in fields | set(engine_options())} <= names
    vllm = ["--max-model-len", "--max-num-seqs", "--max-num-batched-tokens", "--gpu-memory-utilization",
            "--block-size", "--enable-prefix-caching", "--kv-cache-dtype",
            "--enforce-eager", "--dtype", "--seed", "--served-model-name", "--speculative-config",
            "--quantization", "--host", "--port", "--num-gpu-blocks-override"]  # fmt: skip
    assert set(vllm) <= names  # the --no- halves of booleans: ARGV below
    assert {"speculative_config", "fault_injection", "grammar_process", "async_scheduling"} <= set(
        engine_options()
    )


def test_flags_map_to_the_config_and_build_the_engine_config():
    _, config = load(ARGV)
    assert config == expected_config()
    args = config["applications"][0]["args"]
    app_args = AppArgs.model_validate(args)
    assert (app_args.served_model_name, app_args.reasoning_parser) == ("tiny", "think")
    assert app_args.prefix_aware_routing is False
    engine = EngineConfig.from_kwargs(args["model"], **args["engine"])
    assert (engine.load.max_model_len, engine.load.enforce_eager, engine.load.dtype) == (512, True, "float32")
    assert (engine.scheduler.max_num_seqs, engine.scheduler.max_num_batched_tokens) == (8, 256)
    assert (engine.cache.block_size, engine.cache.enable_prefix_caching) == (8, False)
    assert (engine.cache.num_blocks, engine.cache.kv_cache_dtype) == (64, "fp8")
    assert engine.speculative.method == "ngram" and engine.speculative.num_speculative_tokens == 4


def test_flags_left_out_keep_the_base_config_and_null_unsets():
    _, config = load(["serve", "models/tiny-llama", "--num-blocks", "32", "--quantization", "null"])
    base = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    base["applications"][0]["args"].update(model=ARGS_OVERRIDES["model"])
    base["applications"][0]["args"]["engine"].update(num_blocks=32, quantization=None)
    assert config == base


def test_print_config_round_trips(capsys):
    main([*ARGV, "--print-config"])
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed == expected_config()
    args = printed["applications"][0]["args"]
    AppArgs.model_validate(args)
    EngineConfig.from_kwargs(args["model"], **args["engine"])
    assert as_yaml(printed, ARGV).startswith("# minserve serve models/tiny-llama")


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--max-num-seq", "4"], "--max-num-seq"),  # no prefix matching
        (["--no-such-flag"], "--no-such-flag"),
        (["--max-num-seqs", "four"], "--max-num-seqs"),
        (["--max-num-seqs", "0"], "--max-num-seqs"),
        (["--speculative-config", "{method: ngram}"], "--speculative-config"),
        (["--speculative-config", '{"method": "nope", "num_speculative_tokens": 1}'], "--speculative-config"),
        (["--tool-call-parser", "xml"], "--tool-call-parser"),
        (["--max-ongoing-requests", "0"], "--max-ongoing-requests"),
        (["--port", "70000"], "--port"),
        (["--tensor-parallel-size", "0"], "--tensor-parallel-size"),
        (["--tensor-parallel-size", "2", "--num-gpus", "1"], "--num-gpus"),  # TP reserves 2 whole GPUs
    ],
)
def test_a_bad_flag_or_value_exits_2_naming_the_flag(argv, named, capsys):
    with pytest.raises(SystemExit) as exit_:
        load(["serve", "models/tiny-llama", *argv])
    assert exit_.value.code == 2
    assert named in capsys.readouterr().err


def _session_pids(sid: int) -> list[int]:
    out = subprocess.run(["ps", "-eo", "pid=,sid="], capture_output=True, text=True).stdout
    return [int(p) for p, s in (line.split() for line in out.splitlines()) if int(s) == sid]


def _models(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v1/models", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_minserve_serve_answers_the_readme_curl_and_stops_on_ctrl_c(tmp_path):
    exe = Path(sys.executable).parent / "minserve"
    assert exe.exists(), (
        "no .venv/bin/minserve: reinstall the package (`make`, pyproject's [project.scripts])"
    )
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "RAY_ADDRESS": "local", **serve_test_env()}
    with open(tmp_path / "minserve.log", "w") as log:
        proc = subprocess.Popen(
            [str(exe), "serve", "models/tiny-llama", "--port", str(port)], cwd=ROOT, env=env, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
            # Ctrl-C reaches it also where this test runs with SIGINT ignored (a background job)
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )  # fmt: skip
    try:
        wait_until(lambda: _models(url) or proc.poll() is not None, 120, "minserve serve to answer")
        assert proc.poll() is None, (tmp_path / "minserve.log").read_text()[-3000:]
        body = {"model": "tiny-llama", "prompt": "Hello", "max_tokens": 16}
        resp = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(90) == 0
        wait_until(lambda: port_bindable(port), 30, f"port {port} to be free")
        wait_until(lambda: not _session_pids(proc.pid), 30, "every process of minserve's Ray to exit")
    finally:
        for pid in _session_pids(proc.pid):
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
