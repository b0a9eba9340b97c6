"""Request-level hardening for the ingress: an optional API key and a request body size limit.

`SecurityMiddleware` is a plain ASGI middleware installed by `app.ingress.install_hooks`. Its settings
live in this module (`configure`, called by the Ingress constructor): Serve freezes a pickled copy of
the FastAPI app when the deployment class is decorated, so per-deployment values cannot be attached to
that app object; a module global is per process, and each ingress replica is one process.

* API key: when set, every route (also /health, /docs and unknown paths) needs
  `Authorization: Bearer <key>`; otherwise 401 with OpenAI's error body (`code: invalid_api_key`).
  The comparison is constant-time (hmac.compare_digest).
* Body limit: a declared Content-Length above `max_body_bytes` is refused before the body is read;
  a body without one (chunked) is read up to the limit and refused as soon as it exceeds it. Either
  way 413 (`code: request_too_large`). The accepted body is replayed to the app in one message;
  later `receive` calls (disconnect detection during streaming) go to the server (see `_replay`).
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from dataclasses import dataclass

logger = logging.getLogger("ray.serve")

DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: a 128k-token prompt as JSON token ids is ~0.8 MB


@dataclass(frozen=True)
class SecuritySettings:
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES


_settings = SecuritySettings()


def configure(api_key: str | None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
    """Set this process's settings (the Ingress constructor calls it); an empty key means no key."""
    global _settings
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes: must be >= 1, got {max_body_bytes}")
    _settings = SecuritySettings(api_key or None, max_body_bytes)


def settings() -> SecuritySettings:
    return _settings


def _header(scope: dict, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value
    return None


def _authorized(scope: dict, api_key: str) -> bool:
    value = (_header(scope, b"authorization") or b"").decode("latin-1")
    scheme, _, token = value.partition(" ")
    # compare_digest on bytes: constant time whatever the token holds (str needs ASCII)
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


async def _send_error(scope, send, status: int, message: str, code: str, extra_headers=()) -> None:
    logger.info(
        "rejected %s %s: %d %s param=None: %s", scope.get("method"), scope.get("path"), status, code, message
    )
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    body = json.dumps({"error": error}, separators=(",", ":")).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + list(extra_headers)})
    await send({"type": "http.response.body", "body": body})


def _too_large(limit: int, size: int | None = None) -> str:
    what = f"is {size} bytes" if size is not None else "is longer"
    return (
        f"request body {what}; the limit is {limit} bytes: send a smaller request "
        "(the server's max_body_bytes setting)"
    )


class SecurityMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # the latency metrics' origin (app/ingress.arrival_time): before anything else is done here
        scope.setdefault("state", {})["arrival_time"] = time.time()
        cfg = _settings
        if cfg.api_key is not None and not _authorized(scope, cfg.api_key):
            message = "missing or invalid API key: send the header 'Authorization: Bearer <key>'"
            await _send_error(
                scope, send, 401, message, "invalid_api_key", [(b"www-authenticate", b"Bearer")]
            )
            return
        declared = _header(scope, b"content-length")
        if declared is not None:
            if not declared.isdigit():
                await _send_error(scope, send, 400, "Content-Length: not a number", "invalid_content_length")
                return
            if int(declared) > cfg.max_body_bytes:
                await _send_error(
                    scope, send, 413, _too_large(cfg.max_body_bytes, int(declared)), "request_too_large"
                )
                return
        body = await _read_body(receive, cfg.max_body_bytes)
        if body is _TOO_LARGE:
            await _send_error(scope, send, 413, _too_large(cfg.max_body_bytes), "request_too_large")
        elif body is not _GONE:
            await self.app(scope, _replay(body, receive), send)


_TOO_LARGE, _GONE = object(), object()


async def _read_body(receive, limit: int):
    """The whole body; _TOO_LARGE once it exceeds `limit` (the rest is not read); _GONE when the client
    disconnected before sending all of it (nobody is left to answer)."""
    chunks, size = [], 0
    while True:
        try:
            message = await receive()
        except Exception:  # Ray Serve raises when the proxy dropped the request (see `_replay`)
            return _GONE
        if message["type"] != "http.request":
            return _GONE
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return _TOO_LARGE
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive):
    """`receive` for the app: the body in one message, then the server's messages.

    Once the body is in, the only message left in HTTP is http.disconnect. Ray Serve's `receive`
    raises instead (ray.exceptions.TaskCancelledError) when the proxy dropped a request whose client
    went away mid-stream; Starlette's disconnect listener would log that as an unhandled error. So
    any failure here is reported as what it means: the client is gone.
    """
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        try:
            return await receive()
        except Exception:
            return {"type": "http.disconnect"}

    return replayed
