"""The engine core process across the server's lifecycle, with the real `serve run` command line.

`serve run` starts its own local Ray (as a user's shell would); the test then kills the engine replica
with SIGKILL (its core must go with it, and Serve must bring up a new replica and core), and Ctrl-C's
`serve run` with serve_config.yaml's own settings: it must return without waiting for the controller's
30 s timeout, and no Ray process, core or bound port may stay behind. `serve shutdown` is Serve's API
shutdown, which tests/serving_fixtures.py's stop of the shared server checks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx
import pytest

from scripts.restart_check import SERVE, healthy, port_answers, session_pids, write_config
from tests.serving_fixtures import ROOT, _free_port, process_alive, serve_test_env, wait_until

pytestmark = [pytest.mark.serving, pytest.mark.slow]
# Ctrl-C's bound in this test, with the suite's load beside it (the restart check's bound is 10 s)
CTRL_C_BOUND_S = 20.0


def test_no_core_outlives_its_replica_or_the_server(tiny_model_dir, tmp_path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "RAY_ADDRESS": "local",
        "PYTHONPATH": str(ROOT),
        "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
        **serve_test_env(deregister_s=None),  # serve_config.yaml's own ingress draining period
    }
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(
        [*SERVE, "run", str(write_config(tiny_model_dir, port, tmp_path))],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        wait_until(lambda: healthy(url), 180, "serve run to come up")
        first = httpx.get(f"{url}/v1/engine/stats", timeout=10).json()
        os.kill(first["pid"], signal.SIGKILL)  # the engine replica
        wait_until(lambda: not process_alive(first["core_pid"]), 10, "the core of the killed replica to exit")
        wait_until(lambda: healthy(url), 180, "Serve to replace the killed replica")
        second = httpx.get(f"{url}/v1/engine/stats", timeout=10).json()
        assert second["core_pid"] != first["core_pid"] and process_alive(second["core_pid"])

        proc.send_signal(signal.SIGINT)  # Ctrl-C
        start = time.monotonic()
        proc.wait(120)
        # Serve's default draining period made this 32 s here; `make restart-check` holds it to 10 s
        assert time.monotonic() - start < CTRL_C_BOUND_S, "Ctrl-C waited for the controller's timeout"
        wait_until(lambda: not process_alive(second["core_pid"]), 30, "Ctrl-C to end the core")
        wait_until(lambda: not session_pids(proc.pid), 30, "every process of serve run's session to exit")
        assert not port_answers(port), "the port is still bound after Ctrl-C"
    finally:
        for pid in session_pids(proc.pid):
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
        log.close()
