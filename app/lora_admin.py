"""The ingress's side of LoRA adapters: the model names requests may use, the model cards, and vLLM's
runtime load/unload endpoints.

A request names an adapter in `model`; `resolve` gives its LoRARequest (None for the base model), or a
404 naming the model. `/v1/models` lists the base model and then each adapter, with vLLM's `root` (the
directory) and `parent` (the base model's id).

POST /v1/load_lora_adapter {"lora_name", "lora_path"} and POST /v1/unload_lora_adapter {"lora_name"}
answer as vLLM does (200 with a plain-text "Success: ..." line). They exist only with
`allow_runtime_lora_updating` set (vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING); otherwise they are answered
as the absent route they are for this server (404). The API key covers them like every route
(app/security.py). A load is checked by an engine replica before it enters the table (its adapter
config and tensor shapes against the base model: a 400 naming the file and tensor), so a name in the
table always works; that replica keeps it loaded. The table lives in this ingress process: every
engine replica loads an adapter on demand from the path each request carries. With several ingress
replicas, a runtime load or unload reaches only the one that took the call (as with vLLM's several API
servers); adapters in serve_config.yaml's `lora_modules` are in every one.
"""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, ValidationError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException

from app.engine_client import call_failure
from app.errors import ApiError
from app.lora_modules import LoraTable, check_adapter_dir
from app.responses import ModelCard
from engine import LoRARequest


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM's: replace an adapter of that name instead of refusing


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # accepted for vLLM's clients; the name decides


async def _body(request: Request, model: type[BaseModel]) -> BaseModel:
    """The request's body as `model`: read here, after the route's gate, so that a server without the
    routes answers 404 whatever the body; errors answer as FastAPI's own (app/http_errors.py)."""
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from exc


def _bad(message: str, param: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


class Adapters:
    """The ingress's adapters: the name -> LoRARequest table, and the routes that read and change it."""

    def __init__(
        self,
        base_name: str,
        engine: DeploymentHandle,
        retry_after: int,
        base_root: str | None = None,
        modules: dict[str, str] | None = None,
        enable_lora: bool = False,
        allow_runtime_updating: bool = False,
    ):
        self.base_name, self.base_root = base_name, base_root
        self.table = LoraTable(modules or {})
        self._engine = engine
        self._enable_lora, self._allow = enable_lora, allow_runtime_updating
        self._retry_after = retry_after

    def resolve(self, model: str) -> LoRARequest | None | ApiError:
        """The adapter a request's `model` names; None for the base model; a 404 for anything else."""
        if model == self.base_name:
            return None
        adapter = self.table.get(model)
        if adapter is not None:
            return adapter
        names = ", ".join(repr(n) for n in [self.base_name, *(a.lora_name for a in self.table)])
        return ApiError(
            404,
            f"model '{model}' does not exist; this server serves {names} (GET /v1/models)",
            "not_found_error",
            "model",
            "model_not_found",
        )

    def cards(self, info: dict) -> list[ModelCard]:
        """The base model's card, then one per adapter (vLLM's root and parent)."""
        now = int(time.time())
        facts = {"max_model_len": info["max_model_len"], "vocab_size": info["vocab_size"]}
        base = ModelCard(id=self.base_name, created=now, root=self.base_root, **facts)
        adapters = [
            ModelCard(id=a.lora_name, created=now, root=a.lora_path, parent=self.base_name, **facts)
            for a in self.table
        ]
        return [base, *adapters]

    def _check_allowed(self) -> None:
        if not self._allow:  # the same answer as any absent route (app/http_errors.py)
            raise HTTPException(404)

    async def load(self, request: Request) -> Response | ApiError:
        self._check_allowed()
        body = await _body(request, LoadLoRAAdapterRequest)
        name, path = body.lora_name.strip(), body.lora_path.strip()
        refused = self._refuse_load(name, path, body.load_inplace)
        if refused is not None:
            return refused
        try:
            path = check_adapter_dir(path, "lora_path")
        except ValueError as exc:
            return _bad(str(exc), "lora_path", "invalid_lora_adapter")
        adapter = self.table.new_request(name, path)
        try:  # checked (and kept) by a replica before requests may use it
            failed = await self._engine.options(multiplexed_model_id=name).load_lora.remote(adapter)
        except Exception as exc:
            return call_failure(exc, self._retry_after)
        if failed is not None:
            return failed
        self.table.put(adapter)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    def _refuse_load(self, name: str, path: str, inplace: bool) -> ApiError | None:
        if not name or not path:
            return _bad("both 'lora_name' and 'lora_path' must be given (non-empty)", "lora_name")
        if not self._enable_lora:
            return _bad(
                "LoRA is off on this server: set enable_lora: true under args.engine in serve_config.yaml",
                "lora_name",
                "invalid_lora_adapter",
            )
        if name == self.base_name:
            return _bad(f"'{name}' is the base model's name: give the adapter a name of its own", "lora_name")
        if self.table.get(name) is not None and not inplace:
            return _bad(
                f"the LoRA adapter '{name}' has already been loaded: unload it first, or send "
                "load_inplace: true to replace it",
                "lora_name",
            )
        return None

    async def unload(self, request: Request) -> Response | ApiError:
        self._check_allowed()
        body = await _body(request, UnloadLoRAAdapterRequest)
        name = body.lora_name.strip()
        if self.table.remove(name) is None:
            message = f"the LoRA adapter '{name}' cannot be found (GET /v1/models lists them)"
            return ApiError(404, message, "not_found_error", "lora_name", "model_not_found")
        try:  # the replica that holds it (the router prefers it) drops it now; others evict it by LRU
            await self._engine.options(multiplexed_model_id=name).unload_lora.remote(name)
        except Exception:  # it is out of the table, which is what requests see
            pass
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
