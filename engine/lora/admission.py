"""A request's adapter checked at the door (LLMEngine.add_request, CoreClient.submit): the right type,
LoRA enabled, and files that fit the base model and max_lora_rank (engine/lora/adapter.py). Plain
Python, no torch: it runs in the caller's process before the request is accepted."""

from __future__ import annotations

from collections import OrderedDict

from engine.errors import InvalidRequestError
from engine.lora.adapter import ModuleShapes, check_adapter
from engine.lora.request import LoRARequest

_REMEMBERED = 64  # adapters recently found good, not read again


class LoRAAdmission:
    """Checks requests' adapters for an engine; shapes None: the engine runs without enable_lora."""

    def __init__(self, shapes: ModuleShapes | None, max_lora_rank: int):
        self.shapes, self.max_lora_rank = shapes, max_lora_rank
        self._good: OrderedDict[tuple[str, int, str], None] = OrderedDict()

    def check(self, lora_request: LoRARequest | None) -> None:
        """Raise InvalidRequestError (LoRAError for the adapter's files) unless the request may run."""
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            what = type(lora_request).__name__
            raise InvalidRequestError(
                f"lora_request: got {what}; give an engine.LoRARequest", field="lora_request"
            )
        if self.shapes is None:
            raise InvalidRequestError(
                f"model: adapter {lora_request.lora_name!r} asked for, but the engine runs without LoRA; "
                "start it with enable_lora=True",
                field="model",
            )
        key = lora_request.key
        if key in self._good:
            self._good.move_to_end(key)
            return
        check_adapter(lora_request.lora_path, self.shapes, self.max_lora_rank)
        self._good[key] = None
        if len(self._good) > _REMEMBERED:
            self._good.popitem(last=False)

    def forget(self, name: str) -> None:
        """Check adapter `name` afresh next time (its files may change once it is removed)."""
        for key in [k for k in self._good if k[0] == name]:
            del self._good[key]
