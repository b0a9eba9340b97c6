"""benchmarks/pdl_probe.py: the GEMM shapes it probes (scripts.model_shapes) against the published
configs, its summary on a report written by hand, and (GPU) that it tells a consumer which waits for a
PDL producer from one which does not; without that its verdict on cuBLASLt would mean nothing."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import pdl_probe
from benchmarks.common import write_report
from scripts.model_shapes import get_spec

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def test_gemm_shapes_match_the_published_configs():
    # Llama-3.1-8B: hidden 4096, 32 heads x 128, 8 KV heads, MLP 14336; Qwen3-0.6B: hidden 1024,
    # 16 heads x 128 (so q is wider than hidden), 8 KV heads, MLP 3072.
    assert get_spec("llama-3.1-8b").fused_projections() == {
        "qkv": (6144, 4096),
        "o": (4096, 4096),
        "gate_up": (28672, 4096),
        "down": (4096, 14336),
    }
    assert get_spec("qwen3-0.6b").fused_projections() == {
        "qkv": (4096, 1024),
        "o": (1024, 2048),
        "gate_up": (6144, 1024),
        "down": (1024, 3072),
    }


def _hand_report() -> dict:
    def row(kernel: str, wrong: int, consumer: str = "gemm") -> dict:
        return {"consumer": consumer, "model": "m", "gemm": "o", "m": 64, "kernel": kernel,
                "wrong_replays": wrong, "replays": 5}  # fmt: skip

    cases = [row("_reader", 5, "reader-nowait"), row("k1", 0), row("k1", 2), row("k2", 0)]
    env = {"hardware": {"gpu": "G"}, "versions": {"torch": "t"}}
    return {"env": env, "command": "c", "commit": "x", "sleep_us": 20, "cublaslt": 1, "cases": cases}


def test_summary_counts_only_kernels_that_waited_in_every_case():
    text = pdl_probe.markdown(_hand_report())
    assert "2 distinct GEMM kernels; 1 waited for the producer in every case: ['k2']." in text
    assert "| gemm | m | o | 64 | k1 | 2 of 5 |" in text


def test_report_files_hold_the_data_and_the_table(tmp_path, capsys):
    report = _hand_report()
    text = pdl_probe.markdown(report)
    write_report(tmp_path / "sub" / "probe", report, text)
    assert json.loads((tmp_path / "sub" / "probe.json").read_text()) == report
    assert (tmp_path / "sub" / "probe.md").read_text() == text
    assert capsys.readouterr().out == text + "\n"


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90+ GPU (PDL)")
def test_probe_tells_a_waiting_consumer_from_one_that_does_not():
    assert pdl_probe.case("reader-wait", 64, 0, 4096)["wrong_replays"] == 0
    assert pdl_probe.case("reader-nowait", 64, 0, 4096)["wrong_replays"] == 5
