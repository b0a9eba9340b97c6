"""Which engine replicas hold which LoRA adapter, as the prefix-aware router (app/router.py) sees it.

A replica holds at most `max_adapters` adapters (Serve's multiplexer, LRU, max_cpu_loras: app/
lora_replica.py). Routing an adapter's request to a replica that lacks it costs a load there and, on a
full replica, the eviction of another adapter, which the next request for that one pays again. What a
replica holds comes from two sources:
  * the adapter ids Serve publishes for it (`RunningReplica.multiplexed_model_ids`, pushed by the
    replica's multiplexer when it loads or evicts, then broadcast by the controller: a fraction of a
    second late);
  * this router's own model of the replica's LRU: every adapter request it routes there moves that
    adapter to the front, and what falls off the end is evicted. With one ingress this is exactly
    what the replica does, with no delay; a published id this model evicted within `recent_s` is
    taken as gone (the publication is older than the eviction), and published ids this model does
    not know (loaded through another ingress, or before) fill only the room its own ones leave.
`choose_group` gives the replicas a request for an adapter should go to: those that hold it (unless
they are overloaded, see `imbalance`), else those holding the fewest adapters, where it evicts least.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TypeVar

R = TypeVar("R")


class AdapterLRU:
    """This router's model of one replica's adapter cache."""

    def __init__(self, max_adapters: int):
        self.max_adapters = max_adapters
        self.held: OrderedDict[str, float] = OrderedDict()  # adapter -> last sent, oldest first
        self.evicted: dict[str, float] = {}  # adapter -> when this model evicted it

    def sent(self, adapter: str, now: float) -> None:
        self.held[adapter] = now
        self.held.move_to_end(adapter)
        self.evicted.pop(adapter, None)
        while self.max_adapters > 0 and len(self.held) > self.max_adapters:
            gone, _ = self.held.popitem(last=False)
            self.evicted[gone] = now
        if len(self.evicted) > 4 * max(self.max_adapters, 16):  # forget the oldest evictions
            for name in sorted(self.evicted, key=self.evicted.get)[: len(self.evicted) // 2]:
                del self.evicted[name]

    def known(self, published: Iterable[str], now: float, recent_s: float) -> set[str]:
        """The adapters the replica holds as far as this router can tell: those this router sent, and
        published ones in the room they leave (what this router sent since is more recent, so the
        replica evicted the others first)."""
        gone = {a for a, t in self.evicted.items() if t > now - recent_s}
        others = sorted(a for a in published if a not in self.held and a not in gone)
        room = self.max_adapters - len(self.held) if self.max_adapters > 0 else len(others)
        return set(self.held) | set(others[: max(0, room)])


def choose_group(
    candidates: list[R],
    holdings: list[set[str]],
    loads: list[int],
    adapter: str,
    imbalance: Callable[[int, int], bool],
) -> tuple[str, list[R]]:
    """(decision, the replicas to choose among): `adapter_hit` the holders, `adapter_new` those holding
    the fewest adapters when none holds it, `adapter_fallback` all of them when every holder's load is
    out of balance with the least loaded replica's (imbalance(holder_load, least_load) is true)."""
    holders = [i for i, held in enumerate(holdings) if adapter in held]
    if holders:
        least_holder = min(loads[i] for i in holders)
        if imbalance(least_holder, min(loads, default=0)):
            return "adapter_fallback", list(candidates)
        return "adapter_hit", [candidates[i] for i in holders]
    fewest = min((len(h) for h in holdings), default=math.inf)
    return "adapter_new", [c for c, h in zip(candidates, holdings, strict=True) if len(h) == fewest]
