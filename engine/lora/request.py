"""LoRARequest: which adapter a request runs with (vLLM's name and fields). Plain Python, no torch."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import InvalidRequestError


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, a caller-chosen integer id (> 0) and the directory PEFT saved it to.

    Requests with the same (name, id, path) share the adapter's slot and, with the same prompt prefix,
    its KV blocks; the name is how the API and remove_lora refer to it."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise InvalidRequestError("lora_name: give the adapter a non-empty name", field="lora_name")
        ok = isinstance(self.lora_int_id, int) and not isinstance(self.lora_int_id, bool)
        if not ok or self.lora_int_id < 1:
            raise InvalidRequestError(
                f"lora_int_id: got {self.lora_int_id!r}; use an integer >= 1 (0 means no adapter in vLLM)",
                field="lora_int_id",
            )
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise InvalidRequestError(
                "lora_path: give the directory holding adapter_config.json", field="lora_path"
            )

    @property
    def key(self) -> tuple[str, int, str]:
        """The adapter's identity in the host cache, the GPU slots and the prefix cache: a server gives
        an adapter loaded again (maybe with new files) a new id, so nothing of the old one is reused."""
        return (self.lora_name, self.lora_int_id, self.lora_path)
