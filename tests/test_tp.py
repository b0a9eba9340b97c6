"""Tensor parallelism on CPU (gloo): the sharded engine against the whole one, and the workers' lifetime.

The reference is the TP=1 engine on the same options (itself checked against transformers by
test_parity and test_engine_equivalence). Both run in float64, so a different summation order across
ranks cannot flip a greedy choice between near-equal logits. The workload has prompts longer than the
step's token budget (chunked prefill), prompts sharing prefixes in two rounds (prefix-cache hits),
n = 2 (copy-on-write of a shared block) and a KV pool small enough to preempt.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.core_client import CoreClient
from engine.models import loader
from engine.models.attention_context import AttentionMetadata
from engine.models.parallel import Shard
from engine.runner import tp_wire
from engine.runner.step_inputs import StepBatch, pack, unpack
from engine.runner.tp_group import TPGroup, TPWorkerError, check_devices
from engine.runner.tp_model import TPModel
from tests.test_engine_core import Collector, wait_for

pytestmark = pytest.mark.engine
ROOT = Path(__file__).resolve().parents[1]
OPTIONS = dict(device="cpu", dtype="float64", block_size=4, max_num_batched_tokens=32, max_num_seqs=8)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BLOCKS = 24  # of 4 tokens: the workload preempts (num_preemptions > 0 in both runs)


def rounds() -> list[list[list[int]]]:
    """Two rounds of prompts; the second repeats the first's prefixes (cache hits) with new tails."""
    shared = [(7 * i + 3) % 2000 for i in range(40)]
    first = [shared + [11, 12, 13], list(range(300, 370)), shared[:20] + [5, 6], [42] * 3]
    second = [shared + [21, 22], shared[:24] + list(range(900, 930)), [42] * 3 + [43]]
    return [first, second]


def run(llm: LLM) -> list[tuple[list[list[int]], int]]:
    """(every sample's token ids, cached prompt tokens) per request, in order."""
    results = []
    for prompts in rounds():
        params = [GREEDY] * (len(prompts) - 1) + [SamplingParams(n=2, temperature=0.0, max_tokens=8)]
        for r in llm.generate(prompts, params):
            results.append(([o.token_ids for o in r.outputs], r.cached_tokens))
    return results


def start(model_dir: Path, tp: int, **kw) -> LLM:
    return LLM(str(model_dir), tensor_parallel_size=tp, **{**OPTIONS, **kw})


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    llm = start(tiny_model_dir, 1, num_blocks=BLOCKS)
    assert llm.engine.runner.tp is None and not isinstance(llm.engine.runner.model, TPModel)  # no TP path
    got = run(llm)
    assert llm.engine.get_stats()["num_preemptions"] > 0
    return got


