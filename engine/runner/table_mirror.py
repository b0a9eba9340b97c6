"""TableMirror: the block tables of recent steps as rows of one int32 array, kept across steps.

Packing a step used to turn every sequence's block list into a row of a fresh array, a Python-to-numpy
conversion per sequence per step. Here each table keeps a row while it runs; a step writes only the
blocks appended since the table's last step, and the step's table segment is one gather of rows
(`gather`). A table changed other than by appending (copy-on-write, trim, free: BlockTable.epoch moves)
is written again whole.

Invariant: for a live entry at the table's current epoch, row[:written] equals blocks[:written]. An
entry holds its table, so the id it is keyed by cannot be reused while it lives. Entries of tables no
step has named since the last sweep are dropped when rows run out; a row past a table's length keeps
block ids of earlier tables (valid ids, never read).
"""

from __future__ import annotations

import numpy as np


class _Entry:
    __slots__ = ("table", "row", "epoch", "written", "seen")

    def __init__(self, table, row: int):
        self.table, self.row, self.epoch, self.written, self.seen = table, row, table.epoch, 0, 0


class TableMirror:
    def __init__(self, width: int, capacity: int):
        self.width = width
        self.rows = np.zeros((capacity, width), dtype=np.int32)
        self._entries: dict[int, _Entry] = {}  # id(table) -> its entry
        self._free = list(range(capacity - 1, -1, -1))
        self._step = 0

    def index(self, tables: list) -> np.ndarray:
        """The row of each table (BlockTable objects, in a step's order), brought up to date."""
        self._step += 1
        step, idx = self._step, np.empty(len(tables), dtype=np.intp)
        for i, table in enumerate(tables):
            entry = self._entries.get(id(table))
            if entry is None:
                entry = self._add(table)
            elif entry.epoch != table.epoch:
                entry.epoch, entry.written = table.epoch, 0
            blocks, done = table.blocks, entry.written
            if len(blocks) > self.width:
                self._widen(len(blocks))
            if len(blocks) > done:
                self.rows[entry.row, done : len(blocks)] = blocks[done:]
                entry.written = len(blocks)
            entry.seen = step
            idx[i] = entry.row
        return idx

    def gather(self, idx: np.ndarray, out: np.ndarray) -> None:
        """Rows `idx` into `out` ([len(idx), W]: the first W entries of each row)."""
        if out.shape[1] > self.width:  # an eager step's width, the longest table rounded up
            self._widen(out.shape[1])
        np.take(self.rows[:, : out.shape[1]], idx, axis=0, out=out)

    def _add(self, table) -> _Entry:
        if not self._free:
            self._sweep()
        entry = self._entries[id(table)] = _Entry(table, self._free.pop())
        return entry

    def _widen(self, n: int) -> None:
        """Room for n blocks per row (a table longer than the width it was made with)."""
        self.width = -(-n // 16) * 16
        rows = np.zeros((len(self.rows), self.width), dtype=np.int32)
        rows[:, : self.rows.shape[1]] = self.rows
        self.rows = rows

    def _sweep(self) -> None:
        """Drop the entries this step has not named; grow the array if every row is in this step."""
        stale = [key for key, e in self._entries.items() if e.seen != self._step]
        for key in stale:
            self._free.append(self._entries.pop(key).row)
        if not self._free:
            old = len(self.rows)
            self.rows = np.concatenate([self.rows, np.zeros_like(self.rows)])
            self._free = list(range(2 * old - 1, old - 1, -1))
