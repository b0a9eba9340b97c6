"""The engine-core client's view of the core's adapters (engine/core_client.py): requests' adapters
checked in the caller's process, and the names in the core's host cache, mirrored from its stats.

The core applies LoRA commands in order and reports (commands applied, names held) with its stats
snapshots. The mirror changes at once when the client sends a command, and takes a snapshot only
once the core has applied every command sent, so a snapshot taken before the latest add or remove
never undoes it. Plain Python, no torch.
"""

from __future__ import annotations

import threading

from engine.lora.admission import LoRAAdmission
from engine.lora.request import LoRARequest


class LoRAMirror:
    def __init__(self, admission: LoRAAdmission):
        self.admission = admission
        self._names: list[str] = []
        self._sent = 0  # LoRA commands sent to the core
        self._lock = threading.Lock()

    def check(self, lora_request: LoRARequest | None) -> None:
        self.admission.check(lora_request)

    def added(self, lora_request: LoRARequest) -> None:
        """An AddLoRA command is being sent (the adapter was checked)."""
        with self._lock:
            self._sent += 1
            name = lora_request.lora_name
            self._names = [n for n in self._names if n != name] + [name]

    def removed(self, name: str) -> bool:
        """A RemoveLoRA command is being sent; whether the core's cache held the adapter, as mirrored."""
        self.admission.forget(name)
        with self._lock:
            self._sent += 1
            known = name in self._names
            self._names = [n for n in self._names if n != name]
            return known

    def take(self, snapshot: tuple[int, list[str]]) -> None:
        """The core's (commands applied, names held), from a stats snapshot."""
        applied, names = snapshot
        with self._lock:
            if applied >= self._sent:
                self._names = list(names)

    def names(self) -> list[str]:
        with self._lock:
            return list(self._names)