@pytest.mark.parametrize("tp", [2, 4])  # 4 ranks > 2 KV heads: each KV head on two ranks
def test_greedy_output_matches_tp1(tiny_model_dir, reference, tp):
    llm = start(tiny_model_dir, tp, num_blocks=BLOCKS)
    runner = llm.engine.runner
    workers = [p.pid for p in runner.tp.procs.values()]
    try:
        assert isinstance(runner.model, TPModel) and len(workers) == tp - 1
        qkv = runner.model.inner.model.layers[0].self_attn.qkv_proj.weight
        assert qkv.shape[0] == (4 // tp + 2 * max(1, 2 // tp)) * 16  # rank 0 holds only its heads
        got = run(llm)
        assert llm.engine.get_stats()["num_preemptions"] > 0
    finally:
        runner.shutdown()
    assert wait_gone(workers) == []  # the workers stop with the engine
    assert got == reference
    assert any(cached > 0 for _, cached in got[4:])  # the second round hit the prefix cache
    assert max(len(p) for p in rounds()[0]) > OPTIONS["max_num_batched_tokens"]  # chunked prefill ran


def _gpu_greedy(model_dir: str, tp: int, out: str) -> None:
    """Greedy tokens of three prompts on GPUs with CUDA graphs, and the (rows, padded rows) of each
    OWN_LOGITS call, to `out` (a process of its own: a CUDA process runs one tensor-parallel engine)."""
    calls = []
    own = TPModel.compute_own_logits
    TPModel.compute_own_logits = lambda self, hidden, n: (
        calls.append((n, hidden.shape[0])) or own(self, hidden, n)
    )
    llm = LLM(
        model_dir, tensor_parallel_size=tp, device="cuda", dtype="float32", max_num_seqs=8, num_blocks=400
    )
    try:
        results = llm.generate(rounds()[0][:3], GREEDY, use_tqdm=False)
    finally:
        llm.engine.runner.shutdown()
    Path(out).write_text(json.dumps({"tokens": [r.outputs[0].token_ids for r in results], "calls": calls}))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_gpu_decode_steps_score_each_ranks_own_rows_as_tp1_scores_them(tiny_model_dir, tmp_path):
    """TP=2 on two GPUs, graphs on, float32: three sequences decode in a graph bucket of 4, so each rank
    pads its own forward rows to the LM head's 4 (OWN_LOGITS, nothing broadcast); tokens equal TP=1's."""
    ctx = torch.multiprocessing.get_context("spawn")
    got = {}
    for tp in (1, 2):
        proc = ctx.Process(target=_gpu_greedy, args=(str(tiny_model_dir), tp, str(tmp_path / f"tp{tp}.json")))
        proc.start()
        proc.join(300)
        assert proc.exitcode == 0, f"TP={tp} run failed"
        got[tp] = json.loads((tmp_path / f"tp{tp}.json").read_text())
    assert got[2]["tokens"] == got[1]["tokens"]
    assert got[1]["calls"] == [] and [3, 4] in got[2]["calls"]  # decode steps of 3 rows, padded to 4


def _prompt_logprobs(llm: LLM) -> torch.Tensor:
    sp = SamplingParams(max_tokens=0, prompt_logprobs=0, temperature=0.0)
    prompts = rounds()[0]
    outs = llm.generate(prompts, [sp] * len(prompts), use_tqdm=False)
    return torch.tensor([lp.logprob for r in outs for lp in r.prompt_logprobs if lp is not None])


def test_fp32_reduce_rounds_the_sum_over_ranks_once_like_tp1(tiny_model_dir):
    """In bf16, each rank rounding its partial sum moves TP=2's logprobs off TP=1's; with
    tensor_parallel_fp32_reduce the sum is rounded once, as TP=1's one GEMM rounds it, and TP=2 lands
    (nearly always) on TP=1's bits: its largest difference is a small fraction of the bf16 partials'."""
    bf16 = {**OPTIONS, "dtype": "bfloat16"}
    want = _prompt_logprobs(LLM(str(tiny_model_dir), **bf16))
    errors = {}
    for wide in (False, True):
        llm = LLM(str(tiny_model_dir), tensor_parallel_size=2, tensor_parallel_fp32_reduce=wide, **bf16)
        try:
            errors[wide] = (_prompt_logprobs(llm) - want).abs()
        finally:
            llm.engine.runner.shutdown()
    assert errors[False].max() > 0  # the bf16 partials do move them
    assert errors[True].max() <= 0.25 * errors[False].max(), (errors[True].max(), errors[False].max())
    assert (errors[True] == 0).float().mean() > (errors[False] == 0).float().mean()


def test_a_worker_scores_its_own_forward_rows_padded_as_rank_0_pads_them(monkeypatch):
    """OWN_LOGITS (a decode step samples every row; nothing is broadcast): the worker scores the first
    n rows of its last forward, the last repeated up to m, exactly the rows rank 0's LM head takes
    (ModelRunner._logits pads with the last row on a GPU). The greedy tests cover m = n on CPU."""
    from engine.runner import tp_worker

    scored, gathered = [], []
    worker = tp_worker.Worker.__new__(tp_worker.Worker)
    worker.shard = Shard(1, 2)
    worker.model = type("Head", (), {"compute_logits": lambda self, h: scored.append(h.clone()) or h})()
    worker.hidden = torch.arange(5 * 3, dtype=torch.float32).view(5, 3)  # 5 rows: a bucket of 5 > n
    monkeypatch.setattr(tp_worker, "gather_logits", lambda local, size, vocab: gathered.append(size))
    worker.own_logits([tp_wire.OWN_LOGITS, 3, 8])
    rows = worker.hidden[:3]
    assert torch.equal(scored[0], torch.cat([rows, rows[2:3].expand(5, -1)])) and gathered == [2]
    worker.own_logits([tp_wire.OWN_LOGITS, 4, 4])
    assert torch.equal(scored[1], worker.hidden[:4])


def test_a_forward_header_rebuilds_the_step_rank_0_runs():
    """A mixed step padded as a graph bucket pads it: the header and two broadcast spans give the
    workers the same ids, positions and attention metadata (cache-free metadata: separate spans)."""
    b = StepBatch([5, 6, 7, 8], [0, 1, 2, 9], [4, 5, 6, 13], [3, 1], [3, 10], [[1], [2, 3, 4]])
    i64, i32 = pack(b, 4, 16, pad_q=0, rows=16)
    ids, pos, meta = unpack(i64, i32, b, 4, 16, 4, pad_q=0, rows=16, mixed=True)
    header, spans = tp_wire.encode_forward(ids, pos, meta)
    assert [s.dtype for s in spans] == [torch.int64, torch.int32]  # the two packed buffers
    assert tp_wire.span_shapes(header) == [(s.dtype, s.numel()) for s in spans]
    ids2, pos2, meta2 = tp_wire.decode_forward(header, [s.clone() for s in spans])
    assert torch.equal(ids2, ids) and torch.equal(pos2, pos)
    for name in ("cu_seqlens_q", "seq_lens", "slot_mapping", "block_tables"):
        assert torch.equal(getattr(meta2, name), getattr(meta, name)), name
    same = ("query_lens_cpu", "seq_lens_cpu", "max_seqlen_q", "max_seqlen_k", "block_size", "mixed")
    assert all(getattr(meta2, k) == getattr(meta, k) for k in same)
    free = AttentionMetadata.for_full_sequences([3, 2])
    header, spans = tp_wire.encode_forward(torch.arange(5), torch.arange(5), free)
    ids2, _, meta2 = tp_wire.decode_forward(header, spans)
    assert len(spans) == 4 and meta2.block_tables is None and meta2.slot_mapping is None
    assert torch.equal(ids2, torch.arange(5)) and meta2.query_lens_cpu == [3, 2]


def test_each_rank_reads_only_its_slices(tiny_model_dir, monkeypatch):
    """TP=4 on 2 KV heads, in-process (loading needs no group): every parameter of rank r is its part of
    the checkpoint tensor, KV heads replicated on ranks r and r ^ 1; only the norms are read whole."""
    full = {}
    with safe_open(str(tiny_model_dir / "model.safetensors"), "pt") as f:
        full = {name: f.get_tensor(name) for name in f.keys()}
    whole: list[str] = []
    monkeypatch.setattr(loader, "safe_open", lambda *a, **k: _Spy(safe_open(*a, **k), whole))
    for r in range(4):
        model, _ = loader.load_model(tiny_model_dir, torch.float32, "cpu", False, None, Shard(r, 4))
        attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
        w = {k.removeprefix("model.layers.1."): v for k, v in full.items() if ".1." in k}
        kv = slice((r // 2) * 16, (r // 2 + 1) * 16)  # the KV head of query head r
        q_k_v = torch.cat([w["self_attn.q_proj.weight"][r * 16 : (r + 1) * 16],
                           w["self_attn.k_proj.weight"][kv], w["self_attn.v_proj.weight"][kv]])  # fmt: skip
        assert torch.equal(attn.qkv_proj.weight, q_k_v)
        assert torch.equal(attn.o_proj.weight, w["self_attn.o_proj.weight"][:, r * 16 : (r + 1) * 16])
        cols = slice(r * 32, (r + 1) * 32)
        gate_up = torch.cat([w["mlp.gate_proj.weight"][cols], w["mlp.up_proj.weight"][cols]])
        assert torch.equal(mlp.gate_up_proj.weight, gate_up)
        assert torch.equal(mlp.down_proj.weight, w["mlp.down_proj.weight"][:, cols])
        rows = slice(r * 512, (r + 1) * 512)
        assert torch.equal(model.model.embed_tokens.weight, full["model.embed_tokens.weight"][rows])
        assert torch.equal(model.lm_head.weight, full["lm_head.weight"][rows])
    assert whole and all("norm" in name for name in whole)
    assert Shard(1, 2).vocab_rows(2049) == (1025, 1025, 1024)  # the last rank's padding row stays zero


class _Spy:
    """A safetensors reader that records the tensors read whole."""

    def __init__(self, reader, whole: list[str]):
        self.reader, self.whole = reader, whole

    def __enter__(self):
        self.inner = self.reader.__enter__()
        return self

    def __exit__(self, *exc):
        return self.reader.__exit__(*exc)

    def get_tensor(self, name: str):
        self.whole.append(name)
        return self.inner.get_tensor(name)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def wait_gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


@pytest.mark.parametrize("when", ["idle", "mid-step"])
def test_a_killed_worker_fails_the_engine_and_leaves_no_process(tiny_model_dir, when):
    llm = start(tiny_model_dir, 2)
    procs = list(llm.engine.runner.tp.procs.values())
    prompt = list(range(10, 50))
    try:
        assert llm.generate([prompt], GREEDY)[0].outputs[0].token_ids  # it works first
        if when == "idle":
            os.kill(procs[0].pid, signal.SIGKILL)
        else:  # while the ranks are in their collectives
            threading.Timer(0.5, os.kill, (procs[0].pid, signal.SIGKILL)).start()
        began = time.monotonic()
        with pytest.raises(TPWorkerError, match="rank 1"):
            llm.generate([prompt] * 4, SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True))
        assert time.monotonic() - began < 30
        with pytest.raises(TPWorkerError):  # and it stays failed
            llm.generate([prompt], GREEDY)
    finally:
        llm.engine.runner.shutdown()
    assert wait_gone([p.pid for p in procs]) == []


def test_a_dead_worker_fails_the_engine_core_and_its_requests(tiny_model_dir):
    """In the engine core process (rank 0 there), a killed worker ends the core, which fails its open
    requests naming the worker: the replica then sees a dead core (check_health) and is replaced."""
    sink = Collector()
    config = EngineConfig.from_kwargs(str(tiny_model_dir), tensor_parallel_size=2, device="cpu")
    core = CoreClient(config, sink)
    try:
        workers = sorted(child_pids(core.proc.pid))
        assert len(workers) == 1
        rid = core.submit([9] * 8, SamplingParams(temperature=0.0, max_tokens=3000, ignore_eos=True))
        wait_for(lambda: sink.tokens.get(f"{rid}/0"), what="tokens")
        os.kill(workers[0], signal.SIGKILL)
        sink.wait(rid, 30)
        ((_, reason, error),) = sink.finish[rid]
        assert reason == "error" and "TPWorkerError: tensor-parallel worker rank 1" in error
        wait_for(lambda: not core.is_alive(), what="the core to exit")
    finally:
        core.shutdown()
    assert wait_gone(workers) == []


def test_workers_die_with_rank_0s_process(tiny_model_dir):
    """kill -9 of rank 0 (no finalizer runs there): its workers' death signal and pipe EOF end them."""
    script = (
        "import sys, time; from engine import LLM; "
        "llm = LLM(sys.argv[1], tensor_parallel_size=2, device='cpu'); "
        "print(*[p.pid for p in llm.engine.runner.tp.procs.values()], flush=True); time.sleep(600)"
    )
    rank0 = subprocess.Popen([sys.executable, "-c", script, str(tiny_model_dir)], stdout=subprocess.PIPE,
                             cwd=ROOT, text=True)  # fmt: skip
    try:
        pids = [int(p) for p in rank0.stdout.readline().split()]
        assert pids and all(alive(p) for p in pids)
    finally:
        rank0.kill()  # SIGKILL: no finalizer runs in rank 0
        rank0.wait()
    assert wait_gone(pids) == []


@pytest.mark.parametrize("value", [0, -1, True, "2", 1.5])
def test_a_bad_tensor_parallel_size_is_refused_by_the_config(value):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig.from_kwargs("models/x", tensor_parallel_size=value)
    with pytest.raises(ValueError, match="tensor_parallel_fp32_reduce: got 'yes'; use true or false"):
        EngineConfig.from_kwargs("models/x", tensor_parallel_fp32_reduce="yes")


def child_pids(parent: int | None = None) -> set[int]:
    me = str(parent or os.getpid())
    return {int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _ppid(p) == me}


def _ppid(proc: Path) -> str | None:
    try:
        return proc.joinpath("stat").read_text().rsplit(")", 1)[1].split()[1]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def test_a_size_that_does_not_split_the_model_fails_before_any_worker_starts(tiny_model_dir):
    before = child_pids()
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size: 3 does not divide the 4 attention heads.*\[1, 2, 4\]"
    ):
        start(tiny_model_dir, 3)
    assert child_pids() <= before


def test_more_ranks_than_visible_gpus_is_an_error_naming_the_fix():
    with pytest.raises(
        ValueError, match="tensor_parallel_size: 4 ranks from cuda:0 need 4 visible GPUs, but 2"
    ):
        check_devices(torch.device("cuda"), 4, 2)
    with pytest.raises(ValueError, match="cuda:1 need 3"):
        check_devices(torch.device("cuda:1"), 2, 2)
    check_devices(torch.device("cuda"), 2, 2)
    check_devices(torch.device("cpu"), 8, 0)  # CPU ranks need no GPU


def test_speculation_structured_output_sampling_and_an_fp8_kv_cache_match_tp1(tiny_model_dir):
    """The engine's other paths at TP=2 on the options that take them: n-gram speculation (proposals
    from rank 0's host state, verified on every rank), a regex grammar, seeded sampling, and K/V
    stored in fp8; each request as at TP=1."""
    from engine.sampling_params import StructuredOutput

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    every = list(range(8, 2048))  # every token the model may draw appears before: a proposal each step
    prompts = [every, list(range(300, 340)), [42] * 9]
    params = [
        GREEDY,
        SamplingParams(
            temperature=0.0, max_tokens=10, structured=StructuredOutput("regex", "[0-9]{3}-[0-9]{2}")
        ),
        SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=8),
    ]
    out = {}
    for tp in (1, 2):
        llm = start(tiny_model_dir, tp, speculative_config=spec, kv_cache_dtype="fp8", grammar_process=False)
        try:
            out[tp] = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
            stats = llm.engine.get_stats()
        finally:
            llm.engine.runner.shutdown()
        assert stats["spec_draft_tokens"] > 0  # speculation ran at both sizes
    assert out[2] == out[1]


