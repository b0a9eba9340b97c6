"""Arrival counters for kernels whose last-arriving program finishes a shared piece of work.

Split-KV decode attention (the last split of a (sequence, KV head) merges the others) and the row
argmax (the last chunk of a row picks the winner) count their programs in here. A program stores its
partial result, then calls arrive_last(); the one call that returns True sees every other program's
partial and finishes the work. Counters start at 0 and the program that acts resets its counter, so
one zeroed buffer serves every launch, layer and graph replay. Sharing it between kernels is safe
because launches run in stream order and a PDL launch waits for its predecessor (kernels.pdl) before
it touches a counter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BUFFERS: dict[torch.device, list[torch.Tensor]] = {}


def arrival_counters(n: int, device: torch.device) -> torch.Tensor:
    """At least n zeroed int32 counters on `device`. A buffer is never freed once made (a captured graph
    keeps its address), so a larger request appends a new one; graph warm-up runs the largest batch
    first, so capture finds the buffer it needs already made."""
    bufs = _BUFFERS.setdefault(device, [])
    if not bufs or bufs[-1].numel() < n:
        bufs.append(torch.zeros(max(n, 1024), dtype=torch.int32, device=device))
    return bufs[-1]


@triton.jit
def arrive_last(counter, n):
    """Count this program in at `counter`; True for the n-th (last) of n programs to arrive.

    The first CTA barrier orders every thread's partial stores before the counter's release. The atomic's
    acquire makes the other programs' stores visible to the thread that performed it; the second barrier
    extends that to every thread of the CTA before any of them loads a partial (read them with .cg)."""
    tl.debug_barrier()
    last = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == n - 1
    tl.debug_barrier()
    return last
