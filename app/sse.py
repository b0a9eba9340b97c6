"""Assemble OpenAI responses from engine items: SSE chunks when streaming, one body otherwise.

A request with P prompts and n samples has P*n choices; choice index = prompt_index * n + sample index
(OpenAI's order). Items come from app/engine_deployment.py (`to_wire`). SSE framing is
`data: {json}\\n\\n` per event and `data: [DONE]\\n\\n` last; a failure ends the stream with one
`data: {"error": ...}` event instead of [DONE], so every stream has exactly one terminal event.
"""

from __future__ import annotations

import json
import time

from app.errors import ApiError
from app.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    PromptTokensDetails,
    UsageInfo,
)

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


def _chat_logprobs(entries: list[dict]) -> ChatLogprobs:
    def top(token: str, logprob: float) -> ChatTopLogprob:
        return ChatTopLogprob(token=token, logprob=logprob, bytes=list(token.encode("utf-8")))

    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                token=e["token"],
                logprob=e["logprob"],
                bytes=list(e["token"].encode("utf-8")),
                top_logprobs=[top(t, v) for t, v in e["top"]],
            )
            for e in entries
        ]
    )


class ResponseAssembler:
    """State of one HTTP response: usage per prompt, text offsets, and (non-streaming) accumulated text."""

    def __init__(self, chat: bool, request_id: str, model: str, n: int, num_prompts: int):
        self.chat, self.id, self.model, self.n = chat, request_id, model, n
        self.created = int(time.time())
        size = n * num_prompts
        self._usage: dict[int, tuple[int, int, int]] = {}  # prompt index -> (prompt, completion, cached)
        self._offsets = [0] * size  # completions logprobs text_offset, running per choice
        self._text: list[list[str]] = [[] for _ in range(size)]
        self._logprobs: list[list[dict]] = [[] for _ in range(size)]
        self._finish: list[str | None] = [None] * size

    def record_usage(self, prompt_index: int, item: dict) -> None:
        self._usage[prompt_index] = (item["prompt_tokens"], item["completion_tokens"], item["cached_tokens"])

    def usage(self) -> UsageInfo:
        p = sum(u[0] for u in self._usage.values())
        c = sum(u[1] for u in self._usage.values())
        cached = sum(u[2] for u in self._usage.values())
        return UsageInfo(
            prompt_tokens=p,
            completion_tokens=c,
            total_tokens=p + c,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )

    def _completion_logprobs(self, index: int, entries: list[dict]) -> CompletionLogprobs:
        lp = CompletionLogprobs()
        for e in entries:
            lp.tokens.append(e["token"])
            lp.token_logprobs.append(e["logprob"])
            lp.top_logprobs.append(dict(e["top"]))
            lp.text_offset.append(self._offsets[index])
            self._offsets[index] += len(e["token"])
        return lp

    # ------------------------------------------------------------ streaming

    def role_chunk(self) -> str:
        """Chat streams open with the assistant role for every choice, as OpenAI's do."""
        choices = [
            ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))
            for i in range(len(self._finish))
        ]
        return self._chat_chunk(choices)

    def chunk(self, prompt_index: int, item: dict) -> str | None:
        """The SSE event for one item, or None when it carries nothing visible."""
        self.record_usage(prompt_index, item)
        samples = [s for s in item["outputs"] if s["text"] or s["finish_reason"] or s["logprobs"]]
        if not samples:
            return None
        if self.chat:
            return self._chat_chunk(
                [
                    ChatChunkChoice(
                        index=prompt_index * self.n + s["index"],
                        delta=ChatDelta(content=s["text"]),
                        logprobs=_chat_logprobs(s["logprobs"]) if s["logprobs"] else None,
                        finish_reason=s["finish_reason"],
                    )
                    for s in samples
                ]
            )
        choices = []
        for s in samples:
            index = prompt_index * self.n + s["index"]
            lp = self._completion_logprobs(index, s["logprobs"]) if s["logprobs"] else None
            choices.append(
                CompletionChoice(index=index, text=s["text"], logprobs=lp, finish_reason=s["finish_reason"])
            )
        body = CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices)
        return sse(body.model_dump(exclude={"usage"}))

    def _chat_chunk(self, choices: list[ChatChunkChoice]) -> str:
        body = ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices)
        payload = body.model_dump(exclude={"usage"})
        for c in payload["choices"]:  # a delta carries only the keys it sets
            c["delta"] = {k: v for k, v in c["delta"].items() if v is not None}
        return sse(payload)

    def usage_chunk(self) -> str:
        """stream_options.include_usage: one last chunk with no choices and the totals."""
        cls = ChatCompletionChunk if self.chat else CompletionResponse
        body = cls(id=self.id, created=self.created, model=self.model, choices=[], usage=self.usage())
        return sse(body.model_dump())

    # ------------------------------------------------------------ non-streaming

    def add(self, prompt_index: int, item: dict) -> None:
        self.record_usage(prompt_index, item)
        for s in item["outputs"]:
            index = prompt_index * self.n + s["index"]
            self._text[index].append(s["text"])
            if s["logprobs"]:
                self._logprobs[index].extend(s["logprobs"])
            if s["finish_reason"]:
                self._finish[index] = s["finish_reason"]

    def final(self) -> dict:
        want_lp = any(self._logprobs)
        if self.chat:
            choices = [
                ChatChoice(
                    index=i,
                    message=ChatResponseMessage(content="".join(self._text[i])),
                    logprobs=_chat_logprobs(self._logprobs[i]) if want_lp else None,
                    finish_reason=self._finish[i],
                )
                for i in range(len(self._text))
            ]
            body = ChatCompletionResponse(
                id=self.id, created=self.created, model=self.model, choices=choices, usage=self.usage()
            )
        else:
            choices = [
                CompletionChoice(
                    index=i,
                    text="".join(self._text[i]),
                    logprobs=self._completion_logprobs(i, self._logprobs[i]) if want_lp else None,
                    finish_reason=self._finish[i],
                )
                for i in range(len(self._text))
            ]
            body = CompletionResponse(
                id=self.id, created=self.created, model=self.model, choices=choices, usage=self.usage()
            )
        return body.model_dump()
