"""What this process's prefix-aware routers decided, shared with the ingress that owns them.

Ray Serve ships a request router class by value (config.RequestRouterConfig registers its module with
cloudpickle.register_pickle_by_value), so the copy that runs in the ingress's handle has module
globals of its own: state kept in app/router.py's globals would be invisible to app/engine_client.py.
Modules are pickled by reference, so the router reaches this one through `routing_table.X` (never
`from app.routing_table import X`, which would copy the object) and both see the same tables.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

MAX_ROUTED_IDS = 100_000
# engine request id -> the replica it was routed to (written on the router's thread, read on the
# ingress's: single dict operations, atomic under the GIL)
ROUTED: OrderedDict[str, object] = OrderedDict()
# routing decisions since the process started, by kind (cache_hit, balanced, fallback)
DECISIONS: Counter = Counter()


def routed(request_id: str, replica_id: object) -> None:
    ROUTED[request_id] = replica_id
    while len(ROUTED) > MAX_ROUTED_IDS:
        ROUTED.popitem(last=False)


def replica_of(request_id: str) -> object | None:
    """The replica a prefix-aware router sent this engine request to (None: unknown, or no such router)."""
    return ROUTED.get(request_id)
