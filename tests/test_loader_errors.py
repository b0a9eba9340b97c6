"""Broken checkpoints fail with an error that names the file (and the tensor where there is one)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from engine.models.loader import load_model
from tests.conftest_models import save_checkpoint, tiny_hf_model

pytestmark = pytest.mark.parity
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> dict[str, Path]:
    hf = tiny_hf_model("llama")
    root = tmp_path_factory.mktemp("llama-ok")
    return {
        "single": save_checkpoint(hf, root / "single", sharded=False),
        "sharded": save_checkpoint(hf, root / "sharded", sharded=True),
    }


def _copy(src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(src, tmp_path / "ckpt"))


def _edit_config(directory: Path, **changes) -> None:
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _rewrite_weights(directory: Path, edit) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_good_checkpoints_load(good):
    for directory in good.values():
        model, cfg = load_model(directory, progress=False)
        assert cfg.model_type == "llama" and model.lm_head is not None


def test_corrupt_header(good, tmp_path):
    ckpt = _copy(good["single"], tmp_path)
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[:8] + b"{not json at all" + data[24:])
    with pytest.raises(ValueError, match=r"model\.safetensors.*corrupt"):
        load_model(ckpt, progress=False)


def test_truncated_file(good, tmp_path):
    ckpt = _copy(good["single"], tmp_path)
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors"):
        load_model(ckpt, progress=False)


def test_missing_shard(good, tmp_path):
    ckpt = _copy(good["sharded"], tmp_path)
    shard = sorted(ckpt.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        load_model(ckpt, progress=False)


def test_no_weights_at_all(good, tmp_path):
    ckpt = _copy(good["single"], tmp_path)
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        load_model(ckpt, progress=False)


def test_unknown_model_type(good, tmp_path):
    ckpt = _copy(good["single"], tmp_path)
    _edit_config(ckpt, model_type="mamba")
    with pytest.raises(ValueError, match=r"config\.json.*'mamba'.*llama, qwen3, gemma3_text"):
        load_model(ckpt, progress=False)


def test_shape_mismatch(good, tmp_path):
    ckpt = _copy(good["single"], tmp_path)
    _edit_config(ckpt, intermediate_size=96)  # the weights were saved with 128
    with pytest.raises(
        ValueError, match=r"model\.safetensors: tensor model\.layers\.\d\.mlp\.\w+_proj\.weight"
    ):
        load_model(ckpt, progress=False)


def test_missing_tensor(good, tmp_path):
    ckpt = _copy(good["single"], tmp_path)
    _rewrite_weights(ckpt, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(
        ValueError, match=r"missing from model\.safetensors: model\.layers\.1\.self_attn\.k_proj"
    ):
        load_model(ckpt, progress=False)


def test_unexpected_tensor(good, tmp_path):
    ckpt = _copy(good["single"], tmp_path)
    _rewrite_weights(
        ckpt, lambda t: t.update({"model.layers.7.extra.weight": t["model.norm.weight"].clone()})
    )
    with pytest.raises(
        ValueError, match=r"unexpected .*model\.layers\.7\.extra\.weight \(model\.safetensors\)"
    ):
        load_model(ckpt, progress=False)


def test_harmless_extras_are_ignored(good, tmp_path):
    ckpt = _copy(good["single"], tmp_path)
    _rewrite_weights(
        ckpt,
        lambda t: t.update(
            {"model.layers.0.self_attn.rotary_emb.inv_freq": t["model.norm.weight"][:8].clone()}
        ),
    )
    load_model(ckpt, progress=False)
