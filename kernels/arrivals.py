"""Arrival counters for kernels whose last-arriving program finishes a shared piece of work.

Split-KV decode attention (the last split of a (sequence, KV head) merges the others) and the row
argmax (the last chunk of a row picks the winner) count their programs in here.
Counters start at 0 and the program that acts resets its counter, so one zeroed buffer serves every
launch, layer and graph replay. Sharing it between kernels is safe because launches run in stream
order and a PDL launch waits for its predecessor (kernels.pdl) before it touches a counter.
"""

from __future__ import annotations

import torch

_BUFFERS: dict[torch.device, list[torch.Tensor]] = {}


def arrival_counters(n: int, device: torch.device) -> torch.Tensor:
    """At least n zeroed int32 counters on `device`. A buffer is never freed once made (a captured graph
    keeps its address), so a larger request appends a new one; graph warm-up runs the largest batch
    first, so capture finds the buffer it needs already made."""
    bufs = _BUFFERS.setdefault(device, [])
    if not bufs or bufs[-1].numel() < n:
        bufs.append(torch.zeros(max(n, 1024), dtype=torch.int32, device=device))
    return bufs[-1]
