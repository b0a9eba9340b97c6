"""Tokenizer: a thin, offline wrapper around a checkpoint's Hugging Face tokenizer.

transformers is used here only to read tokenizer files (tokenizer.json & co); chat templates are
rendered by engine/chat_template.py. Decoding never applies clean_up_tokenization_spaces, so that the
streamed text (engine/output/detokenizer.py) always equals one decode of all the ids.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from engine.chat_template import ChatTemplate

# Never reach the network: checkpoints are local directories. Must be set before huggingface_hub is
# imported, which happens lazily in from_dir.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")


def _eos_ids_from(path: Path) -> set[int]:
    """eos_token_id from a config-like JSON file: an int, a list of ints, or absent."""
    if not path.is_file():
        return set()
    value = json.loads(path.read_text()).get("eos_token_id")
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, list) else {int(value)}


# The tokenizer class that transformers' (5.x) AutoTokenizer picks for a model type when
# tokenizer_config.json declares one of these: it then keeps the declared class, which can be named
# directly. Going through AutoTokenizer instead loads the model's config class, whose imports (torch
# among them) take seconds of every engine replica's and engine core's start.
_BACKEND = {"PreTrainedTokenizerFast", "TokenizersBackend"}  # one class under two names
_GEMMA = _BACKEND | {"GemmaTokenizer", "GemmaTokenizerFast"}
_KEPT_AS_DECLARED = {
    "llama": _BACKEND,
    "qwen3": _BACKEND | {"Qwen2Tokenizer", "Qwen2TokenizerFast"},
    "gemma3": _GEMMA,
    "gemma3_text": _GEMMA,
}


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        value = {}  # AutoTokenizer then reads the file and reports what is wrong with it
    return value if isinstance(value, dict) else {}


def _declared_class(path: Path) -> Any:
    """The class that loads this checkpoint's tokenizer: the declared one where AutoTokenizer is known to
    keep it (tests/test_tokenizer_class.py checks the two agree), else AutoTokenizer itself."""
    import transformers  # heavy import, only when a tokenizer is really loaded

    declared = _read_json(path / "tokenizer_config.json")
    model_type = _read_json(path / "config.json").get("model_type")
    name = declared.get("tokenizer_class")
    major = int(transformers.__version__.split(".")[0])  # 4.x picks fast classes by other rules
    kept = _KEPT_AS_DECLARED.get(model_type, set())
    if major < 5 or "auto_map" in declared or not isinstance(name, str) or name not in kept:
        return transformers.AutoTokenizer
    if name in _BACKEND:
        return transformers.PreTrainedTokenizerFast  # TokenizersBackend under its older name
    return getattr(transformers, name.removesuffix("Fast"))  # one class per family, as AutoTokenizer names it


class Tokenizer:
    """Encode/decode text and render chats for one checkpoint directory."""

    def __init__(self, hf_tokenizer: Any, model_dir: str | Path):
        self.hf = hf_tokenizer
        self.model_dir = Path(model_dir)
        self.vocab_size: int = len(hf_tokenizer)  # includes added tokens
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self.pad_token_id: int | None = hf_tokenizer.pad_token_id
        # Generation stops at any of these: the tokenizer's eos plus every eos id in the model configs
        # (chat models end turns with e.g. <|eot_id|>, which the tokenizer's eos_token may not be).
        eos = {hf_tokenizer.eos_token_id} - {None}
        eos |= _eos_ids_from(self.model_dir / "generation_config.json")
        eos |= _eos_ids_from(self.model_dir / "config.json")
        self.eos_token_ids: set[int] = eos
        self.all_special_ids: set[int] = set(hf_tokenizer.all_special_ids)
        self._chat_template: ChatTemplate | None = None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(
                f"tokenizer directory {path} does not exist; pass a local checkpoint directory"
            )
        if not any((path / name).is_file() for name in TOKENIZER_FILES):
            raise FileNotFoundError(
                f"{path} has no tokenizer file (looked for {', '.join(TOKENIZER_FILES)}); copy the "
                f"checkpoint's tokenizer.json and tokenizer_config.json into it, or make a checkpoint "
                f"with `python -m scripts.make_model`"
            )
        try:
            hf = _declared_class(path).from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise ValueError(f"could not load the tokenizer in {path}: {exc}") from exc
        return cls(hf, path)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        # The Rust backend directly: same text as hf.decode without clean-up, minus a costly Python
        # wrapper (this runs twice per generated token in the detokenizer).
        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is not None:
            return backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.hf.decode(
            list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    @property
    def rust(self) -> Any:
        """The tokenizers.Tokenizer behind a fast tokenizer (engine/output/detokenizer.py streams with
        it), or None."""
        return getattr(self.hf, "backend_tokenizer", None)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return self.hf.convert_ids_to_tokens(list(ids))

    def token_id(self, token: str) -> int | None:
        """The id of one vocabulary entry (e.g. "<|eot_id|>"), or None when it is not in the vocabulary."""
        tid = self.hf.convert_tokens_to_ids(token)
        if tid is None or (tid == self.hf.unk_token_id and token != self.hf.unk_token):
            return None
        return int(tid)

    @property
    def chat_template(self) -> ChatTemplate:
        """Loaded on first use, so checkpoints without a template still serve plain completions."""
        if self._chat_template is None:
            self._chat_template = ChatTemplate.from_dir(self.model_dir, self.hf.special_tokens_map)
        return self._chat_template

    @property
    def chat_template_source(self) -> str | None:
        """The template's Jinja source, or None for a checkpoint without any (plain completions only)."""
        from engine.chat_template import ChatTemplateError

        try:
            return self.chat_template.source
        except ChatTemplateError:
            return None

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, **kwargs)

    def encode_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        # The rendered text already holds the template's bos; adding specials again would double it.
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)
