"""The audit shared by the GPU block pool and the host KV tier: reference counts against what should hold
them, and the two free lists (uncached, cached) against the counts. Pure Python, no torch."""

from __future__ import annotations

from collections.abc import Sequence


def refcount_problems(
    unit: str,
    ref_count: Sequence[int],
    expected: Sequence[int],
    holders: str,
    free_uncached,
    free_cached,
) -> list[str]:
    """Each `unit` (a block, a host slot) whose count differs from `expected` (held by `holders`), is
    free twice, free yet referenced, or neither free nor referenced: a leak or a double free."""
    problems = [
        f"{unit} {i}: ref_count {ref_count[i]} but {expected[i]} {holders}"
        for i in range(len(ref_count))
        if expected[i] != ref_count[i]
    ]
    free = set(free_uncached) | set(free_cached)
    if len(free) != len(free_uncached) + len(free_cached):
        problems.append(f"a {unit} is listed twice in the free lists")
    problems += [f"{unit} {i} is free but referenced" for i in free if ref_count[i]]
    problems += [
        f"{unit} {i} is neither free nor referenced"
        for i in range(len(ref_count))
        if not ref_count[i] and i not in free
    ]
    return problems
