"""Assemble OpenAI responses from engine items: SSE chunks when streaming, one body otherwise.

A request with P prompts and n samples has P*n choices; choice index = prompt_index * n + sample index
(OpenAI's order). Items come from app/engine_deployment.py (`to_wire`). SSE framing is
`data: {json}\\n\\n` per event and `data: [DONE]\\n\\n` last; a failure ends the stream with one
`data: {"error": ...}` event instead of [DONE], so every stream has exactly one terminal event.

Per prompt, what the prompt itself contributes (echo text, its logprobs, vLLM's prompt_logprobs) goes
out with that prompt's first item: streaming, as one chunk of its own before the item's chunk.
With continuous usage stats every chunk carries the usage of the engine request it belongs to
(prompt_tokens fixed, completion_tokens so far); the last usage chunk sums all prompts.
"""

from __future__ import annotations

import json
import time

from app import logprob_shapes as shapes
from app.chat_output import ChoiceText
from app.errors import ApiError
from app.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    PromptTokensDetails,
    UsageInfo,
)
from app.tool_calls import ToolParsing

DONE = "data: [DONE]\n\n"


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def sse_error(err: ApiError) -> str:
    return sse(err.body())


def item_error(item: dict) -> ApiError | None:
    """A sample that ended in error or was aborted by the server fails the whole response."""
    for s in item["outputs"]:
        if s["finish_reason"] == "error":
            return ApiError(
                500,
                f"generation failed: {s['error'] or 'engine error'}",
                "server_error",
                code="generation_error",
            )
        if s["finish_reason"] == "abort":
            return ApiError(503, "request aborted by the server", "server_error", code="aborted")
    return None


