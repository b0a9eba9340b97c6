"""Aborts the ingress sends itself, for engine calls whose Serve cancellation was lost.

Serve cancels the engine call when the ingress's client goes away, but a cancellation that races the
call's start on the engine replica is now and then dropped (ray-project/ray#52533): the replica then
runs the request to its end, holding KV blocks for nobody. So the ingress also sends the engine
replica an explicit `abort(request_id)` whenever it gives up on a stream that has not finished.

That abort can arrive before the `generate` call it is meant for. `EarlyAborts` remembers such ids for
`ttl_s`, and the replica refuses a `generate` whose id it holds. Ids are unique per request (the
ingress makes them), so a remembered id never refuses a request that is still wanted; the set is
bounded by the ttl and by `max_ids`. With several engine replicas the abort may reach another replica
than the call did: there it is remembered unused, and the request is left to Serve's cancellation.
"""

from __future__ import annotations

import time
from collections import OrderedDict


class EarlyAborts:
    def __init__(self, ttl_s: float = 60.0, max_ids: int = 100_000):
        self.ttl_s, self.max_ids = ttl_s, max_ids
        self._ids: OrderedDict[str, float] = OrderedDict()  # request id -> time.monotonic() it came

    def add(self, request_id: str) -> None:
        now = time.monotonic()
        self._ids[request_id] = now
        self._ids.move_to_end(request_id)
        while self._ids and (
            len(self._ids) > self.max_ids or next(iter(self._ids.values())) < now - self.ttl_s
        ):
            self._ids.popitem(last=False)

    def take(self, request_id: str | None) -> bool:
        """Whether this id was aborted before it arrived (it is forgotten: ids are not reused)."""
        if request_id is None or request_id not in self._ids:
            return False
        return self._ids.pop(request_id) >= time.monotonic() - self.ttl_s

    def __len__(self) -> int:
        return len(self._ids)
