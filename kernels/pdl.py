"""Programmatic dependent launch (PDL, Hopper and newer) for the decode kernels.

A decode step is a chain of ~10 kernels per layer, most of them short. Normally kernel N+1 cannot
start until kernel N has fully drained, so every boundary costs a launch plus a ramp-up. A kernel
launched with PDL may start while its predecessor is still running; it must then call
`wait_for_inputs` before it touches anything an earlier kernel wrote (or reads it, or writes memory
an earlier kernel may still read). Until then it may only read what no kernel in the step writes:
the weights. The GEMV uses that window to start streaming its first weight tile.

Safety of the chain: every PDL kernel waits (griddepcontrol.wait: the predecessor grid has completed
and its writes are visible) before its first dependent access. A grid completes only after its own
wait has returned, so when any kernel passes its wait, every kernel before it in the stream has
completed, not just the one directly before it. This holds whether a kernel lets its successor launch
after its wait or before it (RELEASE_FIRST: the norm, the decode attention, the GEMVs and the LoRA
expand do, so the next GEMV's first weight loads overlap the kernel two back). A kernel launched
without PDL (cuBLAS, torch ops) waits for its predecessor as usual. cuBLASLt's GEMM kernels must
stay that way: none of those our decode shapes use waits for a PDL producer before reading its
input (checked on an H200; docs/performance.md).

Off on CPU, under the Triton interpreter, before sm_90, and with MINSERVE_PDL=0.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

ENV = "MINSERVE_PDL"


@functools.lru_cache(maxsize=1)
def interpreting() -> bool:
    """Whether kernels run under the Triton interpreter, which has neither PDL nor inline PTX. Triton
    fixes the flag when the kernels are defined, so it is read once."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=8)
def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` are launched with PDL (pass as USE_PDL= and launch_pdl=)."""
    if device.type != "cuda" or os.environ.get(ENV, "1") == "0" or interpreting():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


@triton.jit
def wait_for_inputs(USE_PDL: tl.constexpr, RELEASE_FIRST: tl.constexpr = False):
    """Block until the previous kernels' writes are visible, then let the next kernel launch early.

    RELEASE_FIRST lets the next kernel launch before the wait instead: for a short kernel followed by a
    GEMV, whose weight loads then overlap the kernel before this one, not only this one. The chain
    stays safe: the next kernel's own wait returns only once this kernel has completed, which is after
    this kernel's wait, so every earlier kernel has completed too."""
    if USE_PDL:
        if RELEASE_FIRST:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
        if not RELEASE_FIRST:
            tl.extra.cuda.gdc_launch_dependents()