@pytest.mark.parametrize("drafts", ["head", "oracle"])
def test_gated_lora_mtp_matches_tp1(tiny_model_dir, tmp_path, drafts):
    """Self-speculation with a gated LoRA at TP=2 (eager MTP steps: each rank runs the mask rows under
    its share of the gate, with their visibility and input vectors from rank 0; the drafts' embeddings
    and logits reach every rank). The mixed batch of test_spec_mtp, preempting: plain TP=1 decoding's
    tokens, and with the random head the very drafts the head makes at TP=1 (float64: the order of the
    ranks' sums cannot flip an argmax); with mostly right oracle drafts, acceptances and rejections
    mid-chunk, whose KV every rank keeps or drops alike."""
    from scripts.make_mtp import write_mtp_dir
    from tests.test_spec_engine import SCENARIOS, generate, make_llm, mixed_batch
    from tests.test_spec_mtp import K, mtp, recording_drafts, with_drafts

    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    prompts, params = mixed_batch(vocab)
    options = SCENARIOS["preempt"]
    plain = generate(make_llm(tiny_model_dir, **options), prompts, params)
    spec = mtp(write_mtp_dir(tmp_path / "head", tiny_model_dir, num_mask_tokens=4, rank=8),
               disable_below_acceptance=0.0)  # fmt: skip
    full = {tuple(p): p + out[0] for p, out in zip(prompts, plain)}

    def future(seq, kept, bonus):  # the plain run's continuation, every fifth position wrong
        at = seq.num_computed + kept + 2  # the index the first draft takes
        ids = (full[tuple(seq.request.prompt_ids)][at : at + K] + [0] * K)[:K]
        return [(t + 1) % vocab if (at + i) % 5 == 0 else t for i, t in enumerate(ids)]

    runs = {}
    for tp in (1, 2) if drafts == "head" else (2,):
        llm = make_llm(tiny_model_dir, spec, tensor_parallel_size=tp, **options)
        assert (llm.engine.runner.tp is not None) == (tp == 2) and llm.engine.runner.mtp is not None
        record = recording_drafts(llm)
        if drafts == "oracle":
            with_drafts(llm, future)
        try:
            runs[tp] = generate(llm, prompts, params), record, llm.engine.get_stats()
        finally:
            llm.engine.runner.shutdown()
        assert runs[tp][0] == plain
        assert runs[tp][2]["spec_verify_rows"] > 0 and runs[tp][2]["num_preemptions"] > 0
    if drafts == "head":
        assert runs[2][1] == runs[1][1] and len(runs[2][1]) > 10
    else:
        stats = runs[2][2]
        assert 0.3 * stats["spec_draft_tokens"] < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]


