"""Time, SM clock, board power and energy of the pieces of figure (b)'s decode step (GPU host).

    python -m benchmarks.energy_probe --out benchmarks/reports/gpu/energy_h200

Why: (b) (Llama-3.1-8B shape, batch 64, ~1k-token contexts) streams HBM at full speed while the tensor
cores do 64 multiply-adds per weight, and an H200 meets its 700 W board limit there. Each piece of the
step (a layer's decode attention over the paged cache and its four 64-row GEMMs through cuBLASLt, as the
engine runs them; lm_head once per step) is looped alone in a CUDA graph on distinct operands (nothing
stays in L2) while `benchmarks.gpu_power` samples the board. Energy per call is power x time; it
includes the board's static power, so it is the energy the limit is charged with.

Summed over the layers, the parts predict the step two ways: from their times (the step if every piece
runs as it does alone) and from their energy over the power limit (the shortest step the limit allows at
that energy). A plain read of 1 GiB gives the same for the step's bytes with no math. The norms, RoPE
and activation kernels (~5% of the step) are left out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import environment, git_commit, write_report  # noqa: E402
from benchmarks.gpu_power import PowerSampler, summarize  # noqa: E402
from scripts.model_shapes import get_spec  # noqa: E402

SPEC = get_spec("llama-3.1-8b")
HIDDEN, VOCAB, LAYERS, HEAD_DIM = SPEC.hidden_size, SPEC.vocab_size, SPEC.num_layers, SPEC.head_dim
GEMMS = SPEC.fused_projections()  # name: (N, K)
COPIES = 4  # distinct operands per graph: > 1 GB of weights or KV, so no launch finds its bytes in L2
SECONDS = 2.0  # replay time per piece: ~20 power samples


@dataclass
class Part:
    name: str
    us: float  # per call, median
    nbytes: int  # bytes the call must read
    power: dict | None  # benchmarks.gpu_power.summarize over the timed replays

    @property
    def watts(self) -> float:
        return self.power["watts_p50"] if self.power else float("nan")

    @property
    def mj(self) -> float:
        return self.watts * self.us * 1e-3

    def row(self) -> dict:
        p = self.power or {}

        def rounded(key: str) -> int | None:
            return None if p.get(key) is None else round(p[key])

        return {"part": self.name, "us": round(self.us, 1), "GB/s": round(self.nbytes / self.us / 1e3),
                "sm_mhz_p50": rounded("sm_mhz_p50"), "watts_p50": rounded("watts_p50"),
                "capped_pct": rounded("power_capped_pct"), "mJ": round(self.mj, 2),
                "pJ/byte": round(self.mj * 1e9 / self.nbytes, 1)}  # fmt: skip


def _step(us: float, mj: float, limit_watts: float) -> dict:
    return {"step_us_from_times": us, "step_mJ": mj, "step_us_at_limit": mj / limit_watts * 1e3}


def predict(per_layer: list[Part], once: list[Part], layers: int, limit_watts: float) -> dict:
    """Step time from the parts' own times, and the shortest step `limit_watts` allows for their energy."""
    us = layers * sum(p.us for p in per_layer) + sum(p.us for p in once)
    mj = layers * sum(p.mj for p in per_layer) + sum(p.mj for p in once)
    return _step(us, mj, limit_watts)


def predict_read(nbytes: int, read: Part, limit_watts: float) -> dict:
    """The same `nbytes` moved at the plain read's speed and energy per byte: the step with no math."""
    scale = nbytes / read.nbytes
    return _step(scale * read.us, scale * read.mj, limit_watts)


def _graph(launch, n: int):
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up compiles and picks the cuBLASLt algorithm outside capture
        for i in range(n):
            launch(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n):
            launch(i)
    return graph


def measure(name: str, launch, n: int, nbytes: int) -> Part:
    """`launch(i)` for i < n captured in one graph, replayed for SECONDS with the board sampled."""
    import torch

    graph = _graph(launch, n)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    with PowerSampler() as sampler:
        time.sleep(0.25)  # nvidia-smi's first sample
        t0 = time.time()
        while time.time() < t0 + SECONDS:
            start.record()
            for _ in range(10):
                graph.replay()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) * 1e3 / (10 * n))
        t1 = time.time()
    part = Part(name, statistics.median(times), nbytes, summarize(sampler.samples, [(t0 + 0.3, t1)]))
    print(f"{name:<34} {part.us:8.1f} us {part.watts:5.0f} W {part.mj:7.2f} mJ", flush=True)
    return part


