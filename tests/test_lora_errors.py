"""Bad adapters and bad LoRA options get clear errors naming the file, the tensor and the fix, and a
refused request leaves the engine serving the others (issue 48). Also: scripts.make_lora writes what
peft itself loads, and the options' validation."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, LoRARequest, SamplingParams
from engine.config import EngineConfig
from engine.errors import InvalidRequestError, LoRAError
from engine.lora.adapter import ModuleShapes, check_adapter
from engine.models.registry import config_from_dir
from scripts.make_lora import make_lora

pytestmark = pytest.mark.engine
GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
Q0 = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def good(tiny_model_dir, tmp_path_factory):
    return make_lora(tiny_model_dir, tmp_path_factory.mktemp("good") / "a", rank=8, seed=3)


@pytest.fixture(scope="module")
def shapes(tiny_model_dir) -> ModuleShapes:
    return ModuleShapes.of(config_from_dir(tiny_model_dir))


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), device="cpu", dtype="float32", enable_lora=True, max_lora_rank=8)


def edited(good, tmp_path, config=None, tensors=None):
    """A copy of the good adapter with adapter_config.json fields and tensors replaced (None: drop)."""
    out = tmp_path / "bad"
    shutil.copytree(good, out)
    cfg = json.loads((out / "adapter_config.json").read_text()) | (config or {})
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    weights = load_file(out / "adapter_model.safetensors")
    for name, value in (tensors or {}).items():
        weights.pop(name, None) if value is None else weights.__setitem__(name, value)
    save_file(weights, out / "adapter_model.safetensors")
    return out


def refused(shapes, path, *parts, max_rank=16) -> str:
    with pytest.raises(LoRAError) as info:
        check_adapter(path, shapes, max_rank)
    message = str(info.value)
    assert info.value.field == "lora_path" and all(p in message for p in parts), message
    return message


def test_peft_loads_what_make_lora_writes(tiny_model_dir, good):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = pytest.importorskip("peft").PeftModel.from_pretrained(base, good)
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    ours = load_file(good / "adapter_model.safetensors")
    assert torch.equal(layer.lora_A["default"].weight, ours[f"{Q0}.lora_A.weight"])
    assert torch.equal(layer.lora_B["default"].weight, ours[f"{Q0}.lora_B.weight"])
    assert layer.lora_B["default"].weight.abs().min() > 0  # B is not peft's zero init


def test_a_shape_that_does_not_fit_the_base_model_names_file_and_tensor(shapes, good, tmp_path):
    bad = edited(good, tmp_path, tensors={f"{Q0}.lora_B.weight": torch.ones(48, 8)})
    refused(shapes, bad, "adapter_model.safetensors", f"{Q0}.lora_B.weight", "[48, 8]", "expected [64, 8]")


def test_an_adapter_for_another_model_is_refused(shapes, tmp_path):
    from scripts.make_model import make_model

    other = make_model("tiny-qwen3", tmp_path / "qwen")  # head_dim 32: other q/k/v/o widths
    refused(shapes, make_lora(other, tmp_path / "q", rank=4), "self_attn", "expected", "trained on this base")


def test_unsupported_target_modules_are_named(shapes, good, tmp_path):
    refused(shapes, edited(good, tmp_path, config={"target_modules": ["q_proj", "lm_head"]}),
            "adapter_config.json", "lm_head", "supported")  # fmt: skip
    shutil.rmtree(tmp_path / "bad")
    bad = edited(good, tmp_path, tensors={"base_model.model.lm_head.lora_A.weight": torch.ones(8, 64)})
    refused(shapes, bad, "base_model.model.lm_head.lora_A.weight", "unsupported target module")
    shutil.rmtree(tmp_path / "bad")  # a multimodal wrapper's vision tower is not the language model
    vision = "base_model.model.model.vision_tower.encoder.layers.0.self_attn.q_proj.lora_A.weight"
    refused(shapes, edited(good, tmp_path, tensors={vision: torch.ones(8, 64)}), vision, "unsupported target")


def test_a_rank_above_max_lora_rank_is_refused(shapes, good):
    refused(shapes, good, "adapter_config.json", "r=8", "max_lora_rank=4", max_rank=4)


@pytest.mark.parametrize(
    "change, words",
    [
        ({"use_dora": True}, ["use_dora", "DoRA"]),
        ({"bias": "all"}, ["bias", "bias='none'"]),
        ({"peft_type": "IA3"}, ["peft_type", "LORA"]),
        ({"r": 4}, ["rank 8", "r=4"]),
    ],
)
def test_unsupported_options_are_named(shapes, good, tmp_path, change, words):
    refused(shapes, edited(good, tmp_path, config=change), *words)


def test_missing_and_broken_files(shapes, good, tmp_path):
    refused(shapes, tmp_path / "nowhere", "is not a directory")
    bad = edited(good, tmp_path, tensors={f"{Q0}.lora_B.weight": None})
    refused(shapes, bad, f"{Q0}.lora_A.weight", "no lora_B partner")
    (bad / "adapter_model.safetensors").write_bytes(b"\x01\x00")
    refused(shapes, bad, "adapter_model.safetensors", "not a safetensors file")
    (bad / "adapter_model.safetensors").unlink()
    refused(shapes, bad, "no adapter_model.safetensors", "safe_serialization")
    (bad / "adapter_config.json").unlink()
    refused(shapes, bad, "no adapter_config.json")


def test_a_refused_request_leaves_the_engine_serving(llm, good, tmp_path):
    bad = LoRARequest("bad", 9, str(tmp_path / "missing"))
    with pytest.raises(LoRAError):
        llm.generate(["hello"], GREEDY, lora_request=bad)
    rank16 = make_lora(llm.engine.config.load.model, tmp_path / "r16", rank=16)
    with pytest.raises(LoRAError, match="max_lora_rank=8"):
        llm.engine.add_lora(LoRARequest("r16", 2, str(rank16)))
    ok = LoRARequest("good", 1, str(good))
    assert llm.generate(["hello"], GREEDY, lora_request=ok)[0].outputs[0].finish_reason == "length"
    with pytest.raises(InvalidRequestError, match="LoRARequest"):
        llm.engine.add_request("hi", GREEDY, lora_request=("good", 1, str(good)))
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["a", "b"], GREEDY, lora_request=[ok])
    assert not llm.engine.has_unfinished() and llm.engine.audit() == []


def test_add_list_remove_loras(llm, good):
    ok = LoRARequest("kept", 5, str(good))
    llm.engine.add_lora(ok)
    assert "kept" in llm.engine.list_loras()
    assert llm.engine.remove_lora("kept") is True
    assert "kept" not in llm.engine.list_loras() and llm.engine.remove_lora("kept") is False


def test_an_adapter_without_enable_lora_is_refused(tiny_model_dir, good):
    llm = LLM(str(tiny_model_dir), device="cpu", dtype="float32")
    with pytest.raises(InvalidRequestError, match="enable_lora=True") as info:
        llm.generate(["hi"], GREEDY, lora_request=LoRARequest("a", 1, str(good)))
    assert info.value.field == "model"
    assert llm.engine.list_loras() == [] and llm.engine.remove_lora("a") is False


def test_quantized_base_layers_refuse_lora_clearly(tiny_model_dir):
    with pytest.raises(ValueError, match="quantised .* not supported"):
        LLM(str(tiny_model_dir), device="cpu", dtype="float32", quantization="fp8", enable_lora=True)


@pytest.mark.parametrize(
    "options, field",
    [
        (dict(max_loras=0), "max_loras"),
        (dict(max_lora_rank=0), "max_lora_rank"),
        (dict(max_loras=4, max_cpu_loras=2), "max_cpu_loras"),
        (dict(max_loras=True), "max_loras"),
    ],
)
def test_lora_options_are_validated(options, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        EngineConfig.from_kwargs("m", enable_lora=True, **options)


def test_lora_request_fields_are_validated():
    for args, field in [
        (("", 1, "p"), "lora_name"),
        (("a", 0, "p"), "lora_int_id"),
        (("a", 1, ""), "lora_path"),
    ]:
        with pytest.raises(InvalidRequestError) as info:
            LoRARequest(*args)
        assert info.value.field == field


def test_an_adapter_broken_after_acceptance_fails_only_its_own_requests(tiny_model_dir, good, tmp_path):
    """Its files are checked when the request is added and read when it is about to run: read then, a
    broken file fails that adapter's requests alone, not the step beside them."""
    llm = LLM(
        str(tiny_model_dir), device="cpu", dtype="float32", enable_lora=True, max_lora_rank=8, max_loras=2
    )
    doomed_dir = shutil.copytree(good, tmp_path / "doomed")
    other = LoRARequest("other", 8, str(make_lora(tiny_model_dir, tmp_path / "other", rank=8, seed=5)))
    doomed = LoRARequest("doomed", 7, str(doomed_dir))
    alone = {name: llm.generate(["hello there"], GREEDY, lora_request=r)[0].outputs[0].token_ids
             for name, r in (("other", other), ("base", None))}  # fmt: skip
    engine = llm.engine
    ids = {name: engine.add_request("hello there", GREEDY, lora_request=r)
           for name, r in (("doomed", doomed), ("other", other), ("base", None))}  # fmt: skip
    (doomed_dir / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    tokens: dict[str, list[int]] = {rid: [] for rid in ids.values()}
    errors: dict[str, str | None] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.outputs[0].token_ids
            if out.finished:
                errors[out.request_id] = out.outputs[0].error
    assert "adapter_model.safetensors" in (errors[ids["doomed"]] or "")
    for name in ("other", "base"):
        assert errors[ids[name]] is None and tokens[ids[name]] == alone[name]
    assert engine.audit() == []
