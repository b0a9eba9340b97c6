"""The model runner: the only place where scheduled sequences become tensors.

Per step: perform copy-on-write block copies, pack every scheduled chunk's tokens into one flat batch
(no padding), describe it with AttentionMetadata, run the model, compute logits only at positions that
sample, and sample every sampling sequence (n > 1 siblings share one logits row). Prompt chunks of
requests with prompt_logprobs also get logits at every position (Sampler.score_prompt); a step without
such a chunk does no extra work.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from engine.attention_context import AttentionMetadata, attention_context
from engine.config import EngineConfig
from engine.cuda_graph import DecodeGraphs, forward_batch
from engine.device import resolve_device_dtype
from engine.draft_runner import DraftOutput, DraftRunner
from engine.grammar_remote import ProcessBitmaskFiller
from engine.grammar_state import BitmaskFiller
from engine.kv_cache import KVCacheSpec, allocate_kv_cache, kv_cache_dtype, plan_kv_cache
from engine.loader import load_model
from engine.models.layers import Attention
from engine.request import Sequence
from engine.sampler import PendingSample, Sampler, SamplingRow, TokenMask, stream_key
from engine.scheduler import SchedulerOutput
from engine.spec_sampler import PendingSpec, SpecRows, SpecSampler
from engine.step_inputs import StepBatch, build_batch, prompt_logprob_rows
from engine.uploader import Uploader


class DeferredSample:
    """The draw of a step launched ahead whose rows read host state (grammar matchers, penalties' token
    history; SchedulerOutput.draw_late): forward and logits are enqueued. Once the engine has appended
    the previous step's tokens, `start()` begins the constrained rows' mask fill on a worker thread,
    and `finish()` joins it and enqueues the sampling; between the two the engine does its other host
    work. `finish()` alone does both."""

    def __init__(self, start: Callable[[], Callable[[], PendingSample]]):
        self._start = start
        self._finish: Callable[[], PendingSample] | None = None

    def start(self) -> None:
        if self._finish is None:
            self._finish = self._start()

    def finish(self) -> PendingSample:
        self.start()
        return self._finish()


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device, self.dtype = resolve_device_dtype(config.load.device, config.load.dtype)
        torch.manual_seed(config.load.seed)
        if self.device.type == "cuda":  # process-wide; an engine replica owns its process and its GPU
            torch.backends.cuda.preferred_blas_library(config.load.blas_library)
        self.model, self.model_config = load_model(
            config.load.model, dtype=self.dtype, device=self.device, quantization=config.load.quantization
        )
        max_pos = self.model_config.max_position_embeddings
        self.max_model_len = min(config.load.max_model_len or min(max_pos, 8192), max_pos)
        self.block_size = config.cache.block_size
        spec = config.speculative
        self.draft: DraftRunner | None = None
        if spec is not None and spec.method == "draft_model":
            vocab = self.model_config.vocab_size
            self.draft = DraftRunner(
                spec, self.device, self.dtype, vocab, self.max_model_len, self.block_size
            )
        self.kv_spec: KVCacheSpec = plan_kv_cache(
            config.cache,
            self.model_config,
            kv_cache_dtype(config.cache, self.dtype),
            self.device,
            self._profile_activation_bytes(),
            extra_block_bytes=self.draft.kv_spec(1).bytes_per_block if self.draft else 0,
        )
        self.kv_caches = allocate_kv_cache(self.kv_spec, self.device)
        attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        for layer, (k_cache, v_cache) in zip(attn_layers, self.kv_caches, strict=True):
            layer.k_cache, layer.v_cache = k_cache, v_cache
        self.sampler = Sampler(self.model_config.vocab_size, self.device)
        self.spec_sampler = SpecSampler(self.sampler, spec.synthetic_acceptance_rate) if spec else None
        vocab = self.model_config.vocab_size
        self.bitmasks = (
            ProcessBitmaskFiller(vocab, self.device, config.scheduler.max_num_seqs)
            if config.grammar_process
            else BitmaskFiller(vocab, self.device)
        )
        self._no_samples = torch.empty(0, dtype=torch.long, device=self.device)  # a step that only scores
        self.upload = Uploader(self.device)
        # the last (sampling rows, constrained rows) and their device row maps: a decode batch keeps
        # the same rows for many steps, and an upload costs more host time than the draw's launch
        self._mask_rows: tuple[tuple[int, list[int]], torch.Tensor, torch.Tensor] | None = None
        # unseeded sequences draw from stream (base, seq_id); the base follows load.seed (set above)
        self.unseeded_base = int(torch.randint(0, 2**62, (1,)).item())
        max_batch = min(config.scheduler.max_num_seqs, 512)
        self.graphs_by_q = self._capture_graphs(config, max_batch)
        self.graphs: DecodeGraphs | None = self.graphs_by_q.get(1)
        if self.draft is not None:
            self.draft.allocate(
                self.kv_spec.num_blocks, max_batch, self.max_model_len, bool(self.graphs_by_q)
            )

    def _capture_graphs(self, config: EngineConfig, max_batch: int) -> dict[int, DecodeGraphs]:
        """CUDA graphs by query length: 1 (decode) and, when speculating, k + 1 (verification)."""
        if self.device.type != "cuda" or config.load.enforce_eager:
            return {}
        spec = config.speculative
        width, hidden = -(-self.max_model_len // self.block_size), self.model_config.hidden_size
        graphs = {}
        for q in [1] + ([spec.num_speculative_tokens + 1] if spec is not None else []):
            g = DecodeGraphs(
                self.model, self.device, max_batch, width, self.block_size, hidden, self.dtype, q
            )
            g.capture()
            graphs[q] = g
        return graphs

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, prev: PendingSample | None = None
    ) -> PendingSample | DeferredSample | None:
        """Enqueue the step on the device and return its samples (and prompt scores) unresolved (None:
        nothing samples or scores). A step scheduled ahead (out.prev_rows) takes its input ids from
        `prev`'s sampled ids; if its draw reads host state (out.draw_late), it is a DeferredSample."""
        self._copy_blocks(out.block_copies)
        batch = build_batch(out, self.block_size)
        spec_rows = [self._sampling_row(s, s.num_computed + 1) for s in batch.spec_samplers]
        drafts, draft_ids = self._propose(out, batch, spec_rows)
        fed_back = self._fed_back(out, prev)
        hidden = forward_batch(
            self.model, self.graphs_by_q, self.upload, batch, self.block_size, fed_back, draft_ids
        )
        scores = None
        if out.prompt_logprob_chunks:  # prompt logprobs: only steps with a request that asks
            plan = prompt_logprob_rows(out, batch)
            scores = self.sampler.score_prompt(self.model.compute_logits, hidden, plan)
        if spec_rows:
            return self._execute_spec(batch, hidden, scores, spec_rows, drafts)
        if not batch.samplers:
            return None if scores is None else PendingSample(self._no_samples, None, [], scores)
        if batch.logit_rows != list(range(len(batch.input_ids))):  # decode steps sample every row
            hidden = hidden.index_select(0, self.upload.values("logit_rows", batch.logit_rows, torch.long))
        logits = self.model.compute_logits(hidden)
        if batch.sample_rows != list(range(len(batch.logit_rows))):  # n > 1 siblings share a row
            logits = logits.index_select(0, self.upload.values("sample_rows", batch.sample_rows, torch.long))
        rows = [self._sampling_row(s, p) for s, p in zip(batch.samplers, batch.draw_positions, strict=True)]
        constrained = [i for i, s in enumerate(batch.samplers) if s.grammar is not None]
        if out.draw_late:
            # launched ahead: the host has not appended the previous step's tokens, which the grammars
            # and penalties read; the engine draws once it has, while the device runs this forward
            return DeferredSample(
                functools.partial(self._start_draw, logits, rows, scores, batch.samplers, constrained, True)
            )
        return self._start_draw(logits, rows, scores, batch.samplers, constrained)()

    def _propose(self, out: SchedulerOutput, batch: StepBatch, spec_rows):
        """A draft model's proposals (and the input rows they fill); (None, None) without one. Steps
        scheduled ahead carry no proposals, and the draft catches up on them later."""
        if self.draft is None or out.prev_rows is not None:
            return None, None
        drafts = self.draft.propose(out, spec_rows, self.sampler)
        if drafts is None:
            return None, None
        rows = self.upload.values("draft_rows", batch.spec_draft_rows, torch.long)
        return drafts, (rows, drafts.tokens.reshape(-1))

    def _execute_spec(
        self, batch: StepBatch, hidden, scores, spec_rows, drafts: DraftOutput | None
    ) -> PendingSpec:
        """A step with proposals: one logits pass over the plain rows' draw positions and every scored
        position of the speculating rows; the plain rows draw as in any step, the others verify."""
        index = self.upload.values("logit_rows", batch.logit_rows + batch.spec_logit_rows, torch.long)
        logits = self.model.compute_logits(hidden.index_select(0, index))
        n = len(batch.logit_rows)
        plain = None
        if batch.samplers:
            own = logits[:n]
            if batch.sample_rows != list(range(n)):
                own = own.index_select(0, self.upload.values("sample_rows", batch.sample_rows, torch.long))
            rows = [
                self._sampling_row(s, p) for s, p in zip(batch.samplers, batch.draw_positions, strict=True)
            ]
            constrained = [i for i, s in enumerate(batch.samplers) if s.grammar is not None]
            plain = self._start_draw(own, rows, scores, batch.samplers, constrained)()
        elif scores is not None:
            plain = PendingSample(self._no_samples, None, [], scores)
        host_drafts = [s.draft for s in batch.spec_samplers] if drafts is None else None
        real = batch.spec_num_draft if drafts is not None else [len(d) for d in host_drafts]
        spec = SpecRows(spec_rows, batch.spec_num_draft, real, host_drafts)
        if drafts is not None:
            spec.draft_tokens, spec.draft_probs = drafts.tokens, drafts.probs
        return self.spec_sampler(logits[n:], spec, plain)

    def _start_draw(
        self, logits, rows, scores, samplers, constrained: list[int], background: bool = False
    ) -> Callable[[], PendingSample]:
        """Begin the draw: with constrained rows, their bitmask fill on the host (the forward is already
        enqueued, so on a GPU this overlaps it; in the `background`, it overlaps the caller's work too).
        The returned function joins the fill and enqueues the sampling."""
        if not constrained:
            return functools.partial(self._sample, logits, rows, scores, None, constrained)
        join = self.bitmasks.start([samplers[i].grammar for i in constrained], background)
        return lambda: self._sample(logits, rows, scores, join, constrained)

    @torch.inference_mode()
    def _sample(self, logits, rows, scores, join_mask, constrained: list[int]) -> PendingSample:
        if join_mask is None:
            return self.sampler(logits, rows) if scores is None else self.sampler(logits, rows, scores)
        mask = TokenMask(join_mask())  # every row constrained: bitmask row i is sampling row i
        if len(constrained) < len(rows):
            mask.rows, mask.row_of = self._mask_row_maps(len(rows), constrained)
        return self.sampler(logits, rows, scores, mask)

    def _mask_row_maps(self, num_rows: int, constrained: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """TokenMask.rows and row_of on the device, reused while the rows stay the same (each upload
        makes a fresh device tensor, so a kept one is never overwritten)."""
        key = (num_rows, constrained)
        if self._mask_rows is None or self._mask_rows[0] != key:
            row_of = [-1] * num_rows
            for i, r in enumerate(constrained):
                row_of[r] = i
            both = self.upload.values("mask_rows", constrained + row_of, torch.long)  # one upload
            self._mask_rows = (key, both[: len(constrained)], both[len(constrained) :])
        return self._mask_rows[1], self._mask_rows[2]

    def _fed_back(self, out: SchedulerOutput, prev: PendingSample | None) -> torch.Tensor | None:
        """The input ids of a step scheduled ahead: rows of the previous step's samples, on the device."""
        if out.prev_rows is None:
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
        src = self.upload.values("cow_src", [s for s, _ in copies], torch.long)
        dst = self.upload.values("cow_dst", [d for _, d in copies], torch.long)
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]
        if self.draft is not None:
            self.draft.copy_blocks(src, dst)

    def _sampling_row(self, seq: Sequence, position: int) -> SamplingRow:
        """Each sample of a seeded request draws from its own stream (seed, sample index), so its
        tokens depend on the seed alone; an unseeded one from (engine base, sequence id)."""
        params = seq.request.params
        if params.greedy:
            key = 0  # draws nothing: the argmax needs no noise (and the hot batch-1 path no key)
        elif params.seed is not None:
            key = stream_key(params.seed, seq.index)
        else:
            key = stream_key(self.unseeded_base, seq.seq_id)
        return SamplingRow(params, seq.token_ids, seq.num_prompt, key, position)

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
