"""The runner's LoRA side: checks adapters, holds them in host memory, puts a step's adapters into GPU
slots and gives each row of the step its slot.

Per step (`token_slots`): the adapters of the scheduled chunks get slots (engine/lora/slots.py); one not
in a slot is read from the host cache (from disk on a miss) and copied into every LoRA layer's slot
stacks, in stream order after the steps already enqueued. With tensor parallelism each worker loads the
same slot from the same file, sharded like its base layers (`on_load`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.config import EngineConfig
from engine.lora.adapter import AdapterSpec, ModuleShapes, check_adapter
from engine.lora.cache import HostCache
from engine.lora.layers import LoRALinear
from engine.lora.request import LoRARequest
from engine.lora.slots import SlotTable
from engine.lora.weights import AdapterWeights, load_adapter


class LoRAManager:
    def __init__(self, config: EngineConfig, model_config, layers: list[LoRALinear], dtype: torch.dtype):
        self.shapes = ModuleShapes.of(model_config)
        self.max_rank, self.dtype = config.max_lora_rank, dtype
        self.layers = layers
        self.pin = bool(layers) and layers[0].lora_a.device.type == "cuda"
        self.host: HostCache[AdapterWeights] = HostCache(config.lora_host_slots, self._read)
        self.slots = SlotTable(config.max_loras)
        self.on_load: Callable[[int, LoRARequest], None] | None = None  # tensor parallelism: the workers
        self.slot_loads = 0  # adapters copied into a slot (tests read it)

    def check(self, request: LoRARequest) -> AdapterSpec:
        """Raise LoRAError unless the adapter's files fit the base model and max_lora_rank."""
        return check_adapter(request.lora_path, self.shapes, self.max_rank)

    def _read(self, request: LoRARequest) -> AdapterWeights:
        return load_adapter(request, self.check(request), self.dtype, self.pin)

    def add(self, request: LoRARequest) -> None:
        """Check the adapter and read it into the host cache (vLLM's add_lora)."""
        self.host.get(request)

    def remove(self, name: str, pinned: set) -> bool:
        """Drop adapter `name` from the host cache and from the slots no running request holds."""
        self.slots.drop(name, pinned)
        return self.host.remove(name)

    def token_slots(self, chunks: list, pinned: set | None) -> list[int] | None:
        """Each row's slot for `chunks` (a SchedulerOutput's, in order), or None when no chunk has an
        adapter; loads the adapters that are not in a slot yet."""
        requests = {}
        for chunk in chunks:
            lora = chunk.seq.request.lora_request
            if lora is not None:
                requests.setdefault(lora.key, lora)
        if not requests:
            return None
        slot_of, loads = self.slots.assign(list(requests), pinned or set())
        for i, (key, slot) in enumerate(loads):
            try:
                self.load_slot(slot, requests[key])
            except BaseException:
                for failed, _ in loads[i:]:  # a slot left half-written is no adapter's
                    self.slots.slot_of.pop(failed, None)
                raise
        rows: list[int] = []
        for chunk in chunks:
            lora = chunk.seq.request.lora_request
            rows += [-1 if lora is None else slot_of[lora.key]] * chunk.num_tokens
        return rows

    def load_slot(self, slot: int, request: LoRARequest) -> None:
        """Copy the adapter (from the host cache, read on a miss) into `slot` of every LoRA layer."""
        weights = self.host.get(request)
        for layer in self.layers:
            layer.load_slot(slot, weights.modules)
        if self.on_load is not None:
            self.on_load(slot, request)
        self.slot_loads += 1
