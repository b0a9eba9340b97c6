"""The GPU slot table: which adapter occupies each of the max_loras slots. Plain Python.

A step's adapters get slots before its forward; an adapter not in a slot takes a free one or evicts the
least recently used adapter that no running request holds (`pinned`). The scheduler never runs more
distinct adapters at once than there are slots (Scheduler._lora_fits), so a slot is always found.
"""

from __future__ import annotations

from collections import OrderedDict

Key = tuple[str, int, str]  # LoRARequest.key


class SlotTable:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.slot_of: OrderedDict[Key, int] = OrderedDict()  # first: least recently used

    def assign(self, needed: list[Key], pinned: set[Key]) -> tuple[dict[Key, int], list[tuple[Key, int]]]:
        """(slot of each needed adapter, the (adapter, slot) loads to perform first)."""
        loads = []
        for key in needed:
            if key in self.slot_of:
                self.slot_of.move_to_end(key)
                continue
            slot = self._free_slot(set(needed) | pinned)
            self.slot_of[key] = slot
            loads.append((key, slot))
        return {key: self.slot_of[key] for key in needed}, loads

    def _free_slot(self, keep: set[Key]) -> int:
        used = set(self.slot_of.values())
        free = [s for s in range(self.num_slots) if s not in used]
        if free:
            return free[0]
        victim = next((k for k in self.slot_of if k not in keep), None)
        if victim is None:
            raise RuntimeError(
                f"a step needs more adapters than max_loras={self.num_slots} slots hold (a scheduler bug)"
            )
        return self.slot_of.pop(victim)

    def drop(self, name: str, pinned: set[Key]) -> None:
        """Free the slots of adapter `name` that no running request holds (remove_lora)."""
        for key in [k for k in self.slot_of if k[0] == name and k not in pinned]:
            del self.slot_of[key]
