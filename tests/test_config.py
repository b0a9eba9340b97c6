"""Configs are validated when built and never change: a bad engine option names its field and the fix;
ModelConfig is frozen and takes a family's defaults from its model class; one resolver picks device and
dtype."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.config import EngineConfig
from engine.device.placement import configure_process, resolve_device_dtype
from engine.models.registry import MODEL_REGISTRY, config_from_dict

pytestmark = pytest.mark.engine


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("blas_library", "rocblas", "blas_library: must be cublas or cublaslt"),
        ("dtype", "int8", "dtype: must be one of"),
        ("device", "tpu", "device: must be auto, cpu, cuda or cuda:N"),
        ("max_model_len", 0, "max_model_len: must be >= 1"),
        ("num_blocks", 0, "num_blocks: must be >= 1 or None"),
    ],
)
def test_bad_option_names_its_field(option, value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs("models/any", **{option: value})


def test_unknown_option_is_refused():
    with pytest.raises(ValueError, match="unknown engine option 'blas'"):
        EngineConfig.from_kwargs("models/any", blas="cublas")


def test_options_reach_their_component():
    config = EngineConfig.from_kwargs("models/any", blas_library="cublas", block_size=32, max_num_seqs=8)
    assert config.load.blas_library == "cublas"
    assert (config.cache.block_size, config.scheduler.max_num_seqs) == (32, 8)


def test_model_config_is_frozen():
    cfg = config_from_dict({"model_type": "llama", "num_hidden_layers": 2})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.vocab_size = 7
    assert cfg.layer_types == ("full_attention",) * 2 and cfg.sliding_windows == (None, None)


@pytest.mark.parametrize("model_type", list(MODEL_REGISTRY))
def test_family_defaults_come_from_its_class(model_type, monkeypatch):
    family = MODEL_REGISTRY[model_type]
    cfg = config_from_dict({"model_type": model_type})  # a wrapper without text_config: all defaults
    defaults = family.config_defaults
    assert cfg.model_type == family.model_type
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.max_position_embeddings) == (
        defaults["vocab_size"],
        defaults["hidden_size"],
        defaults["num_hidden_layers"],
        defaults["max_position_embeddings"],
    )
    monkeypatch.setattr(family, "config_defaults", {**defaults, "vocab_size": 1234})
    assert config_from_dict({"model_type": model_type}).vocab_size == 1234


def test_unknown_model_type_names_the_file():
    with pytest.raises(ValueError, match=r"x/config\.json: model_type 'mamba' .* llama, qwen3, gemma3_text"):
        config_from_dict({"model_type": "mamba"}, source="x/config.json")


@pytest.mark.parametrize(
    ("device", "dtype", "cuda", "expected"),
    [
        ("auto", "auto", False, ("cpu", torch.float32)),
        ("auto", "auto", True, ("cuda", torch.bfloat16)),
        ("auto", None, True, ("cuda", torch.bfloat16)),
        ("cpu", "auto", True, ("cpu", torch.float32)),
        ("cuda:1", "float16", False, ("cuda:1", torch.float16)),
        ("cpu", "float64", False, ("cpu", torch.float64)),
        (torch.device("cpu"), torch.bfloat16, True, ("cpu", torch.bfloat16)),
    ],
)
def test_device_dtype_resolution(device, dtype, cuda, expected, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert resolve_device_dtype(device, dtype) == (torch.device(expected[0]), expected[1])


@pytest.mark.parametrize("dtype", ["int8", "cuda", "float9"])
def test_non_floating_dtype_is_refused(dtype):
    with pytest.raises(ValueError, match=f"dtype: '{dtype}' is not a floating torch dtype"):
        resolve_device_dtype("cpu", dtype)


def test_every_rank_applies_the_process_settings(monkeypatch):
    """configure_process, which rank 0 (ModelRunner) and every tensor-parallel worker (tp_worker.main)
    call: the seed, and on a GPU the configured cuBLAS front end (a worker left on torch's default would
    run slower GEMMs and hold up every all-reduce)."""
    from engine.runner import model_runner, tp_worker

    chosen: list[str] = []
    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", chosen.append)
    configure_process(torch.device("cuda", 1), 7, "cublaslt")
    assert chosen == ["cublaslt"] and torch.initial_seed() == 7
    configure_process(torch.device("cpu"), 3, "cublas")
    assert chosen == ["cublaslt"] and torch.initial_seed() == 3
    for module in (model_runner, tp_worker):
        assert module.configure_process is configure_process
