"""scripts.make_model --quant: hub tensor names, dtypes, shapes and quantization_config, scales computed
from the same random weights as the plain checkpoint, the dequantised twin, sharding and the CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from scripts.make_model import main, make_model
from scripts.model_shapes import get_spec, tensor_shapes
from scripts.quant_formats import FORMATS

pytestmark = pytest.mark.engine

NAME = "tiny-quant"  # q: 192 rows, gate/up: 320 rows, hidden: 192 columns
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QMAX = {"fp8-block": 448.0, "int8": 127.0, "fp8-channel": 448.0, "fp8-tensor": 448.0}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant-made")
    out = {"plain": make_model(NAME, root / "plain")}
    for fmt in FORMATS:
        out[fmt] = make_model(NAME, root / fmt, quant=fmt)
        out[fmt + "-twin"] = make_model(NAME, root / f"{fmt}-twin", quant=fmt, dequantized_twin=True)
    return out


def _is_projection(name: str) -> bool:
    return name.startswith("model.layers.") and name.split(".")[-2] in PROJECTIONS


def _expected_scale(fmt: str, w: torch.Tensor) -> torch.Tensor:
    """amax / qmax over each tile, row or the whole tensor, by explicit loops over tiles."""
    if fmt == "fp8-block":
        n, k = w.shape
        out = torch.empty(math.ceil(n / 128), math.ceil(k / 128))
        for i in range(out.shape[0]):
            for j in range(out.shape[1]):
                out[i, j] = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].abs().max() / 448.0
        return out
    if fmt == "fp8-tensor":
        return (w.abs().max() / 448.0).reshape(1)
    return w.abs().amax(dim=1, keepdim=True) / QMAX[fmt]


def _expand(fmt: str, scale: torch.Tensor, shape) -> torch.Tensor:
    if fmt == "fp8-block":
        return torch.kron(scale, torch.ones(128, 128))[: shape[0], : shape[1]]
    return scale.reshape(-1, 1).expand(shape)


@pytest.mark.parametrize("fmt", FORMATS)
def test_hub_names_dtypes_shapes_and_scales(dirs, fmt):
    plain = load_file(dirs["plain"] / "model.safetensors")
    quant = load_file(dirs[fmt] / "model.safetensors")
    scale_leaf = "weight_scale_inv" if fmt == "fp8-block" else "weight_scale"
    projections = [n for n in plain if _is_projection(n)]
    assert len(projections) == 7 * get_spec(NAME).num_layers
    assert set(quant) == set(plain) | {n.removesuffix("weight") + scale_leaf for n in projections}
    for name, w in plain.items():
        if not _is_projection(name):  # embeddings, norms, lm_head: untouched
            assert quant[name].dtype == torch.float32 and torch.equal(quant[name], w), name
            continue
        qweight, scale = quant[name], quant[name.removesuffix("weight") + scale_leaf]
        assert qweight.dtype == (torch.int8 if fmt == "int8" else torch.float8_e4m3fn)
        assert qweight.shape == w.shape and scale.dtype == torch.float32
        torch.testing.assert_close(scale, _expected_scale(fmt, w), rtol=1e-6, atol=0)
        step = _expand(fmt, scale, w.shape)
        error = (qweight.float() * step - w).abs() / step  # in units of the scale
        assert error.max() <= (0.5 if fmt == "int8" else 16.0) + 1e-4  # half a step (e4m3 at 256..448: 16)
    assert (quant["model.layers.0.self_attn.q_proj." + scale_leaf].shape) == {
        "fp8-block": (2, 2), "int8": (192, 1), "fp8-channel": (192, 1), "fp8-tensor": (1,)
    }[fmt]  # fmt: skip


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantization_config_as_the_hub_writes_it(dirs, fmt):
    config = json.loads((dirs[fmt] / "config.json").read_text())
    qc = config["quantization_config"]
    if fmt == "fp8-block":
        assert qc == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                      "weight_block_size": [128, 128]}  # fmt: skip
        return
    assert qc["quant_method"] == "compressed-tensors" and qc["ignore"] == ["lm_head"]
    assert qc["format"] == ("int-quantized" if fmt == "int8" else "float-quantized")
    group = qc["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"] and group["output_activations"] is None
    weights = group["weights"]
    assert (weights["num_bits"], weights["symmetric"], weights["dynamic"]) == (8, True, False)
    assert weights["strategy"] == ("tensor" if fmt == "fp8-tensor" else "channel")
    acts = group["input_activations"]
    if fmt == "fp8-tensor":
        assert acts is None  # weight-only
    else:
        assert (acts["dynamic"], acts["strategy"], acts["type"]) == (True, "token", weights["type"])


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantized_twin_holds_weight_times_scale(dirs, fmt):
    quant = load_file(dirs[fmt] / "model.safetensors")
    twin = load_file(dirs[fmt + "-twin"] / "model.safetensors")
    config = json.loads((dirs[fmt + "-twin"] / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "float32"
    assert set(twin) == set(tensor_shapes(get_spec(NAME)))
    scale_leaf = "weight_scale_inv" if fmt == "fp8-block" else "weight_scale"
    for name, w in twin.items():
        assert w.dtype == torch.float32
        if _is_projection(name):
            scale = quant[name.removesuffix("weight") + scale_leaf]
            assert torch.equal(w, quant[name].float() * _expand(fmt, scale, w.shape))
        else:
            assert torch.equal(w, quant[name])


def test_sharded_quantized_checkpoint_indexes_its_scales(dirs, tmp_path):
    sharded = make_model(NAME, tmp_path / "sharded", quant="fp8-block", max_shard_bytes=400_000)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    merged = {}
    for filename in files:
        part = load_file(sharded / filename)
        assert all(index["weight_map"][k] == filename for k in part)
        merged.update(part)
    single = load_file(dirs["fp8-block"] / "model.safetensors")
    assert len(files) > 1 and merged.keys() == single.keys() == index["weight_map"].keys()
    assert all(torch.equal(merged[k].view(torch.uint8), single[k].view(torch.uint8)) for k in single)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in single.values())


def test_cli_quantizes_bf16_weights(tmp_path, capsys):
    main(["tiny", str(tmp_path / "q"), "--dtype", "bf16", "--quant", "int8"])
    weights = load_file(tmp_path / "q" / "model.safetensors")
    assert weights["model.norm.weight"].dtype == weights["lm_head.weight"].dtype == torch.bfloat16
    assert weights["model.layers.0.mlp.up_proj.weight"].dtype == torch.int8
    assert weights["model.layers.0.mlp.up_proj.weight_scale"].dtype == torch.float32
    assert json.loads((tmp_path / "q" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert "int8)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["tiny", str(tmp_path / "t"), "--dequantized-twin"])
    assert "--dequantized-twin needs --quant" in capsys.readouterr().err
