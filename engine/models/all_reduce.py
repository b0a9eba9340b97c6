"""The all-reduce of a tensor-parallel forward: row-parallel projections and the vocab-parallel embedding.

NCCL serves every message. On CUDA, a message of at most ONE_SHOT_MAX_BYTES in bf16 or fp32 takes
PyTorch's one-shot all-reduce over symmetric memory instead: one kernel copies this rank's part into
its own buffer, meets the peers at a barrier, reads every peer's buffer over NVLink peer-to-peer, sums
them and meets the peers again. A decode step's messages are a few KiB, where NCCL's ring protocol
costs more in latency than the transfer itself (benchmarks/tp_allreduce.py measures both per size and
set the crossover).

The second barrier is what lets one buffer serve every call: a rank overwrites its buffer only after
every peer has finished reading it. The kernel reads peers' memory directly; it never uses NVLink
multicast (no multimem operation is called, and the group's processes run with multicast switched
off, see engine/runner/tp_group.NO_MULTICAST).

Where a row-parallel projection feeds the next RMSNorm (every plain decoder layer), the all-reduce, the
residual add and the norm are one kernel for messages the fused path takes (`allreduce_add_rms_norm`,
kernels/triton_allreduce_norm.py): it saves the norm's launch and one of the one-shot kernel's two
barriers, and, launched with PDL, lets the next GEMV start streaming its weights while it waits.

With `tensor_parallel_fp32_reduce`, row-parallel projections pass fp32 partial sums: the fused kernel
takes them up to 64 rows (twice the bytes over NVLink), NCCL above; each rank then rounds the total
once. The symmetric slots are fp32 either way, viewed as the model dtype for its partials.

`install` runs once per process, right after the group forms, on every rank in the same order: the
symmetric buffer's rendezvous is itself a collective.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# The largest message (bytes) the one-shot kernel takes; NCCL above. Where one-shot stops paying off on
# H100s over NVLink (benchmarks/tp_allreduce.py; docs/tensor_parallel.md has the table).
ONE_SHOT_MAX_BYTES = 512 * 1024
ONE_SHOT_DTYPES = (torch.bfloat16, torch.float32)  # what PyTorch's kernel dispatches on


class OneShot:
    """A symmetric buffer of `max_bytes` on this rank's GPU, and the one-shot all-reduce through it."""

    def __init__(self, device: torch.device, dtype: torch.dtype, max_bytes: int):
        import torch.distributed._symmetric_memory as symm_mem

        group = dist.group.WORLD
        self.group_name = group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(self.group_name)
        self.dtype = dtype
        self.buffer = symm_mem.empty(max_bytes // dtype.itemsize, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, group)

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and x.numel() <= self.buffer.numel() and x.is_contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # the buffer's first numel elements (storage offset 0): the kernel copies exactly that many
        shared = self.buffer[: x.numel()].view(x.shape)
        out = torch.empty_like(x)
        return torch.ops.symm_mem.one_shot_all_reduce_copy_out(shared, x, "sum", self.group_name, out)


class FusedAddNorm:
    """Symmetric memory for kernels/triton_allreduce_norm.py: two slots per rank, the flags every peer
    signals into, and this rank's epoch per program. A slot holds the rows of `max_bytes` of model-dtype
    partials in fp32 (`wide_partials`), or those rows in the model dtype (the same storage, viewed)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, max_bytes: int):
        import torch.distributed._symmetric_memory as symm_mem

        from kernels.triton_allreduce_norm import MAX_ROWS

        group = dist.group.WORLD
        self.max_rows = MAX_ROWS
        self.slot_elems = max_bytes // dtype.itemsize  # elements of one slot, whichever dtype it holds
        data = symm_mem.empty(2 * self.slot_elems, dtype=torch.float32, device=device)
        flags = symm_mem.empty(MAX_ROWS * group.size(), dtype=torch.int64, device=device)
        flags.zero_()
        wide = _peer_views(data, group)
        self.data = {torch.float32: wide}
        if dtype != torch.float32:  # the same bytes as model-dtype slots (each twice the elements it needs)
            self.data[dtype] = [d.view(dtype) for d in wide]
        self.flags = _peer_views(flags, group)
        self.rank = group.rank()
        self.epochs = torch.zeros(MAX_ROWS, dtype=torch.int64, device=device)
        torch.cuda.synchronize(device)
        dist.barrier()  # every rank's flags are zero before any peer can signal into them

    def fits(self, x: torch.Tensor) -> bool:
        """Whether partial sum `x` fits, in either dtype a slot holds."""
        rows, cols = x.numel() // x.shape[-1], x.shape[-1]
        small = rows <= self.max_rows and x.numel() <= self.slot_elems and cols % 16 == 0
        return small and x.dtype in self.data and x.is_contiguous()

    def __call__(self, partial, residual, weight, eps, weight_offset):
        from kernels.triton_allreduce_norm import allreduce_add_rms_norm

        shape = partial.shape
        rows = partial.reshape(-1, shape[-1]), residual.reshape(-1, shape[-1]).contiguous()
        symm = (self.data[partial.dtype], self.flags, self.epochs, self.rank)
        out, res = allreduce_add_rms_norm(*rows, weight, eps, weight_offset, *symm)
        return out.view(residual.shape), res.view(residual.shape)


def _peer_views(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's copy of symmetric `tensor` as this process maps it, by rank (a collective)."""
    import torch.distributed._symmetric_memory as symm_mem

    handle = symm_mem.rendezvous(tensor, group)
    shape, dtype = tuple(tensor.shape), tensor.dtype
    return [
        tensor if r == handle.rank else handle.get_buffer(r, shape, dtype) for r in range(handle.world_size)
    ]


_one_shot: OneShot | None = None
_fused: FusedAddNorm | None = None
_wide = False


def install(device: torch.device, dtype: torch.dtype, enabled: bool, wide: bool = False) -> None:
    """Set up this process's small-message path (a collective: every rank calls it, in step), and
    whether partial sums are fp32 (`wide`)."""
    global _one_shot, _fused, _wide
    _one_shot = _fused = None
    _wide = wide
    if not enabled or device.type != "cuda" or dtype not in ONE_SHOT_DTYPES:
        return
    from kernels.triton_allreduce_norm import MAX_WORLD

    _one_shot = OneShot(device, dtype, ONE_SHOT_MAX_BYTES)
    if dist.get_world_size() <= MAX_WORLD:  # every rank decides alike: the set-up is a collective
        _fused = FusedAddNorm(device, dtype, ONE_SHOT_MAX_BYTES)
    fused = "; fused with add + RMSNorm up to 64 rows" if _fused is not None else ""
    fused += "; fp32 partial sums" if wide else ""
    log.info("one-shot all-reduce for messages up to %d KiB%s", ONE_SHOT_MAX_BYTES // 1024, fused)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of `x` over the ranks: a new tensor on the one-shot path, `x` itself (reduced in place)
    on NCCL's. Callers use the returned tensor."""
    if _one_shot is not None and _one_shot.fits(x):
        return _one_shot(x)
    dist.all_reduce(x)
    return x


def wide_partials() -> bool:
    """Whether row-parallel projections hand over fp32 partial sums (EngineConfig.
    tensor_parallel_fp32_reduce): the sum over ranks is then rounded once, as TP=1's one GEMM rounds it,
    rather than each rank rounding its part first."""
    return _wide


def fused_for(partial: torch.Tensor) -> FusedAddNorm | None:
    """The fused all-reduce + add + RMSNorm if it takes this partial sum (engine/models/parallel.py)."""
    return _fused if _fused is not None and _fused.fits(partial) else None
