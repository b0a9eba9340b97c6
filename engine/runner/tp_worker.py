"""A tensor-parallel worker: rank r > 0 of an engine's group (started by engine/runner/tp_group.py as
`python -m engine.runner.tp_worker RANK SIZE STORE_PORT PARENT_PID CPUS`, CPUS a comma list or empty).

It loads its share of the model and its KV heads, then runs rank 0's commands (engine/runner/tp_wire.py)
from its stdin pipe until EOF: each forward and logits computation rank 0 runs, the copy-on-write block
copies, the KV pool, and on CUDA the capture and replay of the same graphs. It samples nothing and
knows no requests. It dies with rank 0: SIGKILL when the thread that started it ends
(PR_SET_PDEATHSIG), and EOF on its pipe.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import pickle
import signal
import sys

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.device.placement import configure_process, resolve_device_dtype
from engine.lora.manager import LoRAManager
from engine.lora.request import LoRARequest
from engine.models import all_reduce
from engine.models.attention_context import attention_context
from engine.models.layers import Attention
from engine.models.loader import load_model
from engine.models.parallel import Shard, local_config
from engine.runner import mtp_setup, tp_wire
from engine.runner.cuda_graph import pad_rows
from engine.runner.graph_sets import capture_sets
from engine.runner.kv_cache import KVCacheSpec, allocate_kv_cache, kv_cache_dtype
from engine.runner.tp_group import TIMEOUT, backend_for
from engine.runner.tp_model import CaptureModel, gather_logits

log = logging.getLogger("engine.tp_worker")


class Worker:
    """One rank's share of the model and its command loop."""

    def __init__(self, config: EngineConfig, shard: Shard, device: torch.device, dtype: torch.dtype):
        self.config, self.shard, self.device, self.dtype = config, shard, device, dtype
        self.model, self.model_config = load_model(config.load.model, dtype, device, False, None, shard)
        self.spans: dict[tuple[torch.dtype, int], torch.Tensor] = {}  # forward input buffers, reused
        self.kv_caches: list = []
        self.graphs: dict[int, object] = {}  # CUDA graph sets by kind (query length; 0: mixed)
        self.hidden: torch.Tensor | None = None  # the last forward's output rows (real tokens first)
        self.lora = None  # multi-LoRA: this rank's adapter slots, loaded as rank 0 loads its own
        mtp = mtp_setup.mtp_source(config, self.model_config)  # a gated-LoRA MTP gate's adapter
        if config.enable_lora or mtp is not None:
            layers, _ = mtp_setup.lora_layers(self.model, config, mtp, dtype)
            if config.enable_lora:
                self.lora = LoRAManager(config, self.model_config, layers, dtype)

    def run(self, commands) -> None:
        handlers = {
            tp_wire.FORWARD: self.forward,
            tp_wire.LOGITS: self.logits,
            tp_wire.COPY: self.copy_blocks,
            tp_wire.KV: self.allocate_kv,
            tp_wire.CAPTURE: self.capture,
            tp_wire.REPLAY: self.replay,
            tp_wire.LORA: self.load_lora,
            tp_wire.EMBED: self.embed,
            tp_wire.OWN_LOGITS: self.own_logits,
        }
        _freeze_heap()
        with torch.inference_mode():
            while (header := tp_wire.recv(commands)) is not None:
                handlers[header[0]](header)

    def _span(self, i: int, dtype: torch.dtype, length: int) -> torch.Tensor:
        buf = self.spans.get((dtype, i))
        if buf is None or buf.numel() < length:
            buf = self.spans[(dtype, i)] = torch.empty(max(length, 256), dtype=dtype, device=self.device)
        return buf[:length]

    def forward(self, header: list[int]) -> None:
        spans = [self._span(i, dt, n) for i, (dt, n) in enumerate(tp_wire.span_shapes(header))]
        for span in spans:
            dist.broadcast(span, 0)
        ids, positions, meta = tp_wire.decode_forward(header, spans)
        with attention_context(meta):
            self.hidden = self.model(ids, positions)

    def logits(self, header: list[int]) -> None:
        hidden = torch.empty((header[1], self.model_config.hidden_size), dtype=self.dtype, device=self.device)
        dist.broadcast(hidden, 0)
        gather_logits(self.model.compute_logits(hidden), self.shard.size, None)

    def own_logits(self, header: list[int]) -> None:
        """Rank 0's compute_own_logits: the first n rows of this rank's last forward, the last row
        repeated up to m, as rank 0 pads its own."""
        n, m = header[1], header[2]
        gather_logits(self.model.compute_logits(pad_rows(self.hidden[:n], m)), self.shard.size, None)

    def embed(self, header: list[int]) -> None:
        ids = torch.empty(header[1], dtype=torch.long, device=self.device)
        dist.broadcast(ids, 0)
        self.model.embed(ids)

    def copy_blocks(self, header: list[int]) -> None:
        k = header[1]
        src = torch.tensor(header[2 : 2 + k], dtype=torch.long, device=self.device)
        dst = torch.tensor(header[2 + k : 2 + 2 * k], dtype=torch.long, device=self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    def allocate_kv(self, header: list[int]) -> None:
        cfg = local_config(self.model_config, self.shard)
        dtype = kv_cache_dtype(self.config.cache, self.dtype)
        spec = KVCacheSpec(header[1], self.config.cache.block_size, cfg.num_layers, cfg.num_kv_heads,
                           cfg.head_dim, dtype)  # fmt: skip
        self.kv_caches = allocate_kv_cache(spec, self.device)
        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        for layer, (k_cache, v_cache) in zip(layers, self.kv_caches, strict=True):
            layer.k_cache, layer.v_cache = k_cache, v_cache

    def capture(self, header: list[int]) -> None:
        """The graphs rank 0 captures, in its order (graph_sets.capture_sets with its arguments)."""
        cfg, max_len = self.model_config, self.config.load.max_model_len
        max_model_len = min(max_len or min(cfg.max_position_embeddings, 8192), cfg.max_position_embeddings)
        model = CaptureModel(self.model)
        args = (self.device, self.dtype, self.config, max_model_len, cfg.hidden_size)
        uniform, mixed = capture_sets(model, *args)
        self.graphs = {**uniform, **({0: mixed} if mixed is not None else {})}
        _freeze_heap()

    def replay(self, header: list[int]) -> None:
        graph_set = self.graphs[header[1]]
        graph_set.graphs[header[2]].replay()
        self.hidden = graph_set.hidden  # its first rows are the step's real tokens

    def load_lora(self, header: list[int]) -> None:
        slot, name, int_id, path = tp_wire.decode_lora(header)
        self.lora.load_slot(slot, LoRARequest(name, int_id, path))


def _freeze_heap() -> None:
    """Keep the model's and the graphs' objects out of every later collection, as rank 0 does
    (engine/llm_engine.py): a full collection over them would stall a step of every rank."""
    gc.collect()
    gc.freeze()


def _die_with_parent() -> None:
    """SIGKILL this process when the thread that started it ends (Linux; elsewhere the pipe's EOF)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def main(rank: int, size: int, port: int, parent_pid: int, cpus: str = "") -> int:
    _die_with_parent()
    if cpus:  # before torch starts any thread: they inherit it
        os.sched_setaffinity(0, [int(c) for c in cpus.split(",")])
    if os.getppid() != parent_pid:
        return 1  # rank 0 died before the death signal was armed
    # Ctrl-C in a terminal reaches the whole process group: rank 0 handles it, and a worker ends
    # when rank 0 does, never on its own
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"tp-worker-{rank} %(levelname)s %(message)s")
    commands = os.fdopen(0, "rb")  # buffered: read(n) returns n bytes, or fewer only at EOF
    first = tp_wire.recv(commands)
    if first is None:
        return 1
    config: EngineConfig = pickle.loads(bytes(first))
    device, dtype = resolve_device_dtype(config.load.device, config.load.dtype)
    if device.type == "cuda":
        device = torch.device("cuda", (device.index or 0) + rank)
        torch.cuda.set_device(device)
    configure_process(device, config.load.seed, config.load.blas_library)  # as rank 0 does
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=TIMEOUT)
    store.set(f"ready/{rank}", "1")  # rank 0 waits for this, watching that no worker died first
    dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=size, timeout=TIMEOUT)
    all_reduce.install(
        device, dtype, not config.disable_custom_all_reduce, config.tensor_parallel_fp32_reduce
    )
    Worker(config, Shard(rank, size), device, dtype).run(commands)
    # EOF: rank 0 closed the group. Nothing is left to flush, and a clean interpreter teardown of
    # torch (and the group) takes seconds on a busy host: leave at once.
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(*(int(a) for a in sys.argv[1:5]), *sys.argv[5:6]))
