"""Rank 0's side of tensor parallelism: it starts one worker process per other rank, joins them in a
torch.distributed group (gloo on CPU, NCCL on CUDA) and sends each its commands (engine/runner/tp_wire.py).

Lifetime: workers start with the engine (ModelRunner) and stop with it: `close()` closes their
command pipes, and a worker ends at EOF. A worker never outlives rank 0: it asks for SIGKILL when the
thread that started it ends (PR_SET_PDEATHSIG; that keeper thread waits on it for its whole life, so
it ends only with rank 0's process), and the EOF of its pipe ends it too. A worker that dies fails
rank 0 loudly: its keeper records the death (and aborts NCCL, whose collectives would otherwise wait
for it), the next command raises TPWorkerError, and a collective under way fails (gloo sees the
connection drop at once).

The rendezvous is a TCPStore that rank 0 opens on a free port (port 0: the kernel picks) before the
workers start, so no port is guessed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
import weakref
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.device.cpus import last_cores
from engine.device.placement import resolve_device_dtype
from engine.models import all_reduce
from engine.models.parallel import Shard, check_tp
from engine.models.registry import config_from_dir
from engine.runner import tp_wire

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[2]


def _pin_cores() -> int:
    """MINSERVE_TP_PIN: whole cores each worker is pinned to, away from rank 0's step loop, which wakes
    it every step (engine/device/cpus.py). Its NCCL and CUDA threads inherit them and share them with its
    command loop. 0: unpinned."""
    value = os.environ.get("MINSERVE_TP_PIN", "1")
    if not value.isdigit():
        raise ValueError(f"MINSERVE_TP_PIN={value!r}: give whole cores per worker, 1 (default); 0 unpins")
    return int(value)


PIN_CORES = _pin_cores()
# NVLink multicast stays off in every process of the group: on a shared host it can take GPUs out of service.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
TIMEOUT = timedelta(seconds=int(os.environ.get("MINSERVE_TP_TIMEOUT_S", "600")))  # start-up and collectives
CLOSE_WAIT_S = 10.0


class TPWorkerError(BaseException):
    """A tensor-parallel worker died or its group failed: the engine cannot step any more.

    Not an Exception: the engine turns an Exception raised by a forward into a failure of the requests
    in that step and steps on (LLMEngine._launch), which would leave a broken engine looking healthy.
    This one ends the step loop instead (the engine core reports it and exits, failing the replica)."""


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def check_devices(device: torch.device, size: int, visible: int) -> None:
    """On CUDA each rank needs a GPU of its own: ranks r = 0..size-1 use device index (rank 0's) + r."""
    first = device.index or 0
    if device.type == "cuda" and first + size > visible:
        raise ValueError(
            f"tensor_parallel_size: {size} ranks from cuda:{first} need {first + size} visible GPUs, but "
            f"{visible} are visible; lower tensor_parallel_size or make more GPUs visible "
            "(CUDA_VISIBLE_DEVICES)"
        )


def worker_env() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, **NO_MULTICAST, "PYTHONPATH": path}


