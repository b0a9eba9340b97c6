"""Per-request sampling parameters, validated at construction (errors name the field)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_TOP_LOGPROBS = 20
MAX_N = 16
MAX_LOGIT_BIAS = 100.0


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(f"{name}: {message}", field=name)


class RequestOutputKind(enum.Enum):
    """What the offline engine hands out for a request (vLLM's name). DELTA: each step's new tokens and
    text. FINAL_ONLY: one output when the request ends, with all of it; its text is made then, at
    once, unless a stop string has to be looked for as tokens arrive (`LLM.generate` asks for this)."""

    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class ToolConfig:
    """nanochat calculator: text between start/end markers is evaluated and the result forced back."""

    python_start: str = "<|python_start|>"
    python_end: str = "<|python_end|>"
    output_start: str = "<|output_start|>"
    output_end: str = "<|output_end|>"


@dataclass
class BudgetForcing:
    """batchspec-style budget forcing: until `min_tokens` are generated, a sampled `suppress` token is
    replaced by the tokens of the next string in `replacements` (cycled)."""

    suppress: str = "</think>"
    replacements: list[str] = field(default_factory=lambda: ["Wait"])
    min_tokens: int = 0

    def __post_init__(self) -> None:
        _check(bool(self.suppress), "budget_forcing.suppress", "must be a non-empty string")
        _check(len(self.replacements) >= 1, "budget_forcing.replacements", "give at least one string")
        _check(self.min_tokens >= 0, "budget_forcing.min_tokens", "must be >= 0")


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the generated text."""

    # "json" (spec: a JSON schema, dict or JSON string), "json_object" (spec None: any JSON object),
    # "regex" (spec: str), "choice" (spec: list[str]), "grammar" (spec: str, Lark syntax as llguidance
    # takes it). Checked and compiled by engine/structured/compiler.py (from engine.sched.admission.check).
    kind: str
    spec: object = None
    field: str = "structured_outputs"  # the API field errors are reported against


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 or -1: disabled
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: int | None = None  # None: no logprobs; k >= 0: chosen token plus top k
    # None: none; k >= 0: each prompt token's logprob given the tokens before it, plus the top k there
    prompt_logprobs: int | None = None
    # token id -> added to the raw logits before any other processing (OpenAI's logit_bias)
    logit_bias: dict[int, float] | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    tool: ToolConfig | None = None
    budget_forcing: BudgetForcing | None = None
    # grammar-constrained decoding (engine/structured/compiler.py and state.py); None: free text
    structured: StructuredOutput | None = None
    output_kind: RequestOutputKind = RequestOutputKind.DELTA  # the offline engine's outputs

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        self._check_counts_and_knobs()
        self._check_logprobs()
        self.logit_bias = _logit_bias(self.logit_bias)
        self._check_stop_strings()
        _check(
            isinstance(self.output_kind, RequestOutputKind),
            "output_kind",
            "must be RequestOutputKind.DELTA or RequestOutputKind.FINAL_ONLY",
        )
        _check(
            self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
            "seed",
            "must be an integer in [0, 2**63)",
        )

    def _check_counts_and_knobs(self) -> None:
        """n, max_tokens and the float sampling knobs: finite and in range."""
        _check(isinstance(self.n, int) and 1 <= self.n <= MAX_N, "n", f"must be an integer in [1, {MAX_N}]")
        # 0: score the prompt only (prefill, then finish by length with no completion tokens)
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 0, "max_tokens", "must be >= 0")
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            _check(math.isfinite(float(getattr(self, name))), name, "must be a finite number")
        _check(0.0 <= self.temperature <= 100.0, "temperature", "must be in [0, 100]")
        _check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        _check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        _check(self.top_k >= 0, "top_k", "must be >= 0 (0 or -1 disables it)")
        _check(0.0 < self.repetition_penalty <= 10.0, "repetition_penalty", "must be in (0, 10]")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")

    def _check_logprobs(self) -> None:
        _check(
            self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
            "logprobs",
            f"must be in [0, {MAX_TOP_LOGPROBS}]",
        )
        _check(
            self.prompt_logprobs is None
            or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS),
            "prompt_logprobs",
            f"must be in [0, {MAX_TOP_LOGPROBS}]",
        )

    def _check_stop_strings(self) -> None:
        _check(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} stop strings")
        for s in self.stop:
            _check(
                isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_LEN,
                "stop",
                f"each stop string must be 1..{MAX_STOP_STRING_LEN} characters",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_host_tokens(self) -> bool:
        """True when the next step's input depends on host-side token work: forced tokens (tool, budget
        forcing) replace or follow the sampled one. Such sequences never run a step ahead of their
        sampled tokens."""
        return self.tool is not None or self.budget_forcing is not None

    @property
    def draws_from_history(self) -> bool:
        """True when the draw reads the host's token history (penalties; a grammar reads its matcher):
        in a step launched ahead, such a row draws only once the previous step's tokens are appended
        (engine/runner/model_runner.DeferredSample)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _logit_bias(bias: dict | None) -> dict[int, float] | None:
    """Validated {token id: bias}; JSON's string keys ("50256") become ints. Empty means none, so a
    request that sends {} pays nothing in the sampler."""
    if bias is None:
        return None
    _check(isinstance(bias, dict), "logit_bias", "must map token ids to numbers")
    out: dict[int, float] = {}
    for key, value in bias.items():
        ok_key = _is_int(key) or (isinstance(key, str) and key.isdigit())
        _check(ok_key and int(key) >= 0, "logit_bias", f"token id {key!r} must be an integer >= 0")
        ok_value = (_is_int(value) or isinstance(value, float)) and math.isfinite(value)
        _check(
            ok_value and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS,
            "logit_bias",
            f"bias {value!r} of token {key} must be in [{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
        )
        out[int(key)] = float(value)
    return out or None


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
