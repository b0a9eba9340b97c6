"""Exceptions the engine raises for bad requests; the server maps each to an HTTP status."""

from __future__ import annotations


class EngineError(Exception):
    """Base class. `field` names the offending request field when there is one."""

    status_code = 400

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class InvalidRequestError(EngineError):
    """A parameter is out of range or malformed (HTTP 400/422)."""


class LoRAError(InvalidRequestError):
    """A LoRA adapter cannot be used: its files are missing or malformed, or do not fit the base model
    or the engine's LoRA limits; the message names the file and tensor and the fix (HTTP 400)."""


class LoRANotFoundError(LoRAError):
    """A request names an adapter the engine does not know (HTTP 404)."""

    status_code = 404


class PromptTooLongError(EngineError):
    """Prompt (+ max_tokens) can never fit in max_model_len or the KV pool (HTTP 400)."""


class QueueFullError(EngineError):
    """More requests are waiting than the configured queue allows (HTTP 503 with Retry-After)."""

    status_code = 503


class EngineDeadError(EngineError):
    """The engine loop thread has died; the replica must be replaced (HTTP 503)."""

    status_code = 503
