"""OpenAI-compatible response bodies (and vLLM's extensions to them), built by app/sse.py.

Tool calls (`message.tool_calls`, `delta.tool_calls`) have OpenAI's shape (app/tool_calls.py finds them).
Extensions: `reasoning_content` on chat messages and deltas (thinking models, app/reasoning.py),
`prompt_logprobs` per choice (vLLM's shape, app/logprob_shapes.py), `max_model_len` and `vocab_size`
on model cards, and the /tokenize and /detokenize bodies.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

# One prompt position of vLLM's prompt_logprobs: {token id as a string: {"logprob", "rank", "decoded_token"}}
PromptLogprobs = list[dict[str, dict] | None]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy shape. With echo, the prompt's first token has no logprob: null in both lists."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids (the first chunk, streaming)
    token_ids: list[int] | None = None  # return_token_ids: this choice's (a chunk's: its new ones)


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


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text of an object


class ToolCallOut(BaseModel):
    id: str  # call_<hex>
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ToolCallDelta(ToolCallOut):
    """A streamed call: minserve sends each call whole, in one delta (id, name and all arguments)."""

    index: int  # the call's position among the choice's calls


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # null when the answer is tool calls only
    reasoning_content: str | None = None  # thinking models, when the split is on (else always null)
    tool_calls: list[ToolCallOut] | None = None  # key left out of the body when there are none


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    token_ids: list[int] | None = None  # vLLM's return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    token_ids: list[int] | None = None  # vLLM's return_token_ids: the chunk's new ones


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: on the stream's first chunk


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "minserve"
    root: str | None = None  # as in vLLM: the checkpoint's (or the LoRA adapter's) directory
    parent: str | None = None  # as in vLLM: an adapter's base model id; null for the base model
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


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
