"""Quantised checkpoints against their dequantised twins, on tiny random models of every family.

scripts.make_model writes each hub format and, from the same seed, its dequantised twin: the float32
checkpoint holding exactly weight * scale. Loaded in float32:
* the quantised model's first-token log-probabilities match the twin's (top-1 agreement >= 90%, mean
  |delta logprob| <= 0.05 over the twin's top 20 tokens): the only difference left is the rounding of
  the activations, which each format's act_quant adds;
* with activation rounding switched off, the logits equal the twin's: every scale sits on its rows;
* quantization="fp8" on the float checkpoint gives bit for bit the fp8-channel checkpoint's tensors
  (two independent quantisers: engine/models/quant_loader.py and scripts/quant_formats.py);
* quantization=None on a float checkpoint builds no quantised module, never calls ops.quant_linear,
  and still matches transformers.
tiny-quant puts 128-row tile edges inside q and gate/up; the Qwen3 and Gemma 3 stand-ins (tied
embeddings, QK-norm, sandwich norms) get a larger embedding so that their logits are far from uniform
(see scripts/model_shapes.py). Gemma 3's sandwich norms scale every layer's output back to unit size,
so in a random model float8 activation rounding (3 mantissa bits) moves its log-probabilities by
~0.1 whatever the weights: there the statistical bounds apply to the int8 and weight-only formats,
and every format gets the exact comparison without activation rounding.
"""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch

from engine.models.attention_context import AttentionMetadata, attention_context
from engine.models.layers import Linear, MergedLinear
from engine.models.loader import load_model
from engine.models.quant_linear import QuantLinear
from scripts.make_model import make_model
from scripts.model_shapes import get_spec

pytestmark = pytest.mark.parity

