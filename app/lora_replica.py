"""The adapters one engine replica holds: Serve's model multiplexing over the engine core's LoRA cache.

Every request for an adapter reaches the replica with Serve's multiplexed model id (the adapter's name)
and its LoRARequest (name, id, path: the ingress keeps the table, app/lora_modules.py). Before the
request is submitted, the replica asks Serve's multiplexer (`serve.multiplexed`, at most
`max_cpu_loras` adapters a replica) for the adapter: a miss loads it, i.e. asks the core to take it
(CoreClient.add_lora, which checks it against the base model and raises LoRAError naming the file and
tensor), and evicts the least recently used adapter when the replica is full, telling the core to drop
it (CoreClient.remove_lora; requests still running with it finish first). The multiplexer makes room
before it loads, also for an adapter that then fails its check. Serve publishes the ids each replica
holds to the routers, and app/router.py prefers a replica that holds the request's adapter.

An adapter the ingress unloaded and loaded again under the same name comes with a new lora_int_id: the
replica then replaces what it holds under that name. `requests` and `loads` count adapter requests and
the loads they caused on this replica (stats: a request that caused no load found its adapter here).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Awaitable, Callable

from ray import serve

from engine import LoRARequest

logger = logging.getLogger("ray.serve")


class HeldAdapter:
    """What the multiplexer caches for one adapter. Serve calls `__del__` when it evicts the entry; the
    garbage collector calls it again later: only the first call drops the adapter from the core."""

    def __init__(self, request: LoRARequest, remove: Callable[[str], object]):
        self.request = request
        self._remove = remove
        self._lock = threading.Lock()
        self._released = False

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
        try:
            self._remove(self.request.lora_name)
        except Exception:  # the core may be gone (shutdown): nothing left to drop
            logger.debug("remove_lora(%s) failed", self.request.lora_name, exc_info=True)

    def __del__(self) -> None:
        self.release()


class ReplicaAdapters:
    """The replica's adapter cache; `multiplexed` is its serve.multiplexed loader (made per instance:
    max_num_models_per_replica comes from the engine's config)."""

    def __init__(self, engine, max_adapters: int):
        self._engine = engine
        self._incoming: dict[str, LoRARequest] = {}  # name -> the request being loaded
        self.requests = 0
        self.loads = 0

        async def load(name: str) -> HeldAdapter:
            request = self._incoming[name]
            self._engine.add_lora(request)  # checks the adapter; raises LoRAError
            self.loads += 1
            return HeldAdapter(request, self._engine.remove_lora)

        self.multiplexed: Callable[[str], Awaitable[HeldAdapter]] = serve.multiplexed(
            max_num_models_per_replica=max_adapters
        )(load)

    async def acquire(self, request: LoRARequest) -> None:
        """Make sure the core has this adapter (loading it, and evicting the LRU one, on a miss)."""
        self.requests += 1
        name = request.lora_name
        self._incoming[name] = request
        try:
            held = await self.multiplexed(name)
            if held.request != request:  # unloaded and loaded again with another id or path
                self._engine.remove_lora(name)
                self._engine.add_lora(request)
                self.loads += 1
                held.request = request
        finally:
            if self._incoming.get(name) is request:
                del self._incoming[name]

    def drop(self, name: str) -> bool:
        """The ingress unloaded it: the core drops it now (the multiplexer's entry goes by LRU)."""
        return bool(self._engine.remove_lora(name))

    def stats(self) -> dict:
        return {
            "lora_requests": self.requests,
            "lora_loads": self.loads,
            "lora_adapters": list(self._engine.list_loras()),
        }
