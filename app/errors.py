"""One error shape for every failure: OpenAI's {"error": {"message", "type", "param", "code"}}.

`ApiError` is plain data (picklable), so the engine deployment can hand it to the ingress as a stream
item instead of raising across the Ray boundary. Status codes: 400 malformed request, unsupported
field, prompt too long, a structured-output / tools field that cannot be honoured (app/structured.py),
or a LoRA adapter that does not fit the base model, 404 unknown model, adapter or route, 415 a body
that is not JSON, 422 unknown or invalid field, 503 overloaded or engine down (with Retry-After), 500
anything unexpected. The table of every (status, code) is
docs/api.md's "Errors"; FastAPI's own errors are mapped in app/http_errors.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi.responses import JSONResponse

from app.structured import STRUCTURED_FIELDS
from engine.errors import (
    EngineDeadError,
    EngineError,
    InvalidRequestError,
    LoRAError,
    LoRANotFoundError,
    PromptTooLongError,
    QueueFullError,
)


@dataclass
class ApiError:
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    retry_after: int | None = None  # seconds; sent as the Retry-After header

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def overloaded(message: str, retry_after: int) -> ApiError:
    return ApiError(503, message, "server_overloaded", code="queue_full", retry_after=retry_after)


def from_engine_error(exc: EngineError, retry_after: int) -> ApiError:
    """Map the engine's exceptions onto HTTP statuses (see engine/errors.py)."""
    message, param = str(exc), exc.field
    if isinstance(exc, QueueFullError):
        return overloaded(message, retry_after)
    if isinstance(exc, EngineDeadError):
        return ApiError(503, message, "server_error", param, "engine_dead", retry_after)
    if isinstance(exc, PromptTooLongError):
        return ApiError(400, message, "invalid_request_error", param or "prompt", "context_length_exceeded")
    if isinstance(exc, LoRANotFoundError):
        return ApiError(404, message, "not_found_error", param or "model", "model_not_found")
    if isinstance(exc, LoRAError):  # an adapter that does not fit the base model, or LoRA is off
        return ApiError(400, message, "invalid_request_error", param or "model", "invalid_lora_adapter")
    if isinstance(exc, InvalidRequestError):
        # a constraint that cannot be honoured as given (structured output, tools) is a 400, as in
        # OpenAI's API; other bad values stay 422
        status = 400 if _field_root(param) in STRUCTURED_FIELDS else 422
        return ApiError(status, message, "invalid_request_error", param, "invalid_value")
    return ApiError(exc.status_code, message, "invalid_request_error", param)


def _field_root(param: str | None) -> str:
    """ "response_format.json_schema.schema" -> "response_format"; "tools[0].function" -> "tools"."""
    return (param or "").split(".")[0].split("[")[0]


def internal(message: str) -> ApiError:
    return ApiError(500, message, "server_error", code="internal_error")