def test_min_serve_tp_pin_sets_how_many_whole_cores_each_worker_takes(monkeypatch):
    """MINSERVE_TP_PIN=N: rank r's N whole cores sit N * slot(r) cores from the end of the CPU set, so
    workers never share one; 0 leaves them unpinned. 16 CPUs as 8 cores of two hyperthreads (i, i + 8)."""
    from engine.device import cpus
    from engine.runner import tp_group

    monkeypatch.setattr(cpus, "ALLOWED", frozenset(range(16)))
    topology = "/sys/devices/system/cpu/cpu{}/topology/thread_siblings_list"
    siblings = {topology.format(c): f"{c % 8},{c % 8 + 8}" for c in range(16)}
    monkeypatch.setattr(cpus.Path, "read_text", lambda self: siblings[str(self)])
    group = TPGroup.__new__(TPGroup)
    group.device = torch.device("cpu")  # slot(r) = r - 1
    assert [group._worker_cpus(r) for r in (1, 2, 3)] == [[7, 15], [6, 14], [5, 13]]  # the default, 1
    monkeypatch.setattr(tp_group, "PIN_CORES", 2)
    assert [group._worker_cpus(r) for r in (1, 2)] == [[6, 7, 14, 15], [4, 5, 12, 13]]
    assert group._worker_cpus(3) is None  # 6 cores would leave rank 0's loop less than half of them
    monkeypatch.setattr(tp_group, "PIN_CORES", 0)
    assert group._worker_cpus(1) is None
    monkeypatch.setenv("MINSERVE_TP_PIN", "yes")
    with pytest.raises(ValueError, match="MINSERVE_TP_PIN='yes': give whole cores per worker"):
        tp_group._pin_cores()


def test_each_worker_takes_the_core_of_its_gpu_across_replicas(monkeypatch):
    """Workers are pinned one core each from the end of the CPU set, by their GPU's node-wide index:
    two TP=2 replicas on one node (GPUs 0,1 and 2,3, each seeing its own as cuda:0 and cuda:1) never
    pin their workers to the same core. On CPU (gloo), by rank."""
    group = TPGroup.__new__(TPGroup)
    group.device = torch.device("cuda", 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    first = group._core_slot(1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert (first, group._core_slot(1)) == (1, 3)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert group._core_slot(3) == 3
    group.device = torch.device("cpu")
    assert [group._core_slot(r) for r in (1, 2, 3)] == [0, 1, 2]
