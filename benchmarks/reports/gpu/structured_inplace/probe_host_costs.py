# ruff: noqa: B023 - each lambda is timed at once, inside its loop iteration
"""Host-side microcosts on the GPU host: argmax launch, mask upload, uploader, UVA mask reads."""

import mmap
import os
import socket
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
from engine.uploader import Uploader
from kernels import ops, pdl, triton_argmax

dev = torch.device("cuda")
R, V = 64, 128256
W = (V + 31) // 32
logits = torch.randn(R, V, device=dev, dtype=torch.bfloat16)


def host_us(fn, n=300, sync=True):
    ts = []
    for _ in range(n):
        if sync:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    ts.sort()
    p50, p10, mean = 1e6 * ts[len(ts) // 2], 1e6 * ts[len(ts) // 10], 1e6 * sum(ts) / len(ts)
    return f"p50 {p50:.1f} p10 {p10:.1f} mean {mean:.1f} us"


def gpu_us(fn, n=200):
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return f"{1000 * a.elapsed_time(b) / n:.1f} us/iter (gpu)"


# registered host buffer (as the matcher process's mmap)
size = 4 * R * W * 4
buf = mmap.mmap(-1, size)
host4 = torch.frombuffer(buf, dtype=torch.int32).view(4, R, W)
st = torch.cuda.cudart().cudaHostRegister(host4.data_ptr(), host4.numel() * 4, 0)
print("register", st)
host4.fill_(-1)
reg = host4[1]
pinned = torch.full((R, W), -1, dtype=torch.int32, pin_memory=True)
dmask = torch.full((R, W), -1, dtype=torch.int32, device=dev)
rows_half = torch.arange(0, R, 2, device=dev)
row_of = torch.full((R,), -1, dtype=torch.long, device=dev)
row_of[::2] = torch.arange(R // 2, device=dev)

for flag in ("1", "0"):
    os.environ["MINSERVE_PDL"] = flag
    pdl.enabled.cache_clear()
    ops.argmax(logits)
    ops.argmax(logits, dmask)
    print(f"PDL={flag} argmax plain host", host_us(lambda: ops.argmax(logits)))
    print(f"PDL={flag} argmax mask  host", host_us(lambda: ops.argmax(logits, dmask)))
    print(f"PDL={flag} argmax plain host nosync", host_us(lambda: ops.argmax(logits), sync=False))
os.environ["MINSERVE_PDL"] = "1"
pdl.enabled.cache_clear()
print(
    "torch.empty x3",
    host_us(
        lambda: (
            torch.empty(R, dtype=torch.int64, device=dev),
            torch.empty((R, 63), device=dev),
            torch.empty((R, 63), dtype=torch.int32, device=dev),
        )
    ),
)
print("gpu argmax plain", gpu_us(lambda: ops.argmax(logits)))
print("gpu argmax dev mask", gpu_us(lambda: ops.argmax(logits, dmask)))
print("gpu argmax dev mask half", gpu_us(lambda: ops.argmax(logits, dmask[: R // 2], row_of)))
# UVA: pass the registered host tensor straight to the kernel
for name, src in (("registered", reg), ("pinned", pinned)):
    try:
        a = ops.argmax(logits, dmask)
        b = triton_argmax.argmax(logits, src)
        torch.cuda.synchronize()
        print("UVA", name, "same ids:", bool((a == b).all()))
        print("UVA", name, "host", host_us(lambda: triton_argmax.argmax(logits, src)))
        print("UVA", name, gpu_us(lambda: triton_argmax.argmax(logits, src)))
        print("UVA", name, "half", gpu_us(lambda: triton_argmax.argmax(logits, src[: R // 2], row_of)))
    except Exception as exc:
        print("UVA", name, "failed:", repr(exc)[:300])
try:

    class CAI:
        def __init__(self, t):
            self.__cuda_array_interface__ = {
                "shape": tuple(t.shape),
                "typestr": "<i4",
                "data": (t.data_ptr(), False),
                "version": 3,
                "strides": None,
            }

    alias = torch.as_tensor(CAI(reg), device=dev)
    print("cuda_array_interface alias:", alias.device, alias.data_ptr() == reg.data_ptr(), int(alias[0, 0]))
except Exception as exc:
    print("cuda_array_interface failed:", repr(exc)[:300])
# uploads
for nm, src in (("registered", reg), ("pinned", pinned)):
    for rows in (R, R // 2):
        print(
            f"copy_ {nm} {rows} rows host", host_us(lambda: dmask[:rows].copy_(src[:rows], non_blocking=True))
        )
        print(f"copy_ {nm} {rows} rows", gpu_us(lambda: dmask[:rows].copy_(src[:rows], non_blocking=True)))
ev = torch.cuda.Event()
print("event record", host_us(lambda: ev.record()))
print("event create+record", host_us(lambda: torch.cuda.Event().record()))
up = Uploader(dev)
vals = list(range(96))
print("Uploader.values 96", host_us(lambda: up.values("x", vals, torch.long), sync=False))
print("torch.tensor 96", host_us(lambda: torch.tensor(vals, dtype=torch.long), sync=False))
samp = torch.zeros(R, dtype=torch.int64, device=dev)
print(
    "to cpu nonblocking + event",
    host_us(lambda: (samp.to("cpu", non_blocking=True), torch.cuda.Event().record())),
)
# socket round trip, same process pair of threads not meaningful: measure send and recv of ready data
a, b = socket.socketpair()
payload = bytes(600)


def sr():
    a.sendall(payload)
    b.recv(65536)


print("socket send+recv 600B", host_us(sr, sync=False))
