"""Quantised checkpoints under tensor parallelism (CPU): the sharded model against the whole one.

In process, ranks 0..P-1 of a quantised checkpoint are loaded side by side and run in P threads whose
all-reduce sums through a barrier (the layers' only collective), and their logits columns are joined;
the reference is the same checkpoint loaded whole (TP=1), itself checked against its dequantised twin
by test_quant_models. What each format must give:
* fp8-block (fp8_group128 activations) and fp8-tensor (weight-only): the same quantised arithmetic as
  TP=1, every 128-column activation group on one rank, so the log-probabilities agree to float32
  summation order (the ranks' partial sums are added after the matmul instead of inside it);
* int8 and fp8-channel (dynamic per-token activations): a row-parallel rank scales its own columns per
  token (engine/models/quant_parallel.py), so the result is not TP=1's. It stays within the bounds
  test_quant_models sets against the float twin, and it equals (to summation order) a naive recompute
  of TP=1 whose o and down quantise each half of their input columns on its own;
* quantization="fp8": a row-parallel rank also quantises its weight slice per row over its own
  columns: the same two checks, the recompute quantising each half of the float weight.
The per-channel formats run on tiny-quant (TP=2 cuts q at 96 rows, inside a 128-row tile); the block
format on a shape whose shares are multiples of 128 at TP=2 and TP=4 (4: each KV head on two ranks).
Through LLM(tensor_parallel_size=2) on gloo, block-FP8 greedy output equals TP=1's (float64, as in
test_tp); a split that cuts a scale block fails at start-up naming tensor_parallel_size.
"""

from __future__ import annotations

import dataclasses
import functools
import threading

import pytest
import torch
from safetensors import safe_open

from engine import LLM, SamplingParams
from engine.models import loader, parallel
from engine.models.attention_context import AttentionMetadata, attention_context
from engine.models.loader import load_model
from engine.models.parallel import Shard
from engine.models.quant_loader import quantize_fp8_rows
from engine.models.quant_parallel import QuantColumnParallelMerged, QuantRowParallelLinear
from kernels import torch_ops
from scripts.make_model import make_model
from scripts.model_shapes import get_spec
from tests.test_tp import _Spy, child_pids

pytestmark = pytest.mark.engine

# 4 heads and 2 KV heads of 128, MLP 512: every rank's share is a multiple of 128 at TP=2 and TP=4
ALIGNED = dataclasses.replace(
    get_spec("tiny-quant"), name="tiny-quant-tp", num_heads=4, num_kv_heads=2, head_dim=128,
    intermediate_size=512, num_layers=2,
)  # fmt: skip
PROMPT_LENS = [1, 3, 7, 12, 21, 33, 50, 64]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root, made = tmp_path_factory.mktemp("tp-quant"), {}

    def get(spec, fmt: str | None):
        if (spec.name, fmt) not in made:
            made[(spec.name, fmt)] = make_model(spec, root / f"{spec.name}-{fmt}", quant=fmt)
        return made[(spec.name, fmt)]

    return get


class ThreadGroup:
    """P threads standing for P ranks: all_reduce sums every rank's tensor in rank order."""

    def __init__(self, size: int):
        self.size, self.barrier, self.parts = size, threading.Barrier(size), [None] * size
        self.local = threading.local()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.parts[self.local.rank] = x
        self.barrier.wait()
        total = functools.reduce(torch.add, self.parts)
        self.barrier.wait()  # every rank has summed before any overwrites its part
        return total

    def run(self, fn, models: list) -> list:
        results, errors = [None] * self.size, []

        def body(rank: int) -> None:
            self.local.rank = rank
            try:
                results[rank] = fn(models[rank])
            except BaseException as e:  # noqa: BLE001 - reported below, after the other ranks stop
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


@torch.no_grad()
def logits_of(model, lens: list[int] = PROMPT_LENS) -> torch.Tensor:
    """The logits after each prompt, in float64 (this rank's vocabulary columns): [prompts, V'].
    Under prompts_context(lens), which the caller sets: the attention context is one for the process,
    so the thread ranks share it rather than each setting and restoring it."""
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 2048, (n,), generator=gen).tolist() for n in lens]
    device = model.model.embed_tokens.weight.device
    ids = torch.tensor([t for p in prompts for t in p], device=device)
    positions = torch.cat([torch.arange(len(p)) for p in prompts]).to(device)
    last = torch.tensor(lens).cumsum(0).to(device) - 1
    return model.compute_logits(model(ids, positions)[last]).double().cpu()


def prompts_context(lens: list[int], device: str):
    return attention_context(AttentionMetadata.for_full_sequences(lens, device))


