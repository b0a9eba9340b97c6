"""Quantised checkpoints minserve cannot serve correctly fail at load with an error naming the config
field or the tensor, never load as something else; the `quantization` option is validated too."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import EngineConfig
from engine.models.layers import Linear
from engine.models.loader import load_model
from engine.models.quant_linear import QuantLinear
from scripts.make_model import make_model

pytestmark = pytest.mark.engine

K_PROJ = "model.layers.1.self_attn.k_proj"
DOWN = "model.layers.0.mlp.down_proj"


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quant-errors")
    return {
        "plain": make_model("tiny", root / "plain"),
        "fp8-block": make_model("tiny", root / "fp8-block", quant="fp8-block"),
        "int8": make_model("tiny", root / "int8", quant="int8"),
        "int8-twin": make_model("tiny", root / "int8-twin", quant="int8", dequantized_twin=True),
    }


def _copy(made, name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(made[name], tmp_path / name))


def _edit_quant(directory: Path, edit) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    edit(config["quantization_config"])
    path.write_text(json.dumps(config))


def _rewrite_weights(directory: Path, edit) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _group(qc: dict) -> dict:
    return qc["config_groups"]["group_0"]


CONFIG_ERRORS = [  # (checkpoint, edit of quantization_config, expected message)
    ("int8", lambda qc: qc.update(quant_method="gptq"),
     r"quantization_config\.quant_method: 'gptq' is not supported \(supported: fp8, compressed-tensors\)"),
    ("int8", lambda qc: _group(qc)["weights"].update(strategy="group", group_size=128),
     r"config_groups\.group_0\.weights\.(strategy: 'group'|group_size: 128) is not supported"),
    ("int8", lambda qc: _group(qc)["weights"].update(strategy="group"),
     r"config_groups\.group_0\.weights\.strategy: 'group' is not supported \(supported: channel, tensor\)"),
    ("int8", lambda qc: _group(qc)["weights"].update(symmetric=False),
     r"config_groups\.group_0\.weights\.symmetric: False is not supported \(supported: True\)"),
    ("int8", lambda qc: _group(qc)["input_activations"].update(dynamic=False),
     r"config_groups\.group_0\.input_activations\.dynamic: False: static activation scales"),
    ("int8", lambda qc: _group(qc)["input_activations"].update(strategy="tensor"),
     r"input_activations\.strategy: 'tensor' is not supported \(supported: token\)"),
    ("int8", lambda qc: _group(qc)["weights"].update(num_bits=4),
     r"config_groups\.group_0\.weights\.num_bits: 4 is not supported \(supported: 8\)"),
    ("int8", lambda qc: _group(qc)["weights"].update(type="float"),
     r"weights\.type: 'float' is not supported \(supported: int\)"),
    ("int8", lambda qc: qc.update(format="pack-quantized"),
     r"quantization_config\.format: 'pack-quantized' is not supported"),
    ("int8", lambda qc: _group(qc).update(targets=["Linear", "Embedding"]),
     r"config_groups\.group_0\.targets: \['Linear', 'Embedding'\] is not supported"),
    ("int8", lambda qc: qc.update(kv_cache_scheme={"num_bits": 8, "type": "float"}),
     r"quantization_config\.kv_cache_scheme: .* is not supported \(supported: None\)"),
    ("int8", lambda qc: qc.update(ignore=[]),
     r"quantization_config\.ignore does not list lm_head.*quantised lm_head is not supported"),
    ("int8", lambda qc: qc.update(ignore=["lm_head", "model.layers.0.self_attn.q_proj"]),
     r"quantization_config\.ignore: model\.layers\.0\.self_attn\.q_proj, .*k_proj, .*v_proj are fused .* "
     r"quantised alike"),
    ("fp8-block", lambda qc: qc.update(weight_block_size=[64, 64]),
     r"quantization_config\.weight_block_size: \[64, 64\] is not supported \(supported: \[128, 128\]\)"),
    ("fp8-block", lambda qc: qc.pop("weight_block_size"),
     r"quantization_config\.weight_block_size: missing: only block-wise FP8"),
    ("fp8-block", lambda qc: qc.update(activation_scheme="static"),
     r"quantization_config\.activation_scheme: 'static' is not supported \(supported: dynamic\)"),
    ("fp8-block", lambda qc: qc.update(fmt="e5m2"),
     r"quantization_config\.fmt: 'e5m2' is not supported \(supported: e4m3\)"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "edit", "message"), CONFIG_ERRORS)
def test_unsupported_config_names_its_field(made, tmp_path, name, edit, message):
    ckpt = _copy(made, name, tmp_path)
    _edit_quant(ckpt, edit)
    with pytest.raises(ValueError, match=r"config\.json: .*" + message):
        load_model(ckpt, progress=False)


TENSOR_ERRORS = [  # (checkpoint, edit of the tensors, expected message)
    ("fp8-block", lambda t: t.pop(f"{K_PROJ}.weight_scale_inv"),
     rf"tensors missing from model\.safetensors: {K_PROJ}\.weight_scale_inv"),
    ("int8", lambda t: t.pop(f"{DOWN}.weight_scale"),
     rf"missing from model\.safetensors: {DOWN}\.weight_scale"),
    ("fp8-block", lambda t: t.update({f"{K_PROJ}.weight": t[f"{K_PROJ}.weight"].float()}),
     rf"model\.safetensors: tensor {K_PROJ}\.weight is torch\.float32, but config\.json's "
     r"quantization_config makes it torch\.float8_e4m3fn"),
    ("int8", lambda t: t.update({f"{DOWN}.weight": t[f"{DOWN}.weight"].float().to(torch.float8_e4m3fn)}),
     rf"model\.safetensors: tensor {DOWN}\.weight is torch\.float8_e4m3fn, but .* makes it torch\.int8"),
    ("plain", lambda t: t.update({f"{DOWN}.weight": t[f"{DOWN}.weight"].to(torch.float8_e4m3fn)}),
     rf"model\.safetensors: tensor {DOWN}\.weight is torch\.float8_e4m3fn, but config\.json has no "
     r"quantization_config"),
    ("plain", lambda t: t.update({f"{DOWN}.weight_scale": torch.ones(64, 1)}),
     rf"model\.safetensors: tensor {DOWN}\.weight_scale: the checkpoint quantises {DOWN}, which "
     r"minserve keeps in the model dtype"),
    ("fp8-block", lambda t: t.update({"lm_head.weight_scale_inv": torch.ones(16, 1)}),
     r"model\.safetensors: tensor lm_head\.weight_scale_inv: the checkpoint quantises lm_head"),
    ("int8", lambda t: t.update({f"{DOWN}.input_scale": torch.ones(1)}),
     rf"model\.safetensors: tensor {DOWN}\.input_scale: static activation scales are not supported"),
    ("int8", lambda t: t.update({f"{DOWN}.weight_zero_point": torch.zeros(64, 1, dtype=torch.int8)}),
     rf"model\.safetensors: tensor {DOWN}\.weight_zero_point: asymmetric weights"),
    ("int8", lambda t: t.update({f"{DOWN}.weight_scale": torch.ones(1)}),
     rf"model\.safetensors: tensor {DOWN}\.weight_scale has shape \(1,\), expected \(64, 1\)"),
    ("fp8-block", lambda t: t.update({f"{K_PROJ}.weight_scale_inv": torch.ones(1, 2)}),
     rf"model\.safetensors: tensor {K_PROJ}\.weight_scale_inv has shape \(1, 2\), expected \(1, 1\)"),
    ("int8", lambda t: t.update({f"{DOWN}.weight_scale": torch.full((64, 1), float("nan"))}),
     rf"model\.safetensors: tensor {DOWN}\.weight_scale: the scales hold NaN"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "edit", "message"), TENSOR_ERRORS)
def test_bad_tensor_names_it(made, tmp_path, name, edit, message):
    ckpt = _copy(made, name, tmp_path)
    _rewrite_weights(ckpt, edit)
    with pytest.raises(ValueError, match=message):
        load_model(ckpt, progress=False)


def test_online_fp8_on_a_quantised_checkpoint_is_refused(made):
    with pytest.raises(ValueError, match=r"quantization: 'fp8' .* already quantised .*'compressed-tensors'"):
        load_model(made["int8"], progress=False, quantization="fp8")


def test_bad_quantization_option(made):
    with pytest.raises(ValueError, match=r"quantization: 'int4' is not supported \(supported: None, 'fp8'\)"):
        load_model(made["plain"], progress=False, quantization="int4")
    with pytest.raises(ValueError, match=r"quantization: must be None \(null\) or 'fp8'"):
        EngineConfig.from_kwargs("models/any", quantization="int4")
    assert EngineConfig.from_kwargs("models/any", quantization="fp8").load.quantization == "fp8"


def test_ignored_module_loads_in_the_model_dtype(made, tmp_path):
    """An `ignore` entry keeps that projection plain: its float weight loads, its neighbours stay int8."""
    ckpt = _copy(made, "int8", tmp_path)
    twin = load_file(made["int8-twin"] / "model.safetensors")

    def dequantize_down(tensors):
        tensors.pop(f"{DOWN}.weight_scale")
        tensors[f"{DOWN}.weight"] = twin[f"{DOWN}.weight"]

    _rewrite_weights(ckpt, dequantize_down)
    _edit_quant(ckpt, lambda qc: qc["ignore"].append(DOWN))
    model, _ = load_model(ckpt, progress=False)
    down = model.model.layers[0].mlp.down_proj
    assert type(down) is Linear and torch.equal(down.weight, twin[f"{DOWN}.weight"])
    assert isinstance(model.model.layers[1].mlp.down_proj, QuantLinear)
    assert isinstance(model.model.layers[0].mlp.gate_up_proj, QuantLinear)
