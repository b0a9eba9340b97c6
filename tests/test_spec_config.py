"""SpeculativeConfig accepts vLLM-style dicts and rejects bad ones with the field named and a fix."""

from __future__ import annotations

import pytest

from engine.spec_config import SpeculativeConfig, check_draft_vocab

pytestmark = pytest.mark.engine


def test_valid_configs_keep_their_values():
    d = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}
    ngram = SpeculativeConfig.from_dict(d)
    assert (ngram.num_speculative_tokens, ngram.prompt_lookup_max, ngram.prompt_lookup_min) == (3, 5, 1)
    draft = SpeculativeConfig.from_dict(
        {"method": "draft_model", "num_speculative_tokens": 16, "model": "/ckpt/draft", "dtype": "bfloat16"}
    )
    assert (draft.model, draft.dtype, draft.device) == ("/ckpt/draft", "bfloat16", None)
    mtp = SpeculativeConfig.from_dict(
        {"method": "gated_lora_mtp", "num_speculative_tokens": 8, "model": "/mtp"}
    )
    assert (mtp.method, mtp.num_speculative_tokens, mtp.model, mtp.dtype, mtp.device, mtp.quantization) == (
        "gated_lora_mtp", 8, "/mtp", None, None, None,
    )  # fmt: skip
    d = {"method": "gated_lora_mtp", "num_speculative_tokens": 4, "model": "/mtp", "quantization": "fp8"}
    assert SpeculativeConfig.from_dict(d).quantization == "fp8"


@pytest.mark.parametrize(
    "d,field",
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2.0}, "num_speculative_tokens"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
         "prompt_lookup_max"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "/ckpt"}, "model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "device": "cpu"}, "device"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
        ({"method": "draft_model", "num_speculative_tokens": 2, "model": "/c", "dtype": "fp4"}, "dtype"),
        ({"method": "draft_model", "num_speculative_tokens": 2, "model": "/c", "device": "tpu"}, "device"),
        ({"method": "ngram", "num_speculative_tokens": 2, "acceptance_method": "x"}, "acceptance_method"),
        ({"method": "gated_lora_mtp", "num_speculative_tokens": 2}, "model"),
        ({"method": "gated_lora_mtp", "num_speculative_tokens": 2, "model": ""}, "model"),
        ({"method": "gated_lora_mtp", "num_speculative_tokens": 9, "model": "/m"}, "num_speculative_tokens"),
        ({"method": "gated_lora_mtp", "num_speculative_tokens": 2, "model": "/m", "dtype": "bf16"}, "dtype"),
        ({"method": "gated_lora_mtp", "num_speculative_tokens": 2, "model": "/m", "device": "cpu"}, "device"),
        ({"method": "gated_lora_mtp", "num_speculative_tokens": 2, "model": "/m", "prompt_lookup_max": 3},
         "prompt_lookup_max"),
        ({"method": "gated_lora_mtp", "num_speculative_tokens": 2, "model": "/m", "prompt_lookup_min": 2},
         "prompt_lookup_min"),
        ({"method": "gated_lora_mtp", "num_speculative_tokens": 2, "model": "/m", "quantization": "int4"},
         "quantization"),
        ({"method": "ngram", "num_speculative_tokens": 2, "quantization": "fp8"}, "quantization"),
        ({"method": "draft_model", "num_speculative_tokens": 2, "model": "/c", "quantization": "fp8"},
         "quantization"),
    ],
)  # fmt: skip
def test_bad_configs_name_the_field(d, field):
    with pytest.raises(ValueError, match=rf"^speculative_config\.{field}: "):
        SpeculativeConfig.from_dict(d)


def test_gated_lora_mtp_messages_give_the_fix():
    cases = [
        ({"num_speculative_tokens": 9, "model": "/m"}, r"num_speculative_tokens: got 9; .*at most 8.*1\.\.8"),
        ({"num_speculative_tokens": 2}, r"model: the gated_lora_mtp method needs it; give the path"),
        ({"num_speculative_tokens": 2, "model": "/m", "dtype": "float16"}, r"dtype: .*follows its dtype"),
        (
            {"num_speculative_tokens": 2, "model": "/m", "quantization": "int8"},
            r"quantization: got 'int8'; .*'fp8'",
        ),
    ]
    for d, message in cases:
        with pytest.raises(ValueError, match=rf"^speculative_config\.{message}"):
            SpeculativeConfig.from_dict({"method": "gated_lora_mtp", **d})
    # the defaults of the n-gram options are no change, whether given or not
    d = {"method": "gated_lora_mtp", "num_speculative_tokens": 1, "model": "/m", "prompt_lookup_max": 4}
    assert SpeculativeConfig.from_dict(d).prompt_lookup_max == 4


def test_config_is_frozen():
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    with pytest.raises(AttributeError):
        cfg.num_speculative_tokens = 4  # type: ignore[misc]


def test_draft_vocab_must_match():
    check_draft_vocab(32000, 32000)
    with pytest.raises(ValueError, match=r"speculative_config\.model: .*32001.*32000"):
        check_draft_vocab(32000, 32001)
