"""Device ceilings measured in the run, and the bytes / FLOPs a workload must move, from a checkpoint.

    python -m benchmarks.roofline [--smoke]     # print the measured copy bandwidth and matmul TFLOP/s

Ceilings (measured once per run, medians after warm-up):
  copy bandwidth  a large device-to-device copy; bytes counted = read + written (2 x size) / time.
  matmul          one large square matmul in the benchmark dtype; 2 n^3 FLOPs / time.

Bytes a decode step must move (the memory roofline): every weight the step multiplies with, once per
step whatever the batch (the input embedding is a row gather, so it only counts when the lm_head is
tied to it), plus, for every sequence in the batch, its whole KV cache (every layer's K and V of
every earlier token). FLOPs per token: 2 per weight element it multiplies with, plus attention's
4 * heads * head_dim per layer and context token (QK^T and PV, one multiply-add = 2 FLOPs).
A roofline time is max(bytes / bandwidth, FLOPs / matmul rate): a lower bound, never a prediction.
"""

from __future__ import annotations

import argparse
import json
import statistics
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

EMBED = "model.embed_tokens.weight"
DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8}
# quantised weights: read as stored, whatever dtype the model is served in
STORED_BYTES = {"F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1}


@dataclass(frozen=True)
class ModelCost:
    """What one token costs a model, read from its checkpoint (config.json + safetensors headers)."""

    weight_bytes_total: int  # every tensor in the checkpoint
    step_weight_bytes: int  # weights a decode step reads (all but an untied input embedding)
    matmul_params: int  # elements multiplied per token (= step weights; norms are negligible)
    kv_bytes_per_token: int  # one context token's K and V over all layers, in the KV cache's dtype
    attn_flops_per_ctx_token: int  # per query token and per context token, over all layers
    num_layers: int


def _safetensors_sizes(path: Path) -> dict[str, tuple[int, str]]:
    """Tensor name -> (byte size, dtype), from the 8-byte length + JSON header of each safetensors file."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files; write a checkpoint with scripts.make_model")
    sizes: dict[str, tuple[int, str]] = {}
    for f in files:
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name != "__metadata__":
                begin, end = info["data_offsets"]
                sizes[name] = (end - begin, info["dtype"])
    return sizes


def model_cost(path: str | Path, dtype_bytes: int = 2, kv_dtype_bytes: int | None = None) -> ModelCost:
    """Costs for `path` served in a dtype of `dtype_bytes` (weights are rescaled from the file's dtype),
    with a KV cache of `kv_dtype_bytes` per value (default: the serving dtype's; 1 for an fp8 cache)."""
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    # float tensors by element count, so that a checkpoint stored in fp32 is costed in the dtype it is
    # served in; quantised ones (FP8, INT8) by their stored bytes
    sizes = _safetensors_sizes(path)
    numel, nbytes = {}, {}
    for name, (size, dt) in sizes.items():
        stored = STORED_BYTES.get(dt)
        numel[name] = size // (stored or DTYPE_BYTES[dt])
        nbytes[name] = size if stored else numel[name] * dtype_bytes
    tied = "lm_head.weight" not in numel  # a tied lm_head is the embedding: read in full every step
    skip = () if tied else (EMBED,)
    layers = cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv = layers * 2 * cfg["num_key_value_heads"] * head_dim * (kv_dtype_bytes or dtype_bytes)
    return ModelCost(
        weight_bytes_total=sum(nbytes.values()),
        step_weight_bytes=sum(b for n, b in nbytes.items() if n not in skip),
        matmul_params=sum(c for n, c in numel.items() if n not in skip),
        kv_bytes_per_token=kv,
        attn_flops_per_ctx_token=4 * cfg["num_attention_heads"] * head_dim * layers,
        num_layers=layers,
    )


def decode_roofline(cost: ModelCost, batch: int, mean_ctx: float, device: dict) -> dict:
    """Roofline of one decode step of `batch` sequences with `mean_ctx` tokens of context each."""
    step_bytes = cost.step_weight_bytes + batch * mean_ctx * cost.kv_bytes_per_token
    step_flops = batch * (2 * cost.matmul_params + cost.attn_flops_per_ctx_token * mean_ctx)
    t_mem = step_bytes / (device["copy_bw_GBps"] * 1e9)
    t_flop = step_flops / (device["matmul_TFLOPs"] * 1e12)
    t = max(t_mem, t_flop)
    return {
        "bytes_per_step": step_bytes,
        "flops_per_step": step_flops,
        "t_mem_s": t_mem,
        "t_flop_s": t_flop,
        "bound": "memory" if t_mem >= t_flop else "compute",
        "tok_s": batch / t,
    }


def offline_roofline(cost: ModelCost, prompt_lens: list[int], output_lens: list[int], device: dict) -> dict:
    """Lower bound on the wall time of a whole offline batch, every request admitted at once.

    Decode steps: at least max(output) of them, each reading the step weights once; every generated
    token reads its sequence's KV (prompt + tokens so far). Prefill: 2 FLOPs per weight per prompt token
    plus causal attention (about p^2 / 2 context tokens per prompt of p)."""
    steps = max(output_lens)
    kv_reads = sum(o * p + o * (o - 1) / 2 for p, o in zip(prompt_lens, output_lens))
    total_bytes = steps * cost.step_weight_bytes + kv_reads * cost.kv_bytes_per_token
    tokens = sum(prompt_lens) + sum(output_lens)
    attn = kv_reads + sum(p * p / 2 for p in prompt_lens)
    total_flops = 2 * cost.matmul_params * tokens + cost.attn_flops_per_ctx_token * attn
    t_mem = total_bytes / (device["copy_bw_GBps"] * 1e9)
    t_flop = total_flops / (device["matmul_TFLOPs"] * 1e12)
    t = max(t_mem, t_flop)
    return {
        "bytes": total_bytes,
        "flops": total_flops,
        "t_mem_s": t_mem,
        "t_flop_s": t_flop,
        "bound": "memory" if t_mem >= t_flop else "compute",
        "tok_s": sum(output_lens) / t,
    }


def _median_time(fn, reps: int, device) -> float:
    """Median seconds of fn() over reps calls, after two warm-up calls (CUDA events on a GPU)."""
    import time

    import torch

    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _copy_time(nbytes: int, reps: int, device) -> float:
    """Median seconds to copy nbytes device to device (both buffers freed on return)."""
    import torch

    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    return _median_time(lambda: dst.copy_(src), reps, device)


def measure_device(smoke: bool = False, reps: int = 10) -> dict:
    """Copy bandwidth (read + write bytes) and matmul TFLOP/s of the current device."""
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    nbytes = (64 if smoke else 2048) * 2**20
    t_copy = _copy_time(nbytes, reps, device)
    n = 512 if smoke else 8192
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    t_mm = _median_time(lambda: a @ b, reps, device)
    return {
        "device": device.type,
        "copy_bytes": nbytes,
        "copy_bw_GBps": 2 * nbytes / t_copy / 1e9,
        "matmul_n": n,
        "matmul_dtype": str(dtype).removeprefix("torch."),
        "matmul_TFLOPs": 2 * n**3 / t_mm / 1e12,
        "reps": reps,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Measure the device's copy bandwidth and matmul rate.")
    parser.add_argument("--smoke", action="store_true", help="small sizes (CPU check)")
    parser.add_argument("--model", help="also print the per-token costs of this checkpoint directory")
    args = parser.parse_args(argv)
    print(json.dumps(measure_device(args.smoke), indent=2))
    if args.model:
        print(json.dumps(asdict(model_cost(args.model)), indent=2))


if __name__ == "__main__":
    main()
