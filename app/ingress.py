"""The HTTP ingress: FastAPI routes on a Serve deployment, forwarding to the engine deployment.

Every generation request goes through the engine's streaming `generate` (also when the client asked
for one JSON body), and the first item of every engine stream is awaited before the response starts:
an overload or a rejected prompt becomes a proper 4xx/5xx with an OpenAI error body, never a 200
followed by a broken stream. Hardening (API key, body-size limit) belongs in `install_hooks`; error
answers FastAPI produces, and the log line per rejected request, in app/http_errors.py. LoRA
adapters (a `model` naming one, the model cards, the runtime load/unload routes): app/lora_admin.py. Latency
metrics start when the request reached the ingress (`arrival_time`, stamped by the security middleware
before the body is read), passed to the engine replica with each engine request.

No `from __future__ import annotations` here: FastAPI must see the route parameters' real types
(Serve re-wraps the methods, and string annotations would then not resolve: the body would be
mistaken for a query parameter).
"""

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve.handle import DeploymentHandle

from app import routing_table, security
from app.engine_client import (
    EngineClient,
    EngineStream,
    StreamsResponse,
    call_failure,
    cancel_all,
    engine_unavailable,
    merge,
)
from app.errors import ApiError, from_engine_error, internal
from app.http_errors import install_error_handlers, reject
from app.ingress_timing import FirstText, arrival_time
from app.lora_admin import Adapters
from app.metrics import IngressMetrics
from app.prefix_keys import PrefixKeys
from app.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from app.responses import ModelList
from app.responses_api import ResponsesRequest, refusal, renamed
from app.responses_stream import ResponsesOutput
from app.sse import DONE, ResponseAssembler, item_error, sse_error
from app.structured import ToolChoice
from app.tool_calls import PARSERS, ToolParsing
from engine import LoRARequest
from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams

logger = logging.getLogger("ray.serve")
# /health answers 503 when no engine replica answers within this: Serve holds a call while the only
# replica is being replaced, and a health probe must get an answer rather than wait that long.
HEALTH_TIMEOUT_S = 10.0
api = FastAPI(title="minserve", description="OpenAI-compatible completions on a paged-KV engine.")


def install_hooks(app: FastAPI) -> None:
    """The one place for request-level hardening: API key and body-size limit (app/security.py).

    Its settings come from the Ingress constructor (`security.configure`): Serve serves a frozen copy
    of this app, so the middleware reads them from its module, not from the app object."""
    app.add_middleware(security.SecurityMiddleware)


install_hooks(api)


install_error_handlers(api)


