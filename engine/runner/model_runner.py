"""The model runner: the only place where scheduled sequences become tensors.

Per step: perform copy-on-write block copies, pack every scheduled chunk's tokens into one flat batch
(no padding), describe it with AttentionMetadata, run the model, compute logits only at positions that
sample, and sample every sampling sequence (n > 1 siblings share one logits row; engine/runner/
plain_draw.py). Prompt chunks of requests with prompt_logprobs also get logits at every position
(Sampler.score_prompt); a step without such a chunk does no extra work. An engine that speculates
hands each step's proposals and their verification to a SpecStep (engine/runner/spec_step.py); the
plain path does not look for them.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import astuple, replace

import torch

from engine.config import EngineConfig
from engine.device.placement import configure_process, resolve_device_dtype
from engine.device.uploader import Uploader
from engine.lora.manager import LoRAManager
from engine.models.attention_context import AttentionMetadata, attention_context
from engine.models.layers import Attention
from engine.models.loader import load_model
from engine.models.parallel import local_config
from engine.runner import mtp_setup, tp_wire
from engine.runner.cuda_graph import DecodeGraphs, MixedGraphs, forward_batch, lm_head_rows, pad_rows
from engine.runner.draft_runner import DraftRunner
from engine.runner.draw_graphs import DrawGraphs
from engine.runner.graph_sets import capture_sets, max_graph_batch
from engine.runner.kv_cache import KVCacheSpec, allocate_kv_cache, kv_cache_dtype, plan_kv_cache
from engine.runner.kv_offload import KVOffload
from engine.runner.mtp_step import MtpStep
from engine.runner.plain_draw import PlainDraw
from engine.runner.spec_step import SpecStep
from engine.runner.step_inputs import StepBatch, build_batch, prompt_logprob_rows
from engine.runner.table_mirror import TableMirror
from engine.runner.tp_group import TPGroup
from engine.runner.tp_model import TPModel, capture_on_all_ranks
from engine.sampling.sampler import PendingSample, Sampler
from engine.sched.output import SchedulerOutput
from engine.spec.sampler import PendingSpec, SpecSampler
from engine.structured.remote import ProcessBitmaskFiller
from engine.structured.state import BitmaskFiller

log = logging.getLogger(__name__)


def _graph_summary(
    graphs: dict[int, DecodeGraphs], mixed: MixedGraphs | None, drafting=None, draw=None
) -> str:
    """Which buckets were captured, for the start-up log."""
    parts = [f"query length {q}: batch {g.buckets[0]}-{g.buckets[-1]}" for q, g in graphs.items()]
    if mixed is not None:
        tokens, seqs = zip(*mixed.buckets)
        parts.append(f"mixed: {min(tokens)}-{max(tokens)} tokens, {min(seqs)}-{max(seqs)} sequences")
    if drafting is not None:
        parts.append(f"MTP drafting: batch {drafting.buckets[0]}-{drafting.buckets[-1]}")
    if draw is not None:
        parts.append(f"draw: {draw.buckets[0]}-{draw.buckets[-1]} rows")
    return "; ".join(parts)


class DeferredSample:
    """The draw of a step launched ahead whose rows read host state (grammar matchers, penalties' token
    history; SchedulerOutput.draw_late): forward and logits are enqueued. Once the engine has appended
    the previous step's tokens, `start()` begins the constrained rows' mask fill on a worker thread,
    and `finish()` joins it and enqueues the sampling; between the two the engine does its other host
    work. `finish()` alone does both."""

    deferred = True  # see engine/runner/in_flight.Draw

    def __init__(self, start: Callable[[], Callable[[], PendingSample]]):
        self._start = start
        self._finish: Callable[[], PendingSample] | None = None

    def start(self) -> None:
        if self._finish is None:
            self._finish = self._start()

    def finish(self) -> PendingSample:
        self.start()
        return self._finish()


class _OfDraw:
    """A ModelRunner attribute that is its PlainDraw's, read and set there (tests swap the sampler,
    benchmarks the filler)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, runner: ModelRunner | None, owner: type | None = None) -> object:
        return self if runner is None else getattr(runner.draw, self.name)

    def __set__(self, runner: ModelRunner, value: object) -> None:
        setattr(runner.draw, self.name, value)


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device, self.dtype = resolve_device_dtype(config.load.device, config.load.dtype)
        # process-wide; an engine replica owns its process and its GPU (tensor-parallel workers: the same)
        configure_process(self.device, config.load.seed, config.load.blas_library)
        # tensor parallelism: this process is rank 0 and starts the others; None at size 1
        self.tp = TPGroup(config, self.device) if config.tensor_parallel_size > 1 else None
        self.model, self.model_config = load_model(
            config.load.model, dtype=self.dtype, device=self.device, quantization=config.load.quantization,
            shard=None if self.tp is None else self.tp.shard,
        )  # fmt: skip
        # gated-LoRA MTP: mask embeddings and sampler head (None for other engines)
        self.mtp_head = mtp_setup.load_head(config, self.model, self.model_config, self.dtype, self.device)
        self.lora = self._wrap_model(config)  # LoRA layers (None unless enable_lora), TPModel with TP
        max_pos = self.model_config.max_position_embeddings
        self.max_model_len = min(config.load.max_model_len or min(max_pos, 8192), max_pos)
        self.block_size = config.cache.block_size
        self.draft = self._load_draft(config)
        self.upload = Uploader(self.device)
        # the block tables of running sequences, kept across steps for `pack` (step_inputs.py)
        width = -(-self.max_model_len // self.block_size)
        self.tables = TableMirror(width, 2 * config.scheduler.max_num_seqs)
        self._allocate_kv_cache(config)
        vocab = self.model_config.vocab_size
        sampler = Sampler(vocab, self.device)
        bitmasks = (
            ProcessBitmaskFiller(vocab, self.device, config.scheduler.max_num_seqs)
            if config.grammar_process
            else BitmaskFiller(vocab, self.device)
        )
        # unseeded sequences draw from stream (base, seq_id); the base follows load.seed (set above)
        self.draw = PlainDraw(sampler, bitmasks, self.upload, int(torch.randint(0, 2**62, (1,)).item()))
        max_batch = max_graph_batch(config)
        self.mixed_graphs: MixedGraphs | None = None
        self.draw_graphs: DrawGraphs | None = None  # the plain draw's graphs (captured with the others)
        self.graphs_by_q = self._capture_graphs(config, max_batch)
        self.graphs: DecodeGraphs | None = self.graphs_by_q.get(1)
        # speculative decoding: proposals and their verification
        self.spec = self._speculation(config, sampler, max_batch) if config.speculative else None

    def _speculation(self, config: EngineConfig, sampler: Sampler, max_batch: int) -> SpecStep:
        if self.draft is not None:
            graphs = bool(self.graphs_by_q)
            self.draft.allocate(self.kv_spec.num_blocks, max_batch, self.max_model_len, graphs)
        verifier = SpecSampler(sampler, config.speculative.synthetic_acceptance_rate)
        spec = SpecStep(self.draw, verifier, self.draft, self.model.compute_logits, self.upload)
        spec.mtp = self.mtp
        return spec

    # the plain draw's sampler and grammar-mask filler (new grammar states come from it)
    sampler = _OfDraw()
    bitmasks = _OfDraw()

    def _wrap_model(self, config: EngineConfig) -> LoRAManager | None:
        """With enable_lora, LoRA layers around the base projections (before the KV pool is sized:
        their slot stacks take memory), and returns the manager of their slots (else None); with
        tensor parallelism, each slot load reaches the workers, which read their shares of the same
        file. Then, with tensor parallelism, the model is wrapped so each forward and logits
        computation reaches every rank."""
        manager = None
        if config.enable_lora or self.mtp_head is not None:
            mtp = None if self.mtp_head is None else self.mtp_head.source
            layers, self.mtp_lora_slot = mtp_setup.lora_layers(self.model, config, mtp, self.dtype)
            manager = (
                LoRAManager(config, self.model_config, layers, self.dtype) if config.enable_lora else None
            )
        if self.tp is not None:
            tp = self.tp
            if manager is not None:
                manager.on_load = lambda slot, r: tp.send(tp_wire.encode_lora(slot, *astuple(r)))
            self.model = TPModel(self.model, tp, self.model_config.vocab_size)
        return manager

    def _load_draft(self, config: EngineConfig) -> DraftRunner | None:
        spec = config.speculative
        if spec is None or spec.method != "draft_model":
            return None
        vocab = self.model_config.vocab_size
        return DraftRunner(spec, self.device, self.dtype, vocab, self.max_model_len, self.block_size)

    def _allocate_kv_cache(self, config: EngineConfig) -> None:
        """The KV pool, sized to what the weights and a full-budget forward leave (a draft model's KV
        beside each block), handed to every attention layer."""
        self.kv_spec: KVCacheSpec = plan_kv_cache(
            config.cache,
            self.model_config if self.tp is None else local_config(self.model_config, self.tp.shard),
            kv_cache_dtype(config.cache, self.dtype),
            self.device,
            self._profile_activation_bytes(),
            extra_block_bytes=self.draft.kv_spec(1).bytes_per_block if self.draft else 0,
        )
        self.mtp: MtpStep | None = None
        scratch = 0
        if self.mtp_head is not None:  # mask tokens' K/V go to blocks past the pool
            self.kv_spec, scratch = mtp_setup.scratch_blocks(config, self.kv_spec)
            first, k = self.kv_spec.num_blocks * self.block_size, config.speculative.num_speculative_tokens
            slot, size = self.mtp_lora_slot, scratch * self.block_size
            self.mtp = MtpStep(self.model, self.mtp_head, k, slot, first, size, self.upload)
        self.kv_caches = allocate_kv_cache(
            replace(self.kv_spec, num_blocks=self.kv_spec.num_blocks + scratch), self.device
        )
        if self.tp is not None:  # the same pool and scratch on every rank
            self.tp.allocate_kv(self.kv_spec.num_blocks + scratch)
        attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        for layer, (k_cache, v_cache) in zip(attn_layers, self.kv_caches, strict=True):
            layer.k_cache, layer.v_cache = k_cache, v_cache
        self.kv_offload = self._host_tier(config)

    def _host_tier(self, config: EngineConfig) -> KVOffload | None:
        """The host KV tier's copier (kv_offloading_size > 0), else None."""
        gib = config.cache.kv_offloading_size
        if not gib:
            return None
        if self.tp is not None or self.draft is not None:  # their KV lives in other caches too
            raise ValueError(
                "kv_offloading_size: the host KV tier needs tensor_parallel_size 1 and no draft model; "
                "set kv_offloading_size 0 or drop those options"
            )
        return KVOffload(self.kv_caches, self.kv_spec, gib)

    def _capture_graphs(self, config: EngineConfig, max_batch: int) -> dict[int, DecodeGraphs]:
        """CUDA graphs: mixed steps by token count (config.load.mixed_graphs), then uniform steps by
        batch size and query length, 1 (decode) and, when speculating, k + 1 (verification), all in
        one memory pool. Logs their count, capture time and memory."""
        if self.device.type != "cuda" or config.load.enforce_eager:
            return {}
        start, free = time.perf_counter(), torch.cuda.mem_get_info(self.device)[0]
        hidden = self.model_config.hidden_size
        args = (self.model, self.device, self.dtype, config, self.max_model_len, hidden)
        if self.tp is None:
            graphs, self.mixed_graphs = capture_sets(*args)
        else:  # every rank captures the same graphs (tensor parallelism: engine/runner/tp_model.py)
            graphs, self.mixed_graphs = capture_on_all_ranks(self.tp, *args)
        logged = dict(graphs)  # the MTP steps' graphs are the MTP step's, never forward_batch's
        if self.mtp is not None and self.tp is None:  # with tensor parallelism MTP steps run eagerly
            pool = graphs[1].pool()  # one pool for every graph: MTP steps and their drafting too
            self.mtp.graphs = logged[self.mtp.graphs_q] = mtp_setup.capture_graphs(
                self.model, self.mtp_head, *args[1:], pool
            )
            self.mtp.capture_drafting(pool)
        if self.tp is None and self.lora is None and self.mtp is None:  # the plain draw (draw_graphs.py)
            self.draw_graphs = DrawGraphs(self.model, self.device, self.dtype, hidden, max_batch)
            self.draw_graphs.capture(graphs[1].pool())
        drafting = self.mtp.draft_graphs if self.mtp is not None else None
        sets = [*logged.values(), self.mixed_graphs, drafting, self.draw_graphs]
        count = sum(len(g.graphs) for g in sets if g is not None)
        used = (free - torch.cuda.mem_get_info(self.device)[0]) / 2**20
        summary = _graph_summary(logged, self.mixed_graphs, drafting, self.draw_graphs)
        log.info("captured %d CUDA graphs (%s) in %.1f s, %.0f MiB", count, summary,
                 time.perf_counter() - start, used)  # fmt: skip
        return graphs

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (they also stop when this process ends)."""
        if self.tp is not None:
            self.tp.close()

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, prev: PendingSample | None = None
    ) -> PendingSample | PendingSpec | DeferredSample | None:
        """Enqueue the step on the device and return its samples (and prompt scores) unresolved (None:
        nothing samples or scores). A step scheduled ahead (out.prev_rows) takes its input ids from
        `prev`'s sampled ids; if its draw reads host state (out.draw_late), it is a DeferredSample. A
        step with proposals is verified (self.spec) instead: a PendingSpec."""
        self._copy_blocks(out.block_copies)
        batch = build_batch(out, self.block_size, self.mtp.scratch if self.mtp is not None else 0)
        batch.table_rows = (self.tables, self.tables.index([c.seq.table for c in out.chunks]))
        if self.lora is not None:
            batch.lora_slots = self.lora.token_slots(out.chunks, out.active_loras)
        proposals = self.spec.propose(out, batch) if self.spec is not None else None
        if batch.mask_rows:  # gated-LoRA MTP chunks: eager, with their masks (engine/runner/mtp_step.py)
            batch.lora_slots = self.mtp.lora_rows(out.chunks, batch, batch.lora_slots)
            hidden = self.mtp.forward(batch, self.block_size)
        else:
            fed_back = self._fed_back(out, prev)
            draft_ids = None if proposals is None else proposals.draft_ids
            hidden = forward_batch(
                self.model, self.graphs_by_q, self.upload, batch, self.block_size, fed_back, draft_ids,
                self.mixed_graphs,
            )  # fmt: skip
        scores = None
        if out.prompt_logprob_chunks:  # prompt logprobs: only steps with a request that asks
            plan = prompt_logprob_rows(out, batch)
            scores = self.draw.sampler.score_prompt(self.model.compute_logits, hidden, plan)
        if proposals is not None:
            return self.spec.verify(batch, hidden, scores, proposals)
        return self._draw(out, batch, hidden, scores)

    def _draw(self, out: SchedulerOutput, batch: StepBatch, hidden: torch.Tensor, scores):
        """The plain step's draw: logits at the sampling rows only, one token per sampling sequence."""
        if not batch.samplers:
            return self.draw.scores_only(scores)
        rows = self.draw.rows(batch)
        graphs = None if out.draw_late else self.draw_graphs
        if graphs is not None and graphs.bucket(len(rows)) is not None and self.draw.plain(batch, rows):
            index = None if batch.logits_at_every_row else batch.logit_rows
            return PendingSample(graphs.draw(self.upload, hidden, index, rows), None, rows, scores)
        logits = self.draw.select(batch, self._logits(batch, hidden))
        if out.draw_late:
            # launched ahead: the host has not appended the previous step's tokens, which the grammars
            # and penalties read; the engine draws once it has, while the device runs this forward
            start = functools.partial(self.draw.start, logits, rows, scores, batch.samplers, True)
            return DeferredSample(start)
        return self.draw.start(logits, rows, scores, batch.samplers)()

    def _logits(self, batch: StepBatch, hidden: torch.Tensor) -> torch.Tensor:
        """The logits of the batch's logit rows. On a GPU the LM head takes a row count rounded up to a
        graph bucket (the last row repeated): cuBLASLt's host time per GEMM grows several-fold when the
        shape keeps changing from step to step, and a few more rows cost the weight-bound head little."""
        rows, n = batch.logit_rows, len(batch.logit_rows)
        m = lm_head_rows(n) if self.device.type == "cuda" else n
        if not batch.logits_at_every_row:
            index = rows + [rows[-1]] * (m - n)
            hidden = hidden.index_select(0, self.upload.values("logit_rows", index, torch.long))
            return self.model.compute_logits(hidden)[:n]
        hidden = pad_rows(hidden, m)
        if self.tp is not None:  # the forward's own rows: every rank has them, none is broadcast
            return self.model.compute_own_logits(hidden, n)[:n]
        return self.model.compute_logits(hidden)[:n]

    def _fed_back(self, out: SchedulerOutput, prev: PendingSample | None) -> torch.Tensor | None:
        """The input ids of a step scheduled ahead: rows of the previous step's samples, on the device."""
        if not out.prev_rows:  # not scheduled ahead, or no row of it decodes a token still on the device
            return None
        if prev is None:
            raise RuntimeError("a step scheduled ahead needs the previous step's samples")
        if len(out.prev_rows) == prev.sampled.shape[0]:  # increasing rows, none left out: all of them
            return prev.sampled
        return prev.sampled.index_select(0, self.upload.values("prev_rows", out.prev_rows, torch.long))

    # ------------------------------------------------------------------ helpers
    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate shared blocks (all layers) before anyone writes into the copies."""
        if not copies:
            return
        if self.tp is not None:
            self.tp.copy_blocks(copies)
        src = self.upload.values("cow_src", [s for s, _ in copies], torch.long)
        dst = self.upload.values("cow_dst", [d for _, d in copies], torch.long)
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]
        if self.draft is not None:
            self.draft.copy_blocks(src, dst)

    def _profile_activation_bytes(self) -> int:
        """Peak activation memory of a full-budget forward (GPU only), so the KV pool leaves room."""
        if self.device.type != "cuda":
            return 0
        n = self.config.scheduler.max_num_batched_tokens
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        meta = AttentionMetadata.for_full_sequences([n], self.device)
        with torch.inference_mode(), attention_context(meta):
            hidden = self.model(ids, torch.arange(n, device=self.device))
            self.model.compute_logits(hidden[-min(n, self.config.scheduler.max_num_seqs) :])
        peak = torch.cuda.max_memory_allocated(self.device) - before
        torch.cuda.empty_cache()
        return peak
