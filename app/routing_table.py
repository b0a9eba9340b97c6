"""What this process's prefix-aware routers decided, shared with the ingress that owns them.

Ray Serve ships a request router class by value (config.RequestRouterConfig registers its module with
cloudpickle.register_pickle_by_value), so the copy that runs in the ingress's handle has module
globals of its own: state kept in app/router.py's globals would be invisible to app/engine_client.py.
Modules are pickled by reference, so the router reaches this one through `routing_table.X` (never
`from app.routing_table import X`, which would copy the object) and both see the same tables.

Besides where each engine request went, the table keeps the prefill work this process has sent each
replica and not yet seen started: a request's uncached blocks count against its replica from the
moment it is routed until its first output (or its end) reaches the ingress (app/engine_client.py).
All writes are single dict operations from the ingress's event loop or the router on it: atomic under
the GIL.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

MAX_ROUTED_IDS = 100_000
# engine request id -> the replica it was routed to
ROUTED: OrderedDict[str, object] = OrderedDict()
# routing decisions since the process started, by kind (cache_hit, balanced, fallback)
DECISIONS: Counter = Counter()
# LoRA adapter routing decisions (adapter_hit, adapter_new, adapter_fallback: app/adapter_affinity.py)
ADAPTER_DECISIONS: Counter = Counter()
# engine request id -> (replica, blocks of prefill it was expected to need there), until it starts
UNSTARTED: dict[str, tuple[object, int]] = {}
# replica -> sum of UNSTARTED blocks routed to it
PENDING_BLOCKS: Counter = Counter()


def routed(request_id: str, replica_id: object, prefill_blocks: int = 0) -> None:
    """A request went to a replica, expected to prefill `prefill_blocks` blocks there (a call made again
    after its replica died moves its pending work to the new replica)."""
    started(request_id)
    ROUTED[request_id] = replica_id
    while len(ROUTED) > MAX_ROUTED_IDS:
        ROUTED.popitem(last=False)
    if prefill_blocks > 0:
        UNSTARTED[request_id] = (replica_id, prefill_blocks)
        PENDING_BLOCKS[replica_id] += prefill_blocks


def started(request_id: str) -> None:
    """The request's prefill is done (its first output came) or it ended: its work is no longer ahead
    of anyone's. Idempotent."""
    entry = UNSTARTED.pop(request_id, None)
    if entry is not None:
        replica_id, blocks = entry
        PENDING_BLOCKS[replica_id] -= blocks
        if PENDING_BLOCKS[replica_id] <= 0:
            del PENDING_BLOCKS[replica_id]


def pending_blocks(replica_id: object) -> int:
    """Blocks of prefill this process routed to the replica that have not started yet."""
    return PENDING_BLOCKS.get(replica_id, 0)


def replica_of(request_id: str) -> object | None:
    """The replica a prefix-aware router sent this engine request to (None: unknown, or no such router)."""
    return ROUTED.get(request_id)
