"""The model runner: the only place where scheduled sequences become tensors.

Per step: perform copy-on-write block copies, pack every scheduled chunk's tokens into one flat batch
(no padding), describe it with AttentionMetadata, run the model, compute logits only at positions that
sample, and sample every sampling sequence (n > 1 siblings share one logits row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention_context import AttentionMetadata, attention_context
from engine.config import EngineConfig
from engine.cuda_graph import DecodeGraphs
from engine.kv_cache import KVCacheSpec, allocate_kv_cache, plan_kv_cache
from engine.loader import load_model
from engine.model_config import ModelConfig
from engine.models.layers import Attention
from engine.request import Sequence
from engine.sampler import Sampler, SampleResult, SamplingRow, upload
from engine.scheduler import SchedulerOutput

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "float64": torch.float64}


def resolve_device_dtype(config: EngineConfig) -> tuple[torch.device, torch.dtype]:
    load = config.load
    device = torch.device("cuda" if load.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if load.device == "auto" else load.device))
    if load.dtype != "auto":
        return device, _DTYPES[load.dtype]
    return device, torch.bfloat16 if device.type == "cuda" else torch.float32


@dataclass
class StepBatch:
    """Host-side description of one packed step, turned into tensors by `to_device`."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    logit_rows: list[int]  # packed index of the last token of every chunk that samples
    sample_rows: list[int]  # for each sampling sequence, its row in logits[logit_rows]
    samplers: list[Sequence]


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig | None = None):
        self.config = config
        self.device, self.dtype = resolve_device_dtype(config)
        torch.manual_seed(config.load.seed)
        self.model, self.model_config = load_model(config.load.model, dtype=self.dtype, device=self.device)
        max_pos = self.model_config.max_position_embeddings
        self.max_model_len = min(config.load.max_model_len or min(max_pos, 8192), max_pos)
        self.block_size = config.cache.block_size
        self.kv_spec: KVCacheSpec = plan_kv_cache(
            config.cache, self.model_config, self.dtype, self.device, self._profile_activation_bytes()
        )
        self.kv_caches = allocate_kv_cache(self.kv_spec, self.device)
        attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        for layer, (k_cache, v_cache) in zip(attn_layers, self.kv_caches, strict=True):
            layer.k_cache, layer.v_cache = k_cache, v_cache
        self.sampler = Sampler(self.model_config.vocab_size, self.device)
        self.generators: dict[int, torch.Generator] = {}
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and not config.load.enforce_eager:
            self.graphs = DecodeGraphs(
                self.model, self.device, min(config.scheduler.max_num_seqs, 512),
                -(-self.max_model_len // self.block_size), self.block_size, self.model_config.hidden_size,
                self.dtype)
            self.graphs.capture()

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> SampleResult:
        self._copy_blocks(out.block_copies)
        batch = self.build_batch(out)
        input_ids, positions, meta = self.to_device(batch)
        if meta.is_decode and self.graphs is not None and self.graphs.can_run(meta.num_seqs):
            hidden = self.graphs.run(input_ids, positions, meta)
        else:
            with attention_context(meta):
                hidden = self.model(input_ids, positions)
        if not batch.samplers:
            return SampleResult([], [])
        rows = upload(batch.logit_rows, torch.long, self.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows))
        if batch.sample_rows != list(range(len(batch.logit_rows))):  # n > 1 siblings share a row
            logits = logits.index_select(0, upload(batch.sample_rows, torch.long, self.device))
        return self.sampler(logits, [self._sampling_row(s) for s in batch.samplers])

    def build_batch(self, out: SchedulerOutput) -> StepBatch:
        b = StepBatch([], [], [], [], [], [], [], [], [])
        for chunk in out.chunks:
            seq, start, end = chunk.seq, chunk.start, chunk.start + chunk.num_tokens
            blocks = seq.table.blocks
            b.input_ids += seq.token_ids[start:end]
            b.positions += range(start, end)
            # position p lives in block blocks[p // block_size] at offset p % block_size
            b.slot_mapping += [blocks[p // self.block_size] * self.block_size + p % self.block_size
                               for p in range(start, end)]
            b.query_lens.append(chunk.num_tokens)
            b.seq_lens.append(end)
            b.block_tables.append(blocks)
            if chunk.samples:
                b.logit_rows.append(len(b.input_ids) - 1)
                for s in chunk.samples:
                    b.sample_rows.append(len(b.logit_rows) - 1)
                    b.samplers.append(s)
        return b

    def to_device(self, b: StepBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        dev = self.device
        width = max(len(t) for t in b.block_tables)
        tables = [t + [-1] * (width - len(t)) for t in b.block_tables]  # -1: past the sequence's end
        cu = [0]
        for n in b.query_lens:
            cu.append(cu[-1] + n)
        meta = AttentionMetadata(
            cu_seqlens_q=upload(cu, torch.int32, dev),
            seq_lens=upload(b.seq_lens, torch.int32, dev),
            slot_mapping=upload(b.slot_mapping, torch.int64, dev),
            block_tables=upload(tables, torch.int32, dev),
            query_lens_cpu=b.query_lens,
            seq_lens_cpu=b.seq_lens,
            max_seqlen_q=max(b.query_lens),
            max_seqlen_k=max(b.seq_lens),
            block_size=self.block_size,
        )
        return upload(b.input_ids, torch.long, dev), upload(b.positions, torch.long, dev), meta

    # ------------------------------------------------------------------ helpers
    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate shared blocks (all layers) before anyone writes into the copies."""
        if not copies:
            return
        src = upload([s for s, _ in copies], torch.long, self.device)
        dst = upload([d for _, d in copies], torch.long, self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        params = seq.request.params
        gen = None
        if params.seed is not None:
            gen = self.generators.get(seq.seq_id)
            if gen is None:  # each sample of a seeded request draws from its own stream
                gen = torch.Generator(device=self.device)
                gen.manual_seed(params.seed + seq.index)
                self.generators[seq.seq_id] = gen
        return SamplingRow(params, seq.request.prompt_ids, seq.output_ids, gen)

    def release(self, seq: Sequence) -> None:
        self.generators.pop(seq.seq_id, None)

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
            self.model.compute_logits(hidden[-min(n, self.config.scheduler.max_num_seqs):])
        peak = torch.cuda.max_memory_allocated(self.device) - before
        torch.cuda.empty_cache()
        return peak
