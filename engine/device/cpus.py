"""Which CPUs a helper process of the engine runs on (no torch: engine/structured imports this).

A helper that blocks on a pipe or socket and is woken by the step loop is, by default, woken on the
loop's own CPU (the kernel's wake-affine placement), where it then competes with the loop's Python.
Pinning each helper to whole cores at the end of the process's CPU set keeps the loop's CPU its own.
The loop itself stays unpinned: threads it starts later (torch's CPU pool) would inherit a narrower
set than their count assumes.
"""

from __future__ import annotations

import os
from pathlib import Path

# the CPUs this process may use, read before any helper is pinned: every split takes the same set, so a
# second engine in one process does not shrink the first one's share
ALLOWED = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
MIN_CORES = 4  # below this many whole cores, nothing is pinned


def whole_cores() -> list[frozenset[int]]:
    """The allowed CPUs grouped by physical core (hyperthread siblings together), in CPU order."""
    if ALLOWED is None:
        return []
    cores: dict[frozenset, None] = {}
    for cpu in sorted(ALLOWED):
        try:
            text = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text()
        except OSError:
            text = str(cpu)
        cores[frozenset(cpu_list(text)) & ALLOWED] = None
    return list(cores)


def last_cores(count: int, skip: int = 0) -> list[int] | None:
    """The CPUs of `count` whole cores at the end of the allowed set, after leaving out its last `skip`
    cores; None (unpinned) with fewer than MIN_CORES cores or when they do not leave the loop half."""
    cores = whole_cores()
    if len(cores) < MIN_CORES or count + skip > len(cores) // 2:
        return None
    ours = cores[len(cores) - skip - count : len(cores) - skip]
    return sorted(set().union(*ours))


def cpu_list(text: str) -> list[int]:
    """'0-3,8' -> [0, 1, 2, 3, 8] (the kernel's cpu list format)."""
    cpus = []
    for part in text.strip().split(","):
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus
