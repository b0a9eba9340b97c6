"""The HTTP ingress: FastAPI routes on a Serve deployment, forwarding to the engine deployment.

Every generation request goes through the engine's streaming `generate` (also when the client asked
for one JSON body), and the first item of every engine stream is awaited before the response starts:
an overload or a rejected prompt becomes a proper 4xx/5xx with an OpenAI error body, never a 200
followed by a broken stream. Hardening (API key, body-size limit) belongs in `install_hooks`.

No `from __future__ import annotations` here: FastAPI must see the route parameters' real types
(Serve re-wraps the methods, and string annotations would then not resolve: the body would be
mistaken for a query parameter).
"""

import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from app import security
from app.engine_client import EngineClient, EngineStream, call_failure, cancel_all, merge
from app.errors import ApiError, from_engine_error, internal
from app.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from app.sse import DONE, ResponseAssembler, item_error, sse_error
from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams

logger = logging.getLogger("ray.serve")
api = FastAPI(title="minserve", description="OpenAI-compatible completions on a paged-KV engine.")


def install_hooks(app: FastAPI) -> None:
    """The one place for request-level hardening: API key and body-size limit (app/security.py).

    Its settings come from the Ingress constructor (`security.configure`): Serve serves a frozen copy
    of this app, so the middleware reads them from its module, not from the app object."""
    app.add_middleware(security.SecurityMiddleware)


install_hooks(api)


@api.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {"type": "invalid", "loc": (), "msg": "invalid request"}
    if first["type"] == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return ApiError(
            400, f"malformed JSON body: {detail}; send a JSON object", code="invalid_json"
        ).response()
    path = [str(p) for p in first["loc"] if p != "body"]
    field = path[0] if path else None  # the top-level request field; the message carries the full path
    where = ".".join(path) or "body"
    if first["type"] == "extra_forbidden":
        message = f"unknown field '{where}': remove it (see docs/api.md for the fields this server takes)"
    elif first["type"] == "missing":
        message = f"{where}: field required"
    else:
        message = f"{where}: {first['msg']}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem(s))"
    return ApiError(422, message, param=field, code=first["type"]).response()


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 400 and exc.__cause__ is not None:  # FastAPI could not decode the body
        return ApiError(400, _unparsable_body(exc.__cause__), code="invalid_json").response()
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return ApiError(exc.status_code, str(exc.detail), kind).response()


def _unparsable_body(cause: BaseException) -> str:
    if isinstance(cause, UnicodeDecodeError):
        return f"request body is not valid UTF-8 (byte {cause.object[cause.start]:#04x} at {cause.start})"
    if isinstance(cause, RecursionError):
        return "request body JSON is nested too deeply: send a flat JSON object"
    return f"could not parse the request body as JSON ({type(cause).__name__}); send a JSON object"


@api.exception_handler(Exception)
async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error")
    return internal(f"internal error: {type(exc).__name__}").response()


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
    ):
        security.configure(api_key, max_body_bytes)
        self._engine = engine
        self._client = EngineClient(engine, retry_after_s)
        self._model = model_name
        self._default_max_tokens = default_max_tokens
        self._retry_after = retry_after_s
        self._info: dict | None = None  # model facts from the engine, fetched once

    # ------------------------------------------------------------ info routes

    @api.get("/health")
    async def health(self) -> Response:
        try:
            alive = await self._engine.is_alive.remote()
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
        card = ModelCard(
            id=self._model,
            created=int(time.time()),
            max_model_len=self._info["max_model_len"],
            vocab_size=self._info["vocab_size"],
        )
        return ModelList(data=[card])

    @api.get("/v1/engine/stats")
    async def engine_stats(self) -> dict:
        """KV blocks in use, queue lengths, counters (of the replica that answers)."""
        return await self._engine.stats.remote()

    @api.get("/v1/engine/audit")
    async def engine_audit(self) -> dict:
        return {"problems": await self._engine.audit.remote()}

    # ------------------------------------------------------------ generation routes

    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest) -> Response:
        if body.model != self._model:
            return self._unknown_model(body.model)
        try:
            prompts, params = body.prompts(), body.sampling_params()
        except InvalidRequestError as exc:
            return from_engine_error(exc, self._retry_after).response()
        out = ResponseAssembler(False, f"cmpl-{uuid.uuid4().hex}", self._model, params.n, len(prompts))
        return await self._respond(prompts, params, out, body.stream, body.include_usage)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest) -> Response:
        if body.model != self._model:
            return self._unknown_model(body.model)
        try:
            params = body.sampling_params(self._default_max_tokens)
        except InvalidRequestError as exc:
            return from_engine_error(exc, self._retry_after).response()
        out = ResponseAssembler(True, f"chatcmpl-{uuid.uuid4().hex}", self._model, params.n, 1)
        return await self._respond([body.engine_messages()], params, out, body.stream, body.include_usage)

    def _unknown_model(self, name: str) -> JSONResponse:
        return ApiError(
            404,
            f"model '{name}' does not exist; this server serves '{self._model}' (GET /v1/models)",
            "not_found_error",
            "model",
            "model_not_found",
        ).response()

    async def _respond(
        self, prompts: list, params: SamplingParams, out: ResponseAssembler, stream: bool, include_usage: bool
    ) -> Response:
        streams = await self._client.open(prompts, params, out.id)
        if isinstance(streams, ApiError):
            return streams.response()
        if stream:
            return StreamingResponse(
                self._sse(streams, out, include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        try:
            async for index, item in merge(streams):
                err = item if isinstance(item, ApiError) else item_error(item)
                if err is not None:
                    return err.response()
                out.add(index, item)
            return JSONResponse(out.final())
        finally:
            cancel_all(streams)

    async def _sse(
        self, streams: list[EngineStream], out: ResponseAssembler, include_usage: bool
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
            if include_usage:
                yield out.usage_chunk()
            yield DONE
        except Exception as exc:  # a bug here must still end the stream with its one terminal event
            logger.exception("stream failed")
            yield sse_error(internal(f"stream failed: {type(exc).__name__}"))
        finally:
            cancel_all(streams)