def sharded(
    path, size: int, monkeypatch, quantization=None, device="cpu", dtype="float32", **kw
) -> tuple[torch.Tensor, list]:
    """(log-probabilities, each rank's model) of the checkpoint split over `size` thread ranks."""
    group = ThreadGroup(size)
    monkeypatch.setattr(parallel, "all_reduce", group.all_reduce)
    models = [load_model(path, dtype, device, False, quantization, Shard(r, size))[0] for r in range(size)]
    lens = kw.get("lens", PROMPT_LENS)
    with prompts_context(lens, device):
        logits = torch.cat(group.run(functools.partial(logits_of, lens=lens), models), dim=-1)[:, :2048]
    return torch.log_softmax(logits, dim=-1), models


def whole(path, quantization=None, device="cpu", dtype="float32", **kw) -> torch.Tensor:
    model = load_model(path, dtype, device, False, quantization)[0]
    lens = kw.get("lens", PROMPT_LENS)
    with prompts_context(lens, device):
        return torch.log_softmax(logits_of(model, lens), dim=-1)


def assert_close_in_distribution(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """test_quant_models' bounds against the dequantised twin: top-1 agreement >= 90% and mean |delta
    logprob| <= 0.05 over the reference's top 20 tokens; returns that mean."""
    assert ref.exp().max(dim=-1).values.mean() > 0.05  # far from uniform: top-1 means something
    top = ref.topk(20, dim=-1).indices
    delta = (ours.gather(1, top) - ref.gather(1, top)).abs().mean().item()
    agreement = (ours.argmax(-1) == ref.argmax(-1)).double().mean().item()
    assert agreement >= 0.9 and delta <= 0.05, (agreement, delta)
    return delta


def parallel_kinds(model) -> list[type]:
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    return [type(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]


QUANT_KINDS = [QuantColumnParallelMerged, QuantRowParallelLinear] * 2


@pytest.mark.parametrize(("fmt", "tp"), [("fp8-block", 2), ("fp8-block", 4), ("fp8-tensor", 2)])
def test_same_arithmetic_as_tp1(checkpoints, monkeypatch, fmt, tp):
    path = checkpoints(ALIGNED if fmt == "fp8-block" else get_spec("tiny-quant"), fmt)
    ours, models = sharded(path, tp, monkeypatch)
    assert parallel_kinds(models[0]) == QUANT_KINDS
    torch.testing.assert_close(ours, whole(path), atol=1e-4, rtol=0)


@pytest.mark.parametrize("fmt", ["int8", "fp8-channel", "online-fp8"])
def test_per_token_formats_match_tp1(checkpoints, monkeypatch, fmt):
    online = fmt == "online-fp8"
    path = checkpoints(get_spec("tiny-quant"), None if online else fmt)
    q = "fp8" if online else None
    ours, models = sharded(path, 2, monkeypatch, q)
    assert parallel_kinds(models[1]) == QUANT_KINDS
    assert assert_close_in_distribution(ours, whole(path, q)) > 0  # rank-local scales really differ
    # exactly TP=1 whose o and down quantise each rank's columns on their own (a naive recompute)
    reference = load_model(path, "float32", "cpu", False, q)[0]
    floats = load_model(path, "float32", "cpu", False)[0] if online else None
    for i, layer in enumerate(reference.model.layers):
        for name, parent in (("o_proj", "self_attn"), ("down_proj", "mlp")):
            module = getattr(getattr(layer, parent), name)
            plain = getattr(getattr(floats.model.layers[i], parent), name).weight if online else None
            module.forward = functools.partial(columns_on_their_own, module, 2, plain)
    with prompts_context(PROMPT_LENS, "cpu"):
        ref = torch.log_softmax(logits_of(reference), dim=-1)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def columns_on_their_own(module, size: int, plain, x: torch.Tensor, act_amax=None) -> torch.Tensor:
    """A whole quantised row-parallel projection as `size` ranks compute it: each block of input columns
    quantises its activations per token alone, with its own per-row weight scales where the weights are
    quantised at load (`plain`: the float weight), and the products are summed."""
    k = module.in_features // size
    parts = []
    for r in range(size):
        cols = slice(r * k, (r + 1) * k)
        qweight, scale = (module.qweight[:, cols], module.scale)
        if plain is not None:
            qweight, scale = quantize_fp8_rows(plain[:, cols])
        x_r = x[..., cols]
        parts.append(torch_ops.quant_linear(x_r, qweight, scale, None, None, "channel", module.act_quant))
    return functools.reduce(torch.add, parts)


def test_each_rank_reads_its_scale_slices(checkpoints, monkeypatch):
    """Rank r of TP=2 on the block-FP8 checkpoint holds its rows of q, k, v, gate and up with their tile
    rows, and its input columns of o and down with their tile columns, all read as slices: only the
    norms are read whole."""
    path = checkpoints(ALIGNED, "fp8-block")
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        w = {n.removeprefix("model.layers.1."): f.get_tensor(n) for n in f.keys() if ".1." in n}
    read_whole: list[str] = []
    monkeypatch.setattr(loader, "safe_open", lambda *a, **k: _Spy(safe_open(*a, **k), read_whole))

    def tiles(s: slice) -> slice:
        return slice(s.start // 128, s.stop // 128)

    for r in range(2):
        model = load_model(path, "float32", "cpu", False, None, Shard(r, 2))[0]
        attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
        wide, kv = slice(r * 256, (r + 1) * 256), slice(r * 128, (r + 1) * 128)  # q, gate, up: 256 rows
        merged = [
            (attn.qkv_proj, [("self_attn.q_proj", wide), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv)]),
            (mlp.gate_up_proj, [("mlp.gate_proj", wide), ("mlp.up_proj", wide)]),
        ]
        for module, parts in merged:
            weight = torch.cat([w[f"{n}.weight"][rows] for n, rows in parts])
            scale = torch.cat([w[f"{n}.weight_scale_inv"][tiles(rows)] for n, rows in parts])
            assert torch.equal(module.qweight.view(torch.uint8), weight.view(torch.uint8))
            assert torch.equal(module.scale, scale.float())
        for module, name in ((attn.o_proj, "self_attn.o_proj"), (mlp.down_proj, "mlp.down_proj")):
            weight, scale = w[f"{name}.weight"][:, wide], w[f"{name}.weight_scale_inv"][:, tiles(wide)]
            assert torch.equal(module.qweight.view(torch.uint8), weight.view(torch.uint8))
            assert torch.equal(module.scale, scale.float())
    assert read_whole and all("norm" in name for name in read_whole)


def test_a_split_inside_a_scale_block_fails_at_start_up(checkpoints):
    """tiny-quant's 6 heads of 32 leave 96 q rows per rank at TP=2: inside a 128-row tile."""
    path = checkpoints(get_spec("tiny-quant"), "fp8-block")
    before = child_pids()
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 2 cuts the 128x128 scale blocks") as e:
        LLM(str(path), tensor_parallel_size=2, device="cpu", dtype="float32", num_blocks=16)
    assert "q_proj (192 rows, 96 per rank)" in str(e.value) and "one of [1]" in str(e.value)
    assert child_pids() <= before  # refused before any worker started
    load_model(path, "float32", "cpu", False, None, Shard(0, 1))  # TP=1 loads it


def test_engine_tp2_greedy_equals_tp1_block_fp8(checkpoints):
    path = checkpoints(ALIGNED, "fp8-block")
    opts = dict(device="cpu", dtype="float64", block_size=4, num_blocks=64, max_num_batched_tokens=32)
    prompts = [list(range(5, 45)), [7, 8, 9], list(range(300, 320))]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = {}
    for tp in (1, 2):
        llm = LLM(str(path), tensor_parallel_size=tp, **opts)
        try:
            outputs[tp] = [r.outputs[0].token_ids for r in llm.generate(prompts, greedy)]
        finally:
            llm.engine.runner.shutdown()
    assert outputs[2] == outputs[1] and all(len(t) == 8 for t in outputs[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", ["fp8-block", "int8", "fp8-channel", "fp8-tensor", "online-fp8"])
@pytest.mark.parametrize("lens", [PROMPT_LENS, [1]], ids=["batch", "one-row"])  # qgemm, qgemv
def test_cuda_kernels_on_shards(checkpoints, monkeypatch, fmt, lens):
    """The Triton kernels on each rank's shapes (bf16, two thread ranks on one GPU) and TP=1 on the same
    GPU, both against the same quantised model in float32 on the CPU: sharding (rank-local activation
    scales, another summation order) may add no more error than bf16 kernels make at TP=1 (twice
    their mean |delta logprob| over the exact top 20, and one more top-1 flip at most)."""
    online = fmt == "online-fp8"
    path = checkpoints(ALIGNED, None if online else fmt)
    kw = dict(quantization="fp8" if online else None, device="cuda", dtype="bfloat16", lens=lens)
    ours, models = sharded(path, 2, monkeypatch, **kw)
    assert parallel_kinds(models[0]) == QUANT_KINDS
    exact = whole(path, quantization=kw["quantization"], lens=lens)
    assert exact.exp().max(dim=-1).values.mean() > 0.05  # far from uniform: top-1 means something
    (tp1_delta, tp1_flips), (tp2_delta, tp2_flips) = (off_exact(x, exact) for x in (whole(path, **kw), ours))
    assert tp2_delta <= 2 * tp1_delta + 0.01, (tp2_delta, tp1_delta)
    assert tp2_flips <= tp1_flips + 1, (tp2_flips, tp1_flips)


def off_exact(x: torch.Tensor, exact: torch.Tensor) -> tuple[float, int]:
    """(mean |delta logprob| over exact's top 20 per row, rows whose top-1 differs from exact's)."""
    x = x.cpu().double()
    top = exact.topk(20, dim=-1).indices
    delta = (x.gather(1, top) - exact.double().gather(1, top)).abs().mean().item()
    return delta, int((x.argmax(-1) != exact.argmax(-1)).sum())
