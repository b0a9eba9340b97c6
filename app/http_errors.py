"""The ingress's error answers that FastAPI produces (validation, unknown routes, crashes), and the one
INFO log line per rejected request.

Every refusal the ingress sends goes through `reject`, which logs `rejected METHOD PATH: STATUS CODE
param=PARAM: MESSAGE` (logger "ray.serve", so it lands in the ingress replica's log) and builds the
response; the security middleware logs its own refusals the same way (app/security.py).
Validation errors, first match wins:
  * a body sent with a Content-Type other than JSON: 415 `unsupported_media_type`, naming the header;
  * malformed JSON: 400 `invalid_json`;
  * an OpenAI field this server does not implement: 400 `unsupported_parameter` (app/field_policy.py);
  * an unknown field: 422 `extra_forbidden`, with the closest known field;
  * anything else: 422 with pydantic's error type as the code.
"""

from __future__ import annotations

import email.message
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.errors import ApiError, internal
from app.field_policy import UNSUPPORTED_CODE, unknown_field_message
from app.protocol import KNOWN_FIELDS

logger = logging.getLogger("ray.serve")
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


def log_rejection(method: str, path: str, err: ApiError) -> None:
    logger.info(
        "rejected %s %s: %d %s param=%s: %s", method, path, err.status, err.code, err.param, err.message
    )


def reject(request: Request, err: ApiError) -> JSONResponse:
    log_rejection(request.method, request.url.path, err)
    return err.response()


def is_json(content_type: str) -> bool:
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


def validation_error(content_type: str | None, errors: list[dict]) -> ApiError:
    if content_type is not None and not is_json(content_type):
        # FastAPI parses a body as JSON only when the header says so (or is absent)
        return ApiError(
            415,
            f"the request's Content-Type is '{content_type}': send the header "
            "'Content-Type: application/json' with a JSON body",
            param=None,
            code="unsupported_media_type",
        )
    first = errors[0] if errors else {"type": "invalid", "loc": (), "msg": "invalid request"}
    if first["type"] == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return ApiError(400, f"malformed JSON body: {detail}; send a JSON object", code="invalid_json")
    for e in errors:
        if e["type"] == UNSUPPORTED_CODE:  # raised before the model's fields are validated
            path = [str(p) for p in e["loc"] if p != "body"]
            return ApiError(
                400, e["msg"], param=path[0] if path else e["ctx"]["field"], code=UNSUPPORTED_CODE
            )
    path = [str(p) for p in first["loc"] if p != "body"]
    field = path[0] if path else None  # the top-level request field; the message carries the full path
    where = ".".join(path) or "body"
    if first["type"] == "extra_forbidden":
        message = unknown_field_message(where, path[-1], KNOWN_FIELDS)
    elif first["type"] == "missing":
        message = f"{where}: field required"
    else:
        message = f"{where}: {first['msg']}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem(s))"
    return ApiError(422, message, param=field, code=first["type"])


def _unparsable_body(cause: BaseException) -> str:
    if isinstance(cause, UnicodeDecodeError):
        return f"request body is not valid UTF-8 (byte {cause.object[cause.start]:#04x} at {cause.start})"
    if isinstance(cause, RecursionError):
        return "request body JSON is nested too deeply: send a flat JSON object"
    return f"could not parse the request body as JSON ({type(cause).__name__}); send a JSON object"


def install_error_handlers(api: FastAPI) -> None:
    @api.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return reject(request, validation_error(request.headers.get("content-type"), exc.errors()))

    @api.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and exc.__cause__ is not None:  # FastAPI could not decode the body
            return reject(request, ApiError(400, _unparsable_body(exc.__cause__), code="invalid_json"))
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        detail = str(exc.detail)
        if exc.status_code == 404:
            detail = f"no route {request.method} {request.url.path}: see docs/api.md for the endpoints"
        err = ApiError(exc.status_code, detail, kind, code=_HTTP_CODES.get(exc.status_code))
        return reject(request, err)

    @api.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return reject(request, internal(f"internal error: {type(exc).__name__}"))