class ResponseAssembler:
    """State of one HTTP response: usage per prompt, text offsets, and (non-streaming) accumulated text.

    echo / logprobs / prompt_logprobs: what the request asked for; reasoning: "split", "drop" or "off"
    (app/protocol.ChatCompletionRequest.reasoning); tools: what tool calls to look for in chat answers
    (app/tool_calls.py); token_ids: vLLM's return_token_ids (the prompt's ids once, each choice's ids
    beside its text); `set_prompt` gives each prompt's accepted facts."""

    def __init__(
        self,
        chat: bool,
        request_id: str,
        model: str,
        n: int,
        num_prompts: int,
        *,
        echo: bool = False,
        logprobs: bool = False,
        prompt_logprobs: bool = False,
        continuous_usage: bool = False,
        reasoning: str = "off",
        tools: ToolParsing | None = None,
        token_ids: bool = False,
    ):
        self.chat, self.id, self.model, self.n = chat, request_id, model, n
        self.echo, self.logprobs, self.prompt_logprobs = echo, logprobs, prompt_logprobs
        self.continuous_usage, self.reasoning, self.tools = continuous_usage, reasoning, tools
        self.created = int(time.time())
        self.token_ids = token_ids
        size = n * num_prompts
        self._ids: list[list[int]] = [[] for _ in range(size)]  # non-streaming: each choice's token ids
        self._ids_started: set[int] = set()  # streaming completions: choices whose prompt ids went out
        self._usage: dict[int, tuple[int, int, int]] = {}  # prompt index -> (prompt, completion, cached)
        self._offsets = [0] * size  # completions logprobs text_offset, running per choice
        self._text: list[list[str]] = [[] for _ in range(size)]
        self._logprobs: list[list[dict]] = [[] for _ in range(size)]
        self._finish: list[str | None] = [None] * size
        self._facts: list[dict] = [{} for _ in range(num_prompts)]  # accepted item per prompt
        self._prompt_lp: list[list | None] = [None] * num_prompts  # the item's prompt logprobs
        self._prompt_sent = [not (echo or prompt_logprobs)] * num_prompts
        self._choice = [self._choice_text() for _ in range(size)]

    def _choice_text(self, starts_in_think: bool = False) -> ChoiceText:
        tools = self.tools.stream() if self.tools is not None and self.chat else None
        return ChoiceText(self.reasoning, tools, starts_in_think)

    def set_prompt(self, prompt_index: int, facts: dict) -> None:
        self._facts[prompt_index] = facts
        if facts.get("starts_in_think"):
            for i in range(prompt_index * self.n, (prompt_index + 1) * self.n):
                self._choice[i] = self._choice_text(starts_in_think=True)
        if self.echo:  # generated tokens' offsets count on after the echoed prompt
            offset = len(self._echo_text(prompt_index))
            for i in range(prompt_index * self.n, (prompt_index + 1) * self.n):
                self._offsets[i] = offset

    def _echo_text(self, prompt_index: int) -> str:
        """The prompt as the client sent it (token-id prompts: their decoded text)."""
        return self._facts[prompt_index].get("prompt_text", "")

    def record_usage(self, prompt_index: int, item: dict) -> None:
        self._usage[prompt_index] = (item["prompt_tokens"], item["completion_tokens"], item["cached_tokens"])
        if item.get("prompt_logprobs") is not None:
            self._prompt_lp[prompt_index] = item["prompt_logprobs"]

    def usage(self, prompt_index: int | None = None) -> UsageInfo:
        """Totals over all prompts, or one prompt's (continuous usage stats)."""
        usage = self._usage.values() if prompt_index is None else [self._usage[prompt_index]]
        p, c, cached = (sum(u[k] for u in usage) for k in range(3))
        return UsageInfo(
            prompt_tokens=p,
            completion_tokens=c,
            total_tokens=p + c,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )

    def _prompt_parts(self, prompt_index: int) -> tuple[str, CompletionLogprobs | None, list | None]:
        """(echo text, its legacy logprobs, vLLM prompt_logprobs) of one prompt, as the request asked."""
        plp = self._prompt_lp[prompt_index]
        text = self._echo_text(prompt_index) if self.echo else ""
        legacy = None
        if self.echo and self.logprobs and not self.chat:
            facts = self._facts[prompt_index]
            legacy = shapes.echo_logprobs(facts["prompt_token_texts"], facts["prompt_token_offsets"], plp)
        vllm = shapes.vllm_prompt_logprobs(plp) if self.prompt_logprobs and plp is not None else None
        return text, legacy, vllm

    # ------------------------------------------------------------ streaming

    def role_chunk(self) -> str:
        """Chat streams open with the assistant role for every choice, as OpenAI's do. With tools the
        content stays unset (null), so that an answer of calls only accumulates to content null."""
        content = None if self.tools is not None else ""
        choices = [
            ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=content))
            for i in range(len(self._finish))
        ]
        usage = None
        if self.continuous_usage:
            p = self._facts[0].get("prompt_tokens", 0)
            usage = UsageInfo(prompt_tokens=p, completion_tokens=0, total_tokens=p)
        return self._chat_chunk(choices, usage, self._prompt_ids(0))

    def chunk(self, prompt_index: int, item: dict) -> str | None:
        """The SSE event(s) for one item, or None when it carries nothing visible."""
        self.record_usage(prompt_index, item)
        usage = self.usage(prompt_index) if self.continuous_usage else None
        events = ""
        if not self._prompt_sent[prompt_index]:
            self._prompt_sent[prompt_index] = True
            events = self._prompt_chunk(prompt_index, usage)
        samples = [s for s in item["outputs"] if s["text"] or s["finish_reason"] or s["logprobs"]
                   or (self.token_ids and s["token_ids"])]  # fmt: skip
        if self.chat:
            indexed = [(prompt_index * self.n + s["index"], s) for s in samples]
            choices = [c for i, s in indexed if (c := self._chat_choice(i, s)) is not None]
            return (events + self._chat_chunk(choices, usage)) if choices else (events or None)
        choices = []
        for s in samples:
            index = prompt_index * self.n + s["index"]
            lp = None
            if s["logprobs"]:
                lp, self._offsets[index] = shapes.completion_logprobs(s["logprobs"], self._offsets[index])
            choice = CompletionChoice(index=index, text=s["text"], logprobs=lp)
            choice.finish_reason = s["finish_reason"]
            if self.token_ids:
                choice.token_ids = s["token_ids"]
                choice.prompt_token_ids = self._prompt_ids_once(index)
            choices.append(choice)
        if not choices:
            return events or None
        return events + self._completion_chunk(choices, usage)

    def _chat_choice(self, index: int, sample: dict) -> ChatChunkChoice | None:
        """The chunk's choice for one sample; with return_token_ids also when the text is held back (a
        tool call or stop string in progress), so that every token id reaches the client in order."""
        choice = self._choice[index].chunk_choice(index, sample)
        if not (self.token_ids and sample["token_ids"]):
            return choice
        choice = choice or ChatChunkChoice(index=index, delta=ChatDelta())
        choice.token_ids = sample["token_ids"]
        return choice

    def _prompt_ids(self, prompt_index: int) -> list[int] | None:
        return self._facts[prompt_index].get("prompt_token_ids") if self.token_ids else None

    def _prompt_ids_once(self, index: int) -> list[int] | None:
        """A completions choice's prompt ids on its first chunk only (streaming)."""
        if index in self._ids_started:
            return None
        self._ids_started.add(index)
        return self._prompt_ids(index // self.n)

    def _prompt_chunk(self, prompt_index: int, usage: UsageInfo | None) -> str:
        text, legacy, vllm = self._prompt_parts(prompt_index)
        indexes = range(prompt_index * self.n, (prompt_index + 1) * self.n)
        if self.chat:
            return self._chat_chunk(
                [ChatChunkChoice(index=i, delta=ChatDelta(), prompt_logprobs=vllm) for i in indexes], usage
            )
        choices = [
            CompletionChoice(index=i, text=text, logprobs=legacy, prompt_logprobs=vllm) for i in indexes
        ]
        return self._completion_chunk(choices, usage)

    def _completion_chunk(self, choices: list[CompletionChoice], usage: UsageInfo | None) -> str:
        body = CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices)
        payload = body.model_dump(exclude={"usage"})
        _drop_unasked(payload, self.prompt_logprobs, self.token_ids)
        if usage is not None:
            payload["usage"] = usage.model_dump()
        return sse(payload)

    def _chat_chunk(
        self, choices: list[ChatChunkChoice], usage: UsageInfo | None = None, prompt_ids: list | None = None
    ) -> str:
        body = ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices,
                                   prompt_token_ids=prompt_ids)  # fmt: skip
        payload = body.model_dump(exclude={"usage"})
        for c in payload["choices"]:  # a delta carries only the keys it sets
            c["delta"] = {k: v for k, v in c["delta"].items() if v is not None}
        _drop_unasked(payload, self.prompt_logprobs, self.token_ids)
        if prompt_ids is None:
            payload.pop("prompt_token_ids", None)
        if usage is not None:
            payload["usage"] = usage.model_dump()
        return sse(payload)

    def usage_chunk(self) -> str:
        """stream_options.include_usage: one last chunk with no choices and the totals."""
        cls = ChatCompletionChunk if self.chat else CompletionResponse
        body = cls(id=self.id, created=self.created, model=self.model, choices=[], usage=self.usage())
        return sse(body.model_dump(exclude={"prompt_token_ids"}))

    # ------------------------------------------------------------ non-streaming

    def add(self, prompt_index: int, item: dict) -> None:
        self.record_usage(prompt_index, item)
        for s in item["outputs"]:
            index = prompt_index * self.n + s["index"]
            finish = s["finish_reason"]
            if self.chat:
                finish = self._choice[index].add(s)
            else:
                self._text[index].append(s["text"])
            if s["logprobs"]:
                self._logprobs[index].extend(s["logprobs"])
            if self.token_ids:
                self._ids[index].extend(s["token_ids"])
            if finish:
                self._finish[index] = finish

    def final(self) -> dict:
        body = self._chat_body() if self.chat else self._completion_body()
        payload = body.model_dump()
        _drop_unasked(payload, self.prompt_logprobs, self.token_ids)
        for c in payload["choices"] if self.chat else ():
            if c["message"]["tool_calls"] is None:  # the key only where there are calls
                del c["message"]["tool_calls"]
        return payload

    def _chat_body(self) -> ChatCompletionResponse:
        choices = [
            ChatChoice(
                index=i,
                message=self._choice[i].message(),
                logprobs=shapes.chat_logprobs(self._logprobs[i]) if self.logprobs else None,
                finish_reason=self._finish[i],
                prompt_logprobs=self._prompt_parts(i // self.n)[2],
                token_ids=self._ids[i],
            )
            for i in range(len(self._choice))
        ]
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                      usage=self.usage(), prompt_token_ids=self._prompt_ids(0))  # fmt: skip

    def _completion_body(self) -> CompletionResponse:
        choices = []
        for i in range(len(self._text)):
            echo, legacy, vllm = self._prompt_parts(i // self.n)
            lp = None
            if self.logprobs:
                lp, self._offsets[i] = shapes.completion_logprobs(self._logprobs[i], self._offsets[i])
                lp = shapes.join(legacy, lp) if legacy is not None else lp
            choices.append(
                CompletionChoice(
                    index=i,
                    text=echo + "".join(self._text[i]),
                    logprobs=lp,
                    finish_reason=self._finish[i],
                    prompt_logprobs=vllm,
                    prompt_token_ids=self._prompt_ids(i // self.n),
                    token_ids=self._ids[i],
                )
            )
        return CompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=self.usage()
        )


def _drop_unasked(payload: dict, prompt_logprobs: bool, token_ids: bool) -> None:
    """vLLM's prompt_logprobs and return_token_ids keys appear only in answers to requests that asked."""
    drop = [] if prompt_logprobs else ["prompt_logprobs"]
    drop += [] if token_ids else ["prompt_token_ids", "token_ids"]
    if not token_ids:
        payload.pop("prompt_token_ids", None)
    for c in payload["choices"]:
        for key in drop:
            c.pop(key, None)
