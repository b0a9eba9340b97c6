"""Speculative-decoding configuration: which proposer drafts tokens and how many per step.

Key names follow vLLM's `speculative_config` so a user's dict carries over. Invariants, checked at
construction: 1 <= num_speculative_tokens <= 16; the n-gram proposer has
1 <= prompt_lookup_min <= prompt_lookup_max and no draft model; the draft-model proposer names a local
checkpoint directory. dtype / device None mean "follow the target model". Nothing here loads a model:
`check_draft_vocab` is for the loader, once both vocabularies are known.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16  # verification scores k + 1 positions per row; more rarely pays off
_DTYPES = ("auto", "float32", "float16", "bfloat16", "float64")


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"speculative_config.{field}: {message}")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "ngram" (prompt lookup) or "draft_model"
    num_speculative_tokens: int  # k: tokens proposed per sequence per step
    prompt_lookup_max: int = 4  # ngram: longest suffix tried as the lookup pattern
    prompt_lookup_min: int = 1  # ngram: shortest suffix tried before giving up
    model: str | None = None  # draft_model: a local HF-format checkpoint directory
    dtype: str | None = None  # draft_model: None follows the target's dtype
    device: str | None = None  # draft_model: None follows the target's device

    def __post_init__(self) -> None:
        _require(self.method in METHODS, "method", f"got {self.method!r}; use one of {list(METHODS)}")
        k = self.num_speculative_tokens
        _require(
            isinstance(k, int) and 1 <= k <= MAX_SPECULATIVE_TOKENS,
            "num_speculative_tokens",
            f"got {k!r}; use an integer in [1, {MAX_SPECULATIVE_TOKENS}]",
        )
        if self.method == "ngram":
            self._check_ngram()
        else:
            self._check_draft_model()

    def _check_ngram(self) -> None:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        _require(isinstance(lo, int) and lo >= 1, "prompt_lookup_min", f"got {lo!r}; use an integer >= 1")
        fix_hi = f"got {hi!r}; use an integer >= prompt_lookup_min ({lo})"
        _require(isinstance(hi, int) and hi >= lo, "prompt_lookup_max", fix_hi)
        for name in ("model", "dtype", "device"):
            _require(getattr(self, name) is None, name, "only draft_model takes it; remove it for ngram")

    def _check_draft_model(self) -> None:
        _require(
            isinstance(self.model, str) and bool(self.model),
            "model",
            "the draft_model method needs it; give the path of a local draft checkpoint directory",
        )
        _require(
            self.dtype is None or self.dtype in _DTYPES,
            "dtype",
            f"got {self.dtype!r}; use None (follow the target) or one of {list(_DTYPES)}",
        )
        dev = self.device
        ok_device = dev is None or dev in ("auto", "cpu", "cuda") or dev.startswith("cuda:")
        _require(ok_device, "device", f"got {dev!r}; use None (follow the target), auto, cpu, cuda or cuda:N")

    @staticmethod
    def from_dict(d: dict[str, Any]) -> SpeculativeConfig:
        """Build from a vLLM-style dict; unknown keys are errors rather than silently ignored."""
        known = {f.name for f in fields(SpeculativeConfig)}
        for key in d:
            _require(key in known, str(key), f"unknown option; use one of {sorted(known)}")
        for key in ("method", "num_speculative_tokens"):
            _require(key in d, key, "required; set it")
        return SpeculativeConfig(**d)


def check_draft_vocab(target_vocab_size: int, draft_vocab_size: int) -> None:
    """Verification compares probabilities token by token, so both models must share one vocabulary."""
    _require(
        target_vocab_size == draft_vocab_size,
        "model",
        f"the draft model's vocabulary has {draft_vocab_size} tokens but the target's has "
        f"{target_vocab_size}; use a draft model with the target's tokenizer",
    )
