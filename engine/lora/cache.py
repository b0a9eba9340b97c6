"""The host cache: adapters in host memory, least recently used evicted (max_cpu_loras of them).

Generic over what it holds (the engine's AdapterWeights, a worker's too) and over how an adapter is
read (`load`); keyed by LoRARequest.key, i.e. (name, id, path). Plain Python.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

from engine.lora.request import LoRARequest

V = TypeVar("V")


class HostCache(Generic[V]):
    def __init__(self, capacity: int, load: Callable[[LoRARequest], V]):
        self.capacity, self._load = capacity, load
        self.entries: OrderedDict[tuple[str, int, str], V] = OrderedDict()  # first: least recently used
        self.loads = 0  # adapters read from disk (tests read it)

    def get(self, request: LoRARequest) -> V:
        """The adapter's entry, read on a miss (evicting the least recently used over capacity)."""
        key = request.key
        if key in self.entries:
            self.entries.move_to_end(key)
            return self.entries[key]
        value = self._load(request)
        self.loads += 1
        self.entries[key] = value
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)
        return value

    def remove(self, name: str) -> bool:
        """Drop every entry of adapter `name`; False if none was held."""
        keys = [k for k in self.entries if k[0] == name]
        for key in keys:
            del self.entries[key]
        return bool(keys)

    def names(self) -> list[str]:
        """Held adapters' names, least recently used first."""
        return list(dict.fromkeys(key[0] for key in self.entries))