class TPGroup:
    """Rank 0 of a tensor-parallel group of `config.tensor_parallel_size` processes."""

    def __init__(self, config: EngineConfig, device: torch.device):
        size = config.tensor_parallel_size
        check_tp(config_from_dir(config.load.model), size, config.load.model, config.load.quantization)
        visible = torch.cuda.device_count() if device.type == "cuda" else 0
        check_devices(device, size, visible)
        if dist.is_initialized():  # the layers' collectives use the process's default group
            raise RuntimeError(
                "tensor_parallel_size > 1: this process already runs a tensor-parallel engine; shut it "
                "down first (ModelRunner.shutdown) or run each engine in a process of its own"
            )
        os.environ.update(NO_MULTICAST)  # rank 0 is this process: its NCCL reads these at init
        self.shard, self.device = Shard(0, size), device
        self.failed: str | None = None
        self.closing = False
        self.lockstep = False  # all ranks run the same code (graph capture): no headers
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
        self.procs: dict[int, subprocess.Popen] = {}
        self.pipes: dict[int, int] = {}
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.pipes)
        try:
            self._start(store, config)
        except BaseException:
            self.close()
            raise
        log.info("tensor parallel: %d ranks (%s), workers %s", size, backend_for(device),
                 [p.pid for p in self.procs.values()])  # fmt: skip

    def _start(self, store: dist.TCPStore, config: EngineConfig) -> None:
        if dist.is_initialized():
            raise RuntimeError(
                "tensor_parallel_size > 1: this process already ran a tensor-parallel engine on CUDA, whose "
                "NCCL group lives until the process ends; start each such engine in a process of its own"
            )
        for rank in range(1, self.shard.size):
            self._spawn(rank, store.port, config)
        self._await_ready(store)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device.index or 0)
        backend, size = backend_for(self.device), self.shard.size
        dist.init_process_group(backend, store=store, rank=0, world_size=size, timeout=TIMEOUT)
        dtype = resolve_device_dtype(config.load.device, config.load.dtype)[1]
        all_reduce.install(
            self.device, dtype, not config.disable_custom_all_reduce, config.tensor_parallel_fp32_reduce
        )

    def _spawn(self, rank: int, port: int, config: EngineConfig) -> None:
        """Start rank `rank` from a keeper thread that waits on it for its whole life (its death signal
        is tied to that thread), and send it its configuration."""
        read, write = os.pipe()
        started = threading.Event()
        cmd = [sys.executable, "-m", "engine.runner.tp_worker", str(rank), str(self.shard.size), str(port)]
        cmd += [str(os.getpid()), ",".join(map(str, self._worker_cpus(rank) or []))]

        def keeper() -> None:
            try:
                proc = self.procs[rank] = subprocess.Popen(cmd, stdin=read, env=worker_env(), cwd=ROOT)
            finally:
                started.set()
            code = proc.wait()
            self._died(rank, code)

        threading.Thread(target=keeper, name=f"tp-keeper-{rank}", daemon=True).start()
        started.wait()
        os.close(read)
        if rank not in self.procs:
            os.close(write)
            raise TPWorkerError(f"could not start tensor-parallel rank {rank}")
        self.pipes[rank] = write
        self._send_to(rank, list(pickle.dumps(config)))

    def _worker_cpus(self, rank: int) -> list[int] | None:
        """The CPUs rank `rank` is pinned to (engine/device/cpus.py), or None: unpinned."""
        if PIN_CORES <= 0:
            return None
        return last_cores(PIN_CORES, skip=PIN_CORES * self._core_slot(rank))

    def _core_slot(self, rank: int) -> int:
        """Which core from the end of the CPU set rank `rank` takes: its GPU's node-wide index, so that
        the workers of several replicas on one node (each seeing its own GPUs as 0..P-1) never share a
        core; on CPU, rank - 1."""
        if self.device.type != "cuda":
            return rank - 1
        local = (self.device.index or 0) + rank
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
        if local < len(visible) and visible[local].strip().isdigit():
            return int(visible[local])
        return local

    def _await_ready(self, store: dist.TCPStore) -> None:
        """Wait until every worker has started (imports done, about to join the group), failing at once
        if one dies first rather than after the rendezvous timeout."""
        keys = [f"ready/{rank}" for rank in self.procs]
        deadline = time.monotonic() + TIMEOUT.total_seconds()
        while not store.check(keys):
            self.check()
            if time.monotonic() > deadline:
                raise TPWorkerError(f"tensor-parallel workers did not start within {TIMEOUT}")
            time.sleep(0.01)

    def _died(self, rank: int, code: int) -> None:
        # code 0: the worker read EOF, which only rank 0 closing its pipe gives (close(), or the
        # finalizer at interpreter exit, where `closing` is never set)
        if self.closing or code == 0:
            return
        pid = self.procs[rank].pid
        self.failed = f"tensor-parallel worker rank {rank} (pid {pid}) exited with code {code}"
        log.error("%s; the engine cannot step any more", self.failed)
        if self.device.type == "cuda":  # NCCL would wait for the dead rank; gloo fails by itself
            with contextlib.suppress(Exception):
                dist.distributed_c10d._abort_process_group()

    # ------------------------------------------------------------------ commands
    def _send_to(self, rank: int, header: list[int]) -> None:
        try:
            tp_wire.send(self.pipes[rank], header)
        except OSError as e:  # EPIPE: the worker is gone
            self.failed = self.failed or f"tensor-parallel worker rank {rank} is gone ({e})"
            raise TPWorkerError(self.failed) from e

    def send(self, header: list[int]) -> None:
        """One command to every worker (not while the ranks run in lockstep)."""
        self.check()
        if not self.lockstep:
            for rank in self.pipes:
                self._send_to(rank, header)

    def check(self) -> None:
        if self.failed:
            raise TPWorkerError(self.failed)

    @contextlib.contextmanager
    def guard(self):
        """Collectives under way. Any failure here is fatal: the workers have their command and wait
        in its collectives, so a rank 0 that went on would pair its next collectives with the wrong
        ones. A failure caused by a dead worker is reported as that death."""
        try:
            yield
        except TPWorkerError:
            raise
        except Exception as e:
            self._wait_for_deaths()
            self.failed = self.failed or f"a tensor-parallel step failed on rank 0 ({type(e).__name__}: {e})"
            raise TPWorkerError(self.failed) from e

    def _wait_for_deaths(self, timeout: float = 1.0) -> None:
        """A collective failed: give the keepers a moment to report the worker that caused it."""
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout)

    @contextlib.contextmanager
    def in_lockstep(self):
        """Every rank runs the same code here (CUDA graph capture): collectives only, no headers."""
        self.lockstep = True
        try:
            yield
        finally:
            self.lockstep = False

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """The copy-on-write block copies of a step, before its forward, on every worker's KV cache."""
        self.send([tp_wire.COPY, len(copies), *[s for s, _ in copies], *[d for _, d in copies]])

    def allocate_kv(self, num_blocks: int) -> None:
        """Every worker allocates the KV pool rank 0 planned (same blocks, its own KV heads)."""
        self.send([tp_wire.KV, num_blocks])

    def close(self) -> None:
        """Stop the workers (EOF on their pipes; SIGKILL after CLOSE_WAIT_S) and leave the group."""
        self.closing = True
        self._finalizer()
        # The workers are gone. gloo's destroy is local; NCCL's (and its abort) waits for peers that
        # left, and hung on H200s, so a CUDA group stays until the process ends: one tensor-parallel
        # engine per process on CUDA (the engine core's life; tests and benchmarks start one each).
        if self.device.type != "cuda":
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def _stop(procs: dict[int, subprocess.Popen], pipes: dict[int, int]) -> None:
    for fd in pipes.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    pipes.clear()
    for proc in procs.values():
        try:
            proc.wait(CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
