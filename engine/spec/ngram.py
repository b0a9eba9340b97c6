"""Prompt-lookup (n-gram) proposals for speculative decoding, pure Python.

For n from n_max down to n_min, the last n tokens are the pattern; its most recent earlier occurrence
(start < len - n, so never the suffix itself; occurrences may overlap the suffix) gives the proposal:
up to k tokens that followed it, fewer if the sequence ends first. The first n that matches wins;
no match at any n proposes nothing.

Cost: one reverse scan of the sequence per n tried, comparing the pattern's last token first, so
O(len * n_max) in the worst case and about O(len) on natural text (most positions fail the first
comparison); a few thousand tokens take well under a millisecond per n in CPython.
"""

from __future__ import annotations


def _most_recent_match(token_ids: list[int], n: int) -> int:
    """Start of the latest occurrence of the last n tokens that begins before the suffix, or -1."""
    length = len(token_ids)
    pattern = token_ids[length - n :]
    last = pattern[-1]
    # end is the index of the occurrence's last token; the suffix itself ends at length - 1
    for end in range(length - 2, n - 2, -1):
        if token_ids[end] == last and token_ids[end - n + 1 : end + 1] == pattern:
            return end - n + 1
    return -1


def propose(token_ids: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest matching suffix."""
    if k < 1 or n_min < 1:
        raise ValueError(f"propose: need k >= 1 and n_min >= 1, got k={k}, n_min={n_min}")
    for n in range(min(n_max, len(token_ids) - 1), n_min - 1, -1):
        start = _most_recent_match(token_ids, n)
        if start >= 0:
            return token_ids[start + n : start + n + k]
    return []


class NgramIndex:
    """`propose` in O(n_max) per token: for each n in [n_min, n_max], the end of the latest occurrence
    of every n-gram, kept up to date as the sequence grows (a sequence only ever appends tokens).

    `propose(token_ids, k)` returns exactly what `propose(token_ids, k, n_max, n_min)` returns: grams
    ending at index <= len - 2 are indexed (an occurrence that starts before the suffix), the suffix's
    gram is looked up, longest n first."""

    def __init__(self, n_max: int, n_min: int):
        self.sizes = range(n_max, n_min - 1, -1)
        self.latest: dict[tuple[int, ...], int] = {}  # gram -> end index of its latest occurrence
        self.upto = 0  # grams ending at indexes < upto are indexed

    def _extend(self, token_ids: list[int], end: int) -> None:
        for e in range(self.upto, end):
            for n in self.sizes:
                if e + 1 >= n:
                    self.latest[tuple(token_ids[e - n + 1 : e + 1])] = e
        self.upto = max(self.upto, end)

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        length = len(token_ids)
        self._extend(token_ids, length - 1)
        for n in self.sizes:
            if n <= length - 1:
                end = self.latest.get(tuple(token_ids[length - n :]))
                if end is not None:
                    return token_ids[end + 1 : end + 1 + k]
        return []
