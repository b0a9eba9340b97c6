"""Tokenizer.from_dir names the tokenizer class itself where transformers' AutoTokenizer is known to keep
the declared one (engine/tokenizer.py, _KEPT_AS_DECLARED): it must load exactly what AutoTokenizer loads,
the same class with the same ids, texts and special tokens, and fall back to AutoTokenizer elsewhere."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.tokenizer import _KEPT_AS_DECLARED, Tokenizer, _declared_class
from scripts.make_tokenizer import write_tokenizer

TEXTS = ["The river reaches the sea.", "  two  spaces\tand a tab\n", "numbers 12345 and ünïcödé", ""]
FAMILY = {"llama": "llama", "qwen3": "qwen3", "gemma3": "gemma3", "gemma3_text": "gemma3"}


def _checkpoint(root: Path, model_type: str, declared: str, extra: dict | None = None) -> Path:
    out = root / f"{model_type}-{declared}"
    out.mkdir()
    write_tokenizer(FAMILY.get(model_type, "llama"), 512, out, "{{ bos_token }}", 2048)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.update(tokenizer_class=declared, **(extra or {}))
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    (out / "config.json").write_text(json.dumps({"model_type": model_type, "eos_token_id": 1}))
    return out


def _facts(hf) -> dict:
    return {
        "class": type(hf),
        "len": len(hf),
        "specials": (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id, sorted(hf.all_special_ids)),
        "ids": [hf.encode(t, add_special_tokens=s) for t in TEXTS for s in (True, False)],
        "texts": [hf.decode(hf.encode(t), skip_special_tokens=s) for t in TEXTS for s in (True, False)],
        "tokens": [hf.convert_ids_to_tokens(hf.encode(t)) for t in TEXTS],
    }


CASES = [(model_type, name) for model_type, names in _KEPT_AS_DECLARED.items() for name in sorted(names)]


@pytest.mark.parametrize("model_type,declared", CASES)
def test_the_named_class_loads_what_autotokenizer_loads(tmp_path, model_type, declared):
    import transformers
    from transformers import AutoTokenizer

    path = _checkpoint(tmp_path, model_type, declared)
    if int(transformers.__version__.split(".")[0]) >= 5:  # 4.x always goes through AutoTokenizer
        assert _declared_class(path).__name__ != "AutoTokenizer"
    ours = Tokenizer.from_dir(path).hf
    reference = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    assert _facts(ours) == _facts(reference)


@pytest.mark.parametrize(
    "model_type,declared,extra",
    [
        ("mistral", "PreTrainedTokenizerFast", None),  # a model type the table does not list
        ("llama", "LlamaTokenizerFast", None),  # AutoTokenizer may swap it for the byte-level backend
        ("llama", "PreTrainedTokenizerFast", {"auto_map": {"AutoTokenizer": [None, "x.Tok"]}}),
    ],
)
def test_anything_else_goes_through_autotokenizer(tmp_path, model_type, declared, extra):
    assert _declared_class(_checkpoint(tmp_path, model_type, declared, extra)).__name__ == "AutoTokenizer"