@serve.deployment(name="Ingress")
@serve.ingress(api)
class Ingress:
    def __init__(
        self,
        engine: DeploymentHandle,
        model_name: str,
        default_max_tokens: int = 256,
        retry_after_s: int = 1,
        api_key: str | None = None,
        max_body_bytes: int = security.DEFAULT_MAX_BODY_BYTES,
        reasoning_parser: str | None = None,
        tool_call_parser: str = "none",
        prefix_keys: dict | None = None,
        lora: dict | None = None,
    ):
        """prefix_keys: PrefixKeys options (model_dir, block_size) when the engine deployment routes by
        prefix (app/router.py): each engine call then carries its prompt's block hashes. lora: Adapters
        options (base_root, modules, enable_lora, allow_runtime_updating; app/lora_admin.py)."""
        if reasoning_parser not in (None, "think"):
            raise ValueError(f"reasoning_parser: must be 'think' or null, got {reasoning_parser!r}")
        if tool_call_parser not in (*PARSERS, "none"):  # resolved from "auto" by app/builder.py
            raise ValueError(f"tool_call_parser: must be none or one of {PARSERS}, got {tool_call_parser!r}")
        self._tool_parser = tool_call_parser
        security.configure(api_key, max_body_bytes)
        self._reasoning_default = reasoning_parser == "think"
        self._engine = engine
        keys = PrefixKeys(**prefix_keys) if prefix_keys else None
        self._client = EngineClient(engine, retry_after_s, keys)
        self._model = model_name
        self._adapters = Adapters(model_name, engine, retry_after_s, **(lora or {}))
        self._default_max_tokens = default_max_tokens
        self._retry_after = retry_after_s
        self._info: dict | None = None  # model facts from the engine, fetched once
        self._metrics = IngressMetrics(model_name)

    # ------------------------------------------------------------ info routes

    @api.get("/health")
    async def health(self) -> Response:
        try:
            alive = await asyncio.wait_for(self._engine.is_alive.remote(), HEALTH_TIMEOUT_S)
        except TimeoutError:
            why = f"no engine replica answered within {HEALTH_TIMEOUT_S:g} s; one may be starting or replaced"
            return engine_unavailable(why, self._retry_after).response()
        except Exception as exc:
            return call_failure(exc, self._retry_after).response()
        if not alive:
            return ApiError(
                503, "engine loop is dead", "server_error", code="engine_dead", retry_after=self._retry_after
            ).response()
        return JSONResponse({"status": "ok"})

    @api.get("/v1/models")
    async def models(self) -> ModelList:
        if self._info is None:
            self._info = await self._engine.info.remote()
        return ModelList(data=self._adapters.cards(self._info))

    @api.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, request: Request) -> Response:
        """vLLM's {"lora_name", "lora_path"}; only with allow_runtime_lora_updating (app/lora_admin.py)."""
        answer = await self._adapters.load(request)
        return reject(request, answer) if isinstance(answer, ApiError) else answer

    @api.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, request: Request) -> Response:
        answer = await self._adapters.unload(request)
        return reject(request, answer) if isinstance(answer, ApiError) else answer

    @api.get("/v1/engine/stats")
    async def engine_stats(self) -> dict:
        """KV blocks in use, queue lengths, counters (of the engine replica that answers), and the
        prefix-aware router's decisions in this ingress replica, for prefixes and for LoRA adapters
        (none without that router)."""
        stats = await self._engine.stats.remote()
        decisions = {"ingress_adapter_routing": dict(routing_table.ADAPTER_DECISIONS)}
        return {**stats, "ingress_routing_decisions": dict(routing_table.DECISIONS), **decisions}

    @api.get("/v1/engine/audit")
    async def engine_audit(self) -> dict:
        return {"problems": await self._engine.audit.remote()}

    # ------------------------------------------------------------ generation routes

    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        arrival = arrival_time(request)
        lora = self._adapters.resolve(body.model)
        if isinstance(lora, ApiError):
            return reject(request, lora)
        try:
            prompts, params = body.prompts(), body.sampling_params()
        except InvalidRequestError as exc:
            return reject(request, from_engine_error(exc, self._retry_after))
        out = ResponseAssembler(
            False,
            f"cmpl-{uuid.uuid4().hex}",
            body.model,
            params.n,
            len(prompts),
            echo=body.echo,
            logprobs=body.logprobs is not None,
            prompt_logprobs=body.prompt_logprobs is not None,
            continuous_usage=body.continuous_usage,
            token_ids=body.return_token_ids,
        )
        return await self._respond(request, prompts, params, out, body, arrival, body.echo, lora)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        return await self._chat(body, request)

    @api.post("/v1/responses")
    async def responses(self, body: ResponsesRequest, request: Request) -> Response:
        """OpenAI's Responses API, answered as the chat request it translates to (app/responses_api.py)."""
        try:
            chat = body.chat_request()
        except InvalidRequestError as exc:
            return reject(request, refusal(exc))
        return renamed(await self._chat(chat, request, body))

    async def _chat(
        self, body: ChatCompletionRequest, request: Request, responses: ResponsesRequest | None = None
    ) -> Response:
        arrival = arrival_time(request)
        lora = self._adapters.resolve(body.model)
        if isinstance(lora, ApiError):
            return reject(request, lora)
        try:
            params, prompt = body.sampling_params(self._default_max_tokens), body.chat_prompt()
            tools = self._tool_parsing(body.constraints()[1])
        except InvalidRequestError as exc:
            return reject(request, from_engine_error(exc, self._retry_after))
        reasoning = body.reasoning(self._reasoning_default)
        if responses is not None:
            out = ResponsesOutput(responses, body.model, reasoning, tools)
            return await self._respond(request, [prompt], params, out, body, arrival, False, lora)
        out = ResponseAssembler(
            True,
            f"chatcmpl-{uuid.uuid4().hex}",
            body.model,
            params.n,
            1,
            logprobs=body.logprobs,
            prompt_logprobs=body.prompt_logprobs is not None,
            continuous_usage=body.continuous_usage,
            reasoning=reasoning,
            tools=tools,
            token_ids=body.return_token_ids,
        )
        return await self._respond(request, [prompt], params, out, body, arrival, False, lora)

    # ------------------------------------------------------------ tokenizer routes (vLLM's shapes)

    @api.post("/tokenize")
    async def tokenize(self, body: TokenizeRequest, request: Request) -> Response:
        if body.model is not None and isinstance(known := self._adapters.resolve(body.model), ApiError):
            return reject(request, known)
        try:
            source = body.source()
        except InvalidRequestError as exc:
            return reject(request, from_engine_error(exc, self._retry_after))
        return await self._tokenizer_call(request, self._engine.tokenize, source, body.add_special_tokens)

    @api.get("/tokenizer_info")
    async def tokenizer_info(self, request: Request) -> Response:
        return await self._tokenizer_call(request, self._engine.tokenizer_info)

    @api.post("/detokenize")
    async def detokenize(self, body: DetokenizeRequest, request: Request) -> Response:
        if body.model is not None and isinstance(known := self._adapters.resolve(body.model), ApiError):
            return reject(request, known)
        return await self._tokenizer_call(request, self._engine.detokenize, body.tokens)

    async def _tokenizer_call(self, request: Request, method, *args) -> Response:
        try:
            result = await method.remote(*args)
        except Exception as exc:
            return reject(request, call_failure(exc, self._retry_after))
        return reject(request, result) if isinstance(result, ApiError) else JSONResponse(result)

    def _tool_parsing(self, choice: ToolChoice | None) -> ToolParsing | None:
        """What the answer is searched for: the forced JSON array, or the server's family format."""
        if choice is None:
            return None
        if choice.mode == "required":
            return ToolParsing("required", choice.names, choice.parallel)
        if self._tool_parser == "none":
            raise InvalidRequestError(
                "tool_choice: 'auto' (the default with tools) needs the server's tool_call_parser, which is "
                "none here (serve_config.yaml): send tool_choice 'required', a named function, or 'none'",
                "tool_choice",
            )
        return ToolParsing(self._tool_parser, choice.names, choice.parallel)

    async def _respond(
        self,
        request: Request,
        prompts: list,
        params: SamplingParams,
        out: ResponseAssembler,
        body: CompletionRequest | ChatCompletionRequest,
        arrival: float,
        echo: bool,
        lora: LoRARequest | None = None,
    ) -> Response:
        ids = body.return_token_ids  # a Responses request's translated chat request never asks
        streams = await self._client.open(prompts, params, out.id, arrival, echo, lora, prompt_ids=ids)
        if isinstance(streams, ApiError):
            return reject(request, streams)
        for s in streams:
            out.set_prompt(s.index, s.accepted)
        ttft = FirstText(self._metrics, arrival)
        if body.stream:
            if isinstance(out, ResponsesOutput):
                return StreamsResponse(out.events(streams, ttft.seen), streams)
            return StreamsResponse(self._sse(streams, out, body.include_usage, ttft), streams)
        try:
            async for index, item in merge(streams):
                err = item if isinstance(item, ApiError) else item_error(item)
                if err is not None:
                    return reject(request, err)
                ttft.seen(item)
                out.add(index, item)
            return JSONResponse(out.final())
        finally:
            cancel_all(streams)

    async def _sse(
        self, streams: list[EngineStream], out: ResponseAssembler, include_usage: bool, ttft: FirstText
    ) -> AsyncIterator[str]:
        try:
            if out.chat:
                yield out.role_chunk()
            async for index, item in merge(streams):
                err = item if isinstance(item, ApiError) else item_error(item)
                if err is not None:
                    yield sse_error(err)
                    return
                chunk = out.chunk(index, item)
                if chunk is not None:
                    yield chunk
                    ttft.seen(item)  # resumed once the server took the chunk: as late as we can see
            if include_usage:
                yield out.usage_chunk()
            yield DONE
        except Exception as exc:  # a bug here must still end the stream with its one terminal event
            logger.exception("stream failed")
            yield sse_error(internal(f"stream failed: {type(exc).__name__}"))
