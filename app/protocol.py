"""OpenAI-compatible request models, and their mapping onto engine SamplingParams.

Requests forbid unknown fields (extra="forbid"), so a misspelt option is a 422 that names the field
(and the closest known one) instead of being silently ignored; OpenAI fields this server does not
implement are refused first, with 400 `unsupported_parameter` (app/field_policy.py). Value ranges are
checked once, by SamplingParams; its InvalidRequestError carries the field name, which the ingress
reports as the error's `param`. Response bodies are in app/responses.py.
Extensions beyond OpenAI: top_k, min_p, repetition_penalty, ignore_eos, stop_token_ids,
include_stop_str_in_output, tools_calculator (nanochat calculator), budget_forcing, and vLLM's
prompt_logprobs, return_token_ids, stream_options.continuous_usage_stats, chat_template_kwargs,
add_generation_prompt, continue_final_message, include_reasoning and structured_outputs.
Structured output (response_format, structured_outputs) and tools (tools, tool_choice,
parallel_tool_calls) are typed loosely here and checked by app/structured.py, so that every problem
with them is a 400 naming the exact field (docs/api.md, Structured output and tools).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from app import structured
from app.chat import ChatPrompt
from app.field_policy import (
    CHAT_UNSUPPORTED,
    COMPLETION_UNSUPPORTED,
    model_field_names,
    reject_unsupported,
)
from app.messages import ChatMessage, StrictModel
from engine.errors import InvalidRequestError
from engine.sampling_params import BudgetForcing, SamplingParams, StructuredOutput, ToolConfig

# ---------------------------------------------------------------- requests


_Strict = StrictModel


class StreamOptions(_Strict):
    include_usage: bool = False
    # vLLM's extension: usage on every chunk (of the engine request the chunk belongs to)
    continuous_usage_stats: bool = False


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
    logit_bias: dict[str, float] | None = None  # OpenAI's shape: token id (as a string) -> bias
    prompt_logprobs: int | None = None  # vLLM: each prompt token's logprob plus the top k
    return_token_ids: bool = False  # vLLM: the prompt's token ids and each choice's, beside the text
    # constraints, checked by app/structured.py: OpenAI's response_format, vLLM's structured_outputs
    response_format: Any = None
    structured_outputs: Any = None
    # accepted and ignored: they do not change what is generated (docs/api.md, field policy)
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    parallel_tool_calls: Any = None  # chat with tools: false allows one call; otherwise ignored
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def _sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None,
        constraint: StructuredOutput | None,
    ) -> SamplingParams:
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
            prompt_logprobs=prompt_logprobs,
            logit_bias=dict(self.logit_bias) if self.logit_bias is not None else None,  # keys: ids as strings
            structured=constraint,
        )


PromptType = str | list[int] | list[str] | list[list[int]]


class CompletionRequest(_SamplingRequest):
    prompt: PromptType
    logprobs: int | None = None  # completions: number of top alternatives per token
    echo: bool = False  # the prompt (as the model saw it: its decoded tokens) before the completion

    @model_validator(mode="before")
    @classmethod
    def refuse_unsupported(cls, raw: Any) -> Any:
        return reject_unsupported(raw, COMPLETION_UNSUPPORTED)

    def prompts(self) -> list[str | list[int]]:
        """One entry per engine request; a list of strings or of token-id lists gives several."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise InvalidRequestError("prompt: must not be empty", field="prompt")
        return list(p)

    @property
    def prompt_logprobs_k(self) -> int | None:
        """What to ask the engine for: echo with logprobs covers the prompt too (OpenAI's legacy echo),
        prompt_logprobs asks for it alone; the larger top k serves both. None: the prefill computes none."""
        wanted = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(wanted) if wanted else None

    def sampling_params(self) -> SamplingParams:
        max_tokens = 16 if self.max_tokens is None else self.max_tokens
        constraint = structured.one_constraint(self.response_format, self.structured_outputs)
        return self._sampling_params(max_tokens, self.logprobs, self.prompt_logprobs_k, constraint)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables (enable_thinking, ...)
    add_generation_prompt: bool | None = None  # default: true, or false with continue_final_message
    continue_final_message: bool = False
    include_reasoning: bool | None = None  # split <think>...</think> off; default: the server's setting
    tools: Any = None  # OpenAI's function definitions (app/structured.py checks them)
    tool_choice: Any = None  # "none", "auto" (the default with tools), "required" or a named function

    @model_validator(mode="before")
    @classmethod
    def refuse_unsupported(cls, raw: Any) -> Any:
        return reject_unsupported(raw, CHAT_UNSUPPORTED)

    def engine_messages(self) -> list[dict[str, Any]]:
        return [m.as_engine_message(i) for i, m in enumerate(self.messages)]

    def constraints(self) -> tuple[StructuredOutput | None, structured.ToolChoice | None]:
        """(the constraint for the engine, how to find tool calls): app/structured.resolve."""
        return structured.resolve(
            self.response_format,
            self.structured_outputs,
            self.tools,
            self.tool_choice,
            self.parallel_tool_calls,
        )

    def chat_prompt(self) -> ChatPrompt:
        """What the engine replica renders with the model's template (app/chat.py)."""
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequestError(
                "continue_final_message: cannot be combined with add_generation_prompt=true (the last "
                "message is continued, so no new assistant turn is opened): drop add_generation_prompt",
                "continue_final_message",
            )
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise InvalidRequestError(
                "continue_final_message: the last message must be an assistant message to continue",
                "continue_final_message",
            )
        add = (
            not self.continue_final_message
            if self.add_generation_prompt is None
            else self.add_generation_prompt
        )
        tools = self.tools or None  # [] is no tools
        if tools is not None:
            structured.function_parameters(tools)  # the template gets only checked definitions
        return ChatPrompt(
            self.engine_messages(),
            add,
            self.continue_final_message,
            dict(self.chat_template_kwargs or {}),
            tools=tools,
        )

    def reasoning(self, server_default: bool) -> str:
        """'split' (reasoning_content + content), 'drop' (content only) or 'off' (raw text in content).
        include_reasoning=false with the server's parser on drops the reasoning, as vLLM does."""
        if self.include_reasoning is None:
            return "split" if server_default else "off"
        if self.include_reasoning:
            return "split"
        return "drop" if server_default else "off"

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs: set logprobs=true to use it", field="top_logprobs")
        k = (self.top_logprobs or 0) if self.logprobs else None
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        constraint = self.constraints()[0]
        try:
            return self._sampling_params(
                default_max_tokens if limit is None else limit, k, self.prompt_logprobs, constraint
            )
        except InvalidRequestError as exc:
            if exc.field == "logprobs":  # chat names the count top_logprobs
                raise InvalidRequestError(
                    str(exc).replace("logprobs", "top_logprobs", 1), "top_logprobs"
                ) from exc
            raise


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a text `prompt`, or chat `messages` rendered with the model's template."""

    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (in the template)
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Any = None  # rendered by the template, as in chat requests

    def source(self) -> str | ChatPrompt:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("prompt: give either prompt or messages (one of them)", "prompt")
        if self.prompt is not None:
            return self.prompt
        if not self.messages:
            raise InvalidRequestError("messages: must not be empty", "messages")
        chat = ChatCompletionRequest(
            model=self.model or "",
            messages=self.messages,
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            chat_template_kwargs=self.chat_template_kwargs,
            tools=self.tools,
        )
        return chat.chat_prompt()


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


# Every declared field name, for the closest-name hint of an unknown field (app/field_policy.py)
KNOWN_FIELDS = model_field_names(CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)
