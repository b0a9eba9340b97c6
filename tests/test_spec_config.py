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
    ],
)  # fmt: skip
def test_bad_configs_name_the_field(d, field):
    with pytest.raises(ValueError, match=rf"^speculative_config\.{field}: "):
        SpeculativeConfig.from_dict(d)


def test_config_is_frozen():
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    with pytest.raises(AttributeError):
        cfg.num_speculative_tokens = 4  # type: ignore[misc]


def test_draft_vocab_must_match():
    check_draft_vocab(32000, 32000)
    with pytest.raises(ValueError, match=r"speculative_config\.model: .*32001.*32000"):
        check_draft_vocab(32000, 32001)
