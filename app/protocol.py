"""OpenAI-compatible request and response models, and their mapping onto engine SamplingParams.

Requests forbid unknown fields (extra="forbid"), so a misspelt or unsupported option is a 422 that
names the field instead of being silently ignored. Value ranges are checked once, by SamplingParams;
its InvalidRequestError carries the field name, which the ingress reports as the error's `param`.
Extensions beyond OpenAI: top_k, min_p, repetition_penalty, ignore_eos, stop_token_ids,
include_stop_str_in_output, tools_calculator (nanochat calculator) and budget_forcing.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.errors import InvalidRequestError
from engine.sampling_params import BudgetForcing, SamplingParams, ToolConfig

# ---------------------------------------------------------------- requests


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class BudgetForcingArgs(_Strict):
    suppress: str = "</think>"
    replacements: list[str] = Field(default_factory=lambda: ["Wait"])
    min_tokens: int = 0


class _SamplingRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    tools_calculator: bool = False
    budget_forcing: BudgetForcingArgs | None = None
    user: str | None = None  # accepted for OpenAI compatibility, unused

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        forcing = None
        if self.budget_forcing is not None:
            forcing = BudgetForcing(**self.budget_forcing.model_dump())
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            logprobs=logprobs,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            tool=ToolConfig() if self.tools_calculator else None,
            budget_forcing=forcing,
        )


PromptType = str | list[int] | list[str] | list[list[int]]


class CompletionRequest(_SamplingRequest):
    prompt: PromptType
    logprobs: int | None = None  # completions: number of top alternatives per token

    def prompts(self) -> list[str | list[int]]:
        """One entry per engine request; a list of strings or of token-id lists gives several."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise InvalidRequestError("prompt: must not be empty", field="prompt")
        return list(p)

    def sampling_params(self) -> SamplingParams:
        return self._sampling_params(16 if self.max_tokens is None else self.max_tokens, self.logprobs)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_engine_message(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def engine_messages(self) -> list[dict[str, str]]:
        return [m.as_engine_message() for m in self.messages]

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs: set logprobs=true to use it", field="top_logprobs")
        k = (self.top_logprobs or 0) if self.logprobs else None
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        try:
            return self._sampling_params(default_max_tokens if limit is None else limit, k)
        except InvalidRequestError as exc:
            if exc.field == "logprobs":  # chat names the count top_logprobs
                raise InvalidRequestError(
                    str(exc).replace("logprobs", "top_logprobs", 1), "top_logprobs"
                ) from exc
            raise


# ---------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """Both the non-streaming body and each streamed chunk (OpenAI uses one shape for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "minserve"
    max_model_len: int | None = None  # extension, as in vLLM
    vocab_size: int | None = None  # extension: lets load generators send valid token-id prompts


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
