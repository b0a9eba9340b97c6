# ruff: noqa: B023 - each lambda is timed at once, inside its loop iteration
"""GPU time of the masked argmax: mask on the device vs read in place from pinned host rows."""

import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from engine.uploader import device_view
from kernels import ops

dev = torch.device("cuda")
V = 128256
W = (V + 31) // 32
for R in (1, 64, 256):
    logits = torch.randn(R, V, device=dev, dtype=torch.bfloat16)
    host = torch.randint(-(2**31), 2**31 - 1, (R, W), dtype=torch.int32).pin_memory()
    view = device_view(host, dev)
    dmask = host.to(dev)
    res = {}
    for name, m in (("plain", None), ("device", dmask), ("in place", view)):
        ops.argmax(logits, m)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(20):
                ops.argmax(logits, m)
        g.replay()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(10):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        res[name] = 1000 * a.elapsed_time(b) / 200
    assert torch.equal(ops.argmax(logits, dmask), ops.argmax(logits, view))
    cp = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cp[0].record()
    for _ in range(50):
        dmask.copy_(host, non_blocking=True)
    cp[1].record()
    torch.cuda.synchronize()
    print(
        f"rows {R}: argmax us (gpu) "
        + ", ".join(f"{k} {v:.1f}" for k, v in res.items())
        + f"; the copy it replaces {1000 * cp[0].elapsed_time(cp[1]) / 50:.1f} us"
    )
