"""Speculative-decoding configuration: which proposer drafts tokens and how many per step.

Key names follow vLLM's `speculative_config` so a user's dict carries over. Invariants, checked at
construction: 1 <= num_speculative_tokens <= 16; the n-gram proposer has
1 <= prompt_lookup_min <= prompt_lookup_max and no draft model; the draft-model proposer names a local
checkpoint directory. dtype / device None mean "follow the target model". The gated_lora_mtp method
(self-speculation: k mask tokens after each real token, a LoRA active only at the mask positions and a
sampler head; engine/spec/mtp_head.py, docs/architecture.md) names the local directory holding the
LoRA and the head in `model`, takes k <= 8, and neither dtype / device (it runs inside the target) nor
the n-gram options. Nothing here loads a model: `check_draft_vocab` is for the loader, once both
vocabularies are known, and engine/spec/mtp_head.py checks an MTP directory.

When speculation stops for a sequence (engine/spec/speculator.py): after `acceptance_window` proposed
tokens its acceptance rate is below `disable_below_acceptance` (it decodes plainly from then on), or
more than `disable_by_batch_size` sequences are running (it speculates again once fewer are).
`synthetic_acceptance_rate` is for benchmarks only: each proposed token is accepted with that
probability whatever the models say (the emitted text is meaningless), and n-gram proposals are padded
to k, so a benchmark measures the mechanism at a chosen acceptance on random weights.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model", "gated_lora_mtp")
MTP_BATCH_LIMIT = 8  # gated_lora_mtp's default disable_by_batch_size (see SpeculativeConfig.batch_limit)
MAX_SPECULATIVE_TOKENS = 16  # verification scores k + 1 positions per row; more rarely pays off
MAX_MTP_TOKENS = 8  # gated_lora_mtp: each real token of a step carries k mask tokens, so k costs k + 1 rows
_DTYPES = ("auto", "float32", "float16", "bfloat16", "float64")


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"speculative_config.{field}: {message}")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "ngram" (prompt lookup), "draft_model" or "gated_lora_mtp" (self-speculation)
    num_speculative_tokens: int  # k: tokens proposed per sequence per step
    prompt_lookup_max: int = 4  # ngram: longest suffix tried as the lookup pattern
    prompt_lookup_min: int = 1  # ngram: shortest suffix tried before giving up
    model: str | None = None  # draft_model: a local HF-format checkpoint directory; gated_lora_mtp: its dir
    dtype: str | None = None  # draft_model: None follows the target's dtype
    device: str | None = None  # draft_model: None follows the target's device
    disable_by_batch_size: int | None = None  # no speculation while more sequences than this run
    disable_below_acceptance: float = 0.1  # a sequence's accepted / proposed below this stops it
    acceptance_window: int = 16  # proposed tokens of a sequence before its rate is judged
    synthetic_acceptance_rate: float | None = None  # benchmarks only: accept each proposal with this
    quantization: str | None = None  # gated_lora_mtp: "fp8" keeps the sampler head's weights in float8

    @property
    def batch_limit(self) -> int | None:
        """The running sequences above which no sequence speculates: disable_by_batch_size, or for
        gated_lora_mtp when unset MTP_BATCH_LIMIT (its verify step scores (k + 1)^2 rows per sequence,
        which stops paying once the weights' read no longer dominates a step)."""
        if self.disable_by_batch_size is None and self.method == "gated_lora_mtp":
            return MTP_BATCH_LIMIT
        return self.disable_by_batch_size

    def __post_init__(self) -> None:
        _require(self.method in METHODS, "method", f"got {self.method!r}; use one of {list(METHODS)}")
        k = self.num_speculative_tokens
        _require(
            isinstance(k, int) and 1 <= k <= MAX_SPECULATIVE_TOKENS,
            "num_speculative_tokens",
            f"got {k!r}; use an integer in [1, {MAX_SPECULATIVE_TOKENS}]",
        )
        if self.method != "gated_lora_mtp":
            _require(self.quantization is None, "quantization", "only gated_lora_mtp takes it; remove it")
        if self.method == "ngram":
            self._check_ngram()
        elif self.method == "draft_model":
            self._check_draft_model()
        else:
            self._check_mtp()
        self._check_policy()

    def _check_policy(self) -> None:
        b = self.disable_by_batch_size
        _require(b is None or (isinstance(b, int) and b >= 1), "disable_by_batch_size",
                 f"got {b!r}; use None (never) or an integer >= 1")  # fmt: skip
        r = self.disable_below_acceptance
        ok = isinstance(r, (int, float)) and 0.0 <= r <= 1.0
        _require(ok, "disable_below_acceptance", f"got {r!r}; use a rate in [0, 1] (0: never)")
        w = self.acceptance_window
        _require(isinstance(w, int) and w >= 1, "acceptance_window", f"got {w!r}; use an integer >= 1")
        a = self.synthetic_acceptance_rate
        ok = a is None or (isinstance(a, (int, float)) and 0.0 <= a <= 1.0)
        _require(ok, "synthetic_acceptance_rate", f"got {a!r}; use None or a probability in [0, 1]")

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

    def _check_mtp(self) -> None:
        k = self.num_speculative_tokens
        fix_k = f"got {k}; gated_lora_mtp drafts at most {MAX_MTP_TOKENS} per step: use 1..{MAX_MTP_TOKENS}"
        _require(k <= MAX_MTP_TOKENS, "num_speculative_tokens", fix_k)
        _require(
            isinstance(self.model, str) and bool(self.model),
            "model",
            "the gated_lora_mtp method needs it; give the path of a local directory holding the gated LoRA "
            "and the MTP head (adapter_config.json, mtp_config.json, ...)",
        )
        q = self.quantization
        _require(q in (None, "fp8"), "quantization", f"got {q!r}; use None (the model's dtype) or 'fp8'")
        for name in ("dtype", "device"):
            why = "gated_lora_mtp runs inside the target model and follows its dtype and device; remove it"
            _require(getattr(self, name) is None, name, why)
        for f in fields(self):
            if f.name.startswith("prompt_lookup_"):
                unchanged = getattr(self, f.name) == f.default
                _require(unchanged, f.name, "only ngram takes it; remove it for gated_lora_mtp")

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