def _attention(batch: int, ctx: int) -> Part:
    """Decode attention over COPIES paged caches of `batch` sequences of `ctx` tokens."""
    import torch

    from benchmarks.kernel_bench import _decode_case
    from kernels.triton_decode_attention import decode_attention

    cases = [_decode_case(batch, ctx) for _ in range(COPIES)]
    q, _, _, meta, kv_bytes = cases[0]
    out = torch.empty_like(q)

    def attend(i):
        decode_attention(
            q, cases[i][1], cases[i][2], meta.block_tables, meta.seq_lens, HEAD_DIM**-0.5, out=out
        )

    return measure("decode attention", attend, COPIES, kv_bytes)


def _gemms(name: str, shapes: dict[str, tuple[int, int]], batch: int, copies: int) -> Part:
    """The GEMMs of `shapes` (name: (N, K); x [batch, K] @ W[N, K]^T), in a row, on `copies` distinct
    sets of weights."""
    import torch
    import torch.nn.functional as F

    dev, bf16 = torch.device("cuda"), torch.bfloat16
    ws = [
        [torch.randn(n, k, dtype=bf16, device=dev) * 0.02 for n, k in shapes.values()] for _ in range(copies)
    ]
    xs = [torch.randn(batch, k, dtype=bf16, device=dev) for _, k in shapes.values()]

    def gemm(i):
        for x, w in zip(xs, ws[i]):
            F.linear(x, w)

    return measure(name, gemm, copies, sum(w.numel() * w.element_size() for w in ws[0]))


def _plain_read() -> Part:
    """Row sums of two 1 GiB bf16 tensors in 4,096-wide rows: HBM read at full speed, no math to speak of."""
    import torch

    rows = (1 << 30) // (2 * HIDDEN)
    tensors = [torch.randn(rows, HIDDEN, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    sums = torch.empty(rows, dtype=torch.float32, device="cuda")

    def read(i):
        torch.sum(tensors[i], dim=1, dtype=torch.float32, out=sums)

    return measure("plain read (reference)", read, 2, 1 << 30)


def probe(batch: int, ctx: int) -> dict[str, list[Part]]:
    """The step's parts ("layer": once per layer, "step": once per step) and the plain-read reference."""
    import torch

    torch.backends.cuda.preferred_blas_library("cublaslt")  # as the engine (LoadConfig.blas_library)
    attention = _attention(batch, ctx)
    gemms = _gemms("qkv, o, gate_up, down GEMMs", GEMMS, batch, COPIES)
    lm_head = _gemms("lm_head GEMM", {"lm_head": (VOCAB, HIDDEN)}, batch, 2)
    return {"layer": [attention, gemms], "step": [lm_head], "reference": [_plain_read()]}


def markdown(report: dict) -> str:
    rows = report["parts"]
    lines = [f"# Energy of (b)'s step pieces ({report['env']['hardware'].get('gpu')})", "",
             f"`{report['command']}` at commit {report['commit']}; batch {report['batch']}, "
             f"context {report['ctx']}; {report['env']['hardware'].get('nvidia_smi')}", "",
             "| part | us/call | GB/s | SM MHz p50 | W p50 | power-capped % | mJ/call | pJ/byte |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    cells = "| {part} | {us} | {GB/s} | {sm_mhz_p50} | {watts_p50} | {capped_pct} | {mJ} | {pJ/byte} |"
    lines += [cells.format(**r) for r in rows]
    labels = {"kernels": f"The step's kernels ({report['layers']} layers + lm_head)",
              "reads": f"Its {report['step_bytes'] / 1e9:.2f} GB as a plain read"}  # fmt: skip
    for key, label in labels.items():
        p = report["predictions"][key]
        lines.append(f"\n{label}: {p['step_us_from_times']:,.0f} us at the measured speed, "
                     f"{p['step_mJ']:,.0f} mJ, so >= {p['step_us_at_limit']:,.0f} us at the "
                     f"{report['limit_watts']:.0f} W limit.")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="path stem: writes STEM.json and STEM.md")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--ctx", type=int, default=1064, help="tokens per sequence ((b): 1,000 + mid-decode)")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("energy_probe needs a CUDA GPU")
        return 2
    parts = probe(args.batch, args.ctx)
    every = [p for group in parts.values() for p in group]
    limit = max((p.power or {}).get("limit_watts", 0) for p in every) or float("nan")
    step_bytes = LAYERS * sum(p.nbytes for p in parts["layer"]) + sum(p.nbytes for p in parts["step"])
    predictions = {
        "kernels": predict(parts["layer"], parts["step"], LAYERS, limit),
        "reads": predict_read(step_bytes, parts["reference"][0], limit),
    }
    report = {"command": "python -m benchmarks.energy_probe " + " ".join(sys.argv[1:]),
              "commit": git_commit(ROOT), "env": environment(), "batch": args.batch, "ctx": args.ctx,
              "layers": LAYERS, "limit_watts": limit, "step_bytes": step_bytes,
              "parts": [p.row() for p in every], "predictions": predictions}  # fmt: skip
    write_report(args.out, report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