FORMATS = ["fp8-block", "int8", "fp8-channel", "fp8-tensor", "online-fp8"]
MODELS = {
    "tiny-quant": get_spec("tiny-quant"),
    "qwen3": dataclasses.replace(get_spec("tiny-qwen3"), embed_std=0.1),
    "gemma3": dataclasses.replace(get_spec("tiny-gemma3"), embed_std=0.3),
}
EXPECTED = {  # format: (qweight dtype, scheme, act_quant)
    "fp8-block": (torch.float8_e4m3fn, "block", "fp8_group128"),
    "int8": (torch.int8, "channel", "int8_token"),
    "fp8-channel": (torch.float8_e4m3fn, "channel", "fp8_token"),
    "fp8-tensor": (torch.float8_e4m3fn, "channel", None),
    "online-fp8": (torch.float8_e4m3fn, "channel", "fp8_token"),
}
PROMPT_LENS = [1, 2, 3, 5, 7, 9, 12, 14, 17, 21, 25, 33, 40, 50, 60, 64]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{(model, format or "plain"): directory}, made on first use."""
    root = tmp_path_factory.mktemp("quant")
    made = {}

    def get(model: str, fmt: str, twin: bool = False):
        fmt = "fp8-channel" if fmt == "online-fp8" else fmt  # online fp8 quantises the plain checkpoint
        key = (model, fmt, twin)
        if key not in made:
            quant = None if fmt == "plain" else fmt
            made[key] = make_model(
                MODELS[model], root / f"{model}-{fmt}-{twin}", quant=quant, dequantized_twin=twin
            )
        return made[key]

    return get


def _load(checkpoints, model: str, fmt: str):
    if fmt == "online-fp8":
        return load_model(checkpoints(model, "plain"), dtype="float32", progress=False, quantization="fp8")[0]
    return load_model(checkpoints(model, fmt), dtype="float32", progress=False)[0]


@torch.no_grad()
def _first_token_logprobs(model) -> torch.Tensor:
    """log-probabilities of the token after each prompt: [prompts, vocab], every prompt in one batch."""
    gen = torch.Generator().manual_seed(11)
    vocab = model.cfg.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    with attention_context(AttentionMetadata.for_full_sequences([len(p) for p in prompts])):
        hidden = model(ids, positions)
    last = torch.tensor(PROMPT_LENS).cumsum(0) - 1
    return torch.log_softmax(model.compute_logits(hidden[last]).double(), dim=-1)


def _quant_modules(model) -> list[QuantLinear]:
    return [m for m in model.modules() if isinstance(m, QuantLinear)]


@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("fmt", FORMATS)
def test_matches_dequantized_twin(checkpoints, model_name, fmt):
    model = _load(checkpoints, model_name, fmt)
    twin = load_model(checkpoints(model_name, fmt, twin=True), dtype="float32", progress=False)[0]
    layers = MODELS[model_name].num_layers
    assert len(_quant_modules(model)) == 4 * layers and not _quant_modules(twin)  # qkv, o, gate_up, down
    for m in _quant_modules(model):
        assert (m.qweight.dtype, m.scheme, m.act_quant) == EXPECTED[fmt] and m.scale.dtype == torch.float32
    ours, ref = _first_token_logprobs(model), _first_token_logprobs(twin)
    assert ref.exp().max(dim=-1).values.mean() > 0.05  # far from uniform (1 / vocab = 0.0005)
    top = ref.topk(20, dim=-1).indices
    delta = (ours.gather(1, top) - ref.gather(1, top)).abs().mean().item()
    agreement = (ours.argmax(-1) == ref.argmax(-1)).double().mean().item()
    if model_name != "gemma3" or EXPECTED[fmt][2] in (None, "int8_token"):  # see the module docstring
        assert agreement >= 0.9 and delta <= 0.05, (agreement, delta)
    assert delta > 0 or EXPECTED[fmt][2] is None  # activation rounding is really applied
    for m in _quant_modules(model):  # without activation rounding, only float32 summation order differs
        m.act_quant = None
    torch.testing.assert_close(_first_token_logprobs(model), ref, atol=1e-4, rtol=0)


def test_online_fp8_equals_the_fp8_channel_checkpoint(checkpoints):
    online = load_model(checkpoints("tiny-quant", "plain"), progress=False, quantization="fp8")[0]
    stored = load_model(checkpoints("tiny-quant", "fp8-channel"), progress=False)[0]
    pairs = list(zip(_quant_modules(online), _quant_modules(stored), strict=True))
    assert len(pairs) == 8
    for a, b in pairs:
        assert torch.equal(a.qweight.view(torch.uint8), b.qweight.view(torch.uint8))
        assert torch.equal(a.scale, b.scale)
    assert torch.equal(online.lm_head.weight, stored.lm_head.weight)  # lm_head stays in the model dtype


def test_model_dtype_applies_to_the_unquantised_parts(checkpoints):
    model = load_model(checkpoints("tiny-quant", "fp8-block"), dtype="bfloat16", progress=False)[0]
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.qweight.dtype == torch.float8_e4m3fn and qkv.scale.dtype == torch.float32
    assert qkv.scale.shape == (2 + 1 + 1, 2) and qkv.row_block.dtype == torch.int32  # q 192 rows: 2 tiles
    assert model.model.embed_tokens.weight.dtype == model.lm_head.weight.dtype == torch.bfloat16
    assert isinstance(model.lm_head, Linear) and not isinstance(model.lm_head, QuantLinear)
    assert _first_token_logprobs(model).isfinite().all()


def test_no_quantization_is_unchanged(tmp_path):
    transformers = pytest.importorskip("transformers")  # noqa: F841
    from tests.conftest_models import hf_logits, save_checkpoint, tiny_hf_model

    hf = tiny_hf_model("llama")
    ckpt = save_checkpoint(hf, tmp_path / "llama", sharded=False)
    model, cfg = load_model(ckpt, progress=False, quantization=None)
    assert not _quant_modules(model)
    for layer in model.model.layers:
        assert type(layer.self_attn.qkv_proj) is MergedLinear and type(layer.mlp.down_proj) is Linear
    ids = torch.randint(0, cfg.vocab_size, (23,), generator=torch.Generator().manual_seed(0)).tolist()
    with mock.patch("kernels.ops.quant_linear", side_effect=AssertionError("quantised path used")):
        with torch.no_grad(), attention_context(AttentionMetadata.for_full_sequences([len(ids)])):
            logits = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids))))
    torch.testing.assert_close(logits, hf_logits(hf, ids), atol=1e-4, rtol=0)


@pytest.mark.engine
def test_engine_option_quantizes_at_load(checkpoints):
    from engine import LLM
    from engine.sampling_params import SamplingParams

    plain = checkpoints("tiny-quant", "plain")
    llm = LLM(str(plain), quantization="fp8", device="cpu", dtype="float32", num_blocks=16, block_size=16)
    model = llm.engine.runner.model
    assert len(_quant_modules(model)) == 8
    prompt = list(range(5, 25))
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, logprobs=0))[0].outputs[0]
    with torch.no_grad(), attention_context(AttentionMetadata.for_full_sequences([len(prompt)])):
        logits = model.compute_logits(model(torch.tensor(prompt), torch.arange(len(prompt)))[-1:])
    expected = torch.log_softmax(logits.double(), dim=-1)[0]
    assert out.token_ids == [int(expected.argmax())]
    assert abs(out.logprobs[0].logprob - float(expected.max())) < 1e-4
