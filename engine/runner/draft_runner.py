"""The draft model of speculative decoding: a second checkpoint with the target's vocabulary that
proposes k tokens per speculating sequence, on the target's device.

Its KV lives in its own pool indexed by the same block ids: the block manager's tables serve both
models, so copy-on-write, preemption and prefix caching need nothing new (a block's draft KV is only
ever a hint: stale draft KV lowers acceptance, never correctness, since verification is lossless).

Per step, before the target's forward:
1. mirror: every chunk of the step also runs through the draft, from what the draft already holds for
   that sequence (SpecState.draft_computed) up to the chunk's last real token. A speculating chunk's
   last real token is its pending one, whose draft logits give proposal 0. After verification,
   draft_computed advances by the accepted proposals only (Speculator.record); a chunk cut after a
   forced token (engine/output/sink.TokenSink.accept) accepts none from that token on, and a mirror
   never starts past the target's own chunk, so draft KV of a dropped token is always recomputed;
2. k - 1 decode forwards of the speculating rows, each feeding back the previous proposal (the draft's
   own CUDA graphs where a bucket fits).
Greedy rows propose the draft's argmax; sampled rows draw from q = softmax(draft logits / T) with
Philox noise keyed by (the row's stream ^ DRAFT_SALT, position), and q goes to verification.
Steps scheduled ahead skip the mirror; the lag is caught up by the next mirror.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.device.uploader import Uploader
from engine.models.layers import Attention
from engine.models.loader import load_model
from engine.runner.cuda_graph import DecodeGraphs, forward_batch
from engine.runner.kv_cache import KVCacheSpec, allocate_kv_cache
from engine.runner.step_inputs import StepBatch, build_batch, slots
from engine.sampling.rows import RowTensors, SamplingRow
from engine.sched.output import ScheduledChunk, SchedulerOutput
from engine.spec.speculator import SpecState
from engine.spec_config import SpeculativeConfig, check_draft_vocab
from kernels import ops

DRAFT_SALT = 0x3D2A_F00D  # XORed into a row's Philox key: the draft's noise is not the target's
MIRROR_Q = 2  # a speculating row's mirror chunk in the steady state: its last two real tokens


@dataclass
class DraftOutput:
    tokens: torch.Tensor  # [rows, k] int64: the proposals of each speculating row
    probs: torch.Tensor | None  # [rows, k, V] float32 q of each proposal; None when every row is greedy


class DraftRunner:
    def __init__(self, spec: SpeculativeConfig, device: torch.device, dtype: torch.dtype, target_vocab: int,
                 max_model_len: int, block_size: int):  # fmt: skip
        if spec.device not in (None, "auto") and torch.device(spec.device) != device:
            raise ValueError(
                f"speculative_config.device: got {spec.device!r} but the target runs on {device}; "
                "leave it unset (the draft runs on the target's device)"
            )
        if not (Path(spec.model) / "config.json").is_file():
            raise ValueError(
                f"speculative_config.model: {spec.model!r} holds no config.json; give the path of a local "
                "HF-format draft checkpoint directory"
            )
        draft_dtype = dtype if spec.dtype in (None, "auto") else getattr(torch, spec.dtype)
        self.model, self.model_config = load_model(
            spec.model, dtype=draft_dtype, device=device, progress=False
        )
        check_draft_vocab(target_vocab, self.model_config.vocab_size)
        if self.model_config.max_position_embeddings < max_model_len:
            raise ValueError(
                f"speculative_config.model: the draft handles {self.model_config.max_position_embeddings} "
                f"positions but max_model_len is {max_model_len}; lower max_model_len or use another draft"
            )
        self.k, self.device, self.dtype, self.block_size = (
            spec.num_speculative_tokens,
            device,
            draft_dtype,
            block_size,
        )
        self.uploads = [Uploader(device) for _ in range(self.k)]  # one per forward of a step
        # one per draw of a step; the target's vocabulary bounds top-k, as in the target's own draw
        self.tensors = [RowTensors(u, target_vocab, "draft_") for u in self.uploads]
        self.graphs: dict[int, DecodeGraphs] = {}  # by query length: 1 (drafting), 2 (the mirror)
        self.kv_caches: list = []

    def kv_spec(self, num_blocks: int) -> KVCacheSpec:
        mc = self.model_config
        return KVCacheSpec(
            num_blocks, self.block_size, mc.num_layers, mc.num_kv_heads, mc.head_dim, self.dtype
        )

    def allocate(self, num_blocks: int, max_batch: int, max_model_len: int, use_graphs: bool) -> None:
        """The draft's KV pool (as many blocks as the target's) and, on a GPU, its graphs."""
        self.kv_caches = allocate_kv_cache(self.kv_spec(num_blocks), self.device)
        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        for layer, (k_cache, v_cache) in zip(layers, self.kv_caches, strict=True):
            layer.k_cache, layer.v_cache = k_cache, v_cache
        if use_graphs:
            width = -(-max_model_len // self.block_size)
            hidden = self.model_config.hidden_size
            for q in (1, MIRROR_Q):
                g = DecodeGraphs(
                    self.model, self.device, max_batch, width, self.block_size, hidden, self.dtype, q
                )
                g.capture()
                self.graphs[q] = g

    @torch.inference_mode()
    def propose(self, out: SchedulerOutput, rows: list[SamplingRow]) -> DraftOutput | None:
        """Mirror the step, then draft k tokens for each chunk with proposals (`rows`: their sampling
        rows, in chunk order). None when the step has no such chunk."""
        mirror, starts = self._mirror(out)
        if not mirror.chunks:
            return None
        batch = build_batch(mirror, self.block_size)
        hidden = forward_batch(self.model, self.graphs, self.uploads[0], batch, self.block_size)
        if not rows:
            return None
        hidden = hidden.index_select(0, self.uploads[0].values("logit_rows", batch.logit_rows, torch.long))
        draws = _Draws(rows, self.tensors)
        token = draws.draw(self.model.compute_logits(hidden), 0)
        tables = [c.seq.table.blocks for c in out.chunks if c.num_draft]
        for j in range(1, self.k):
            step = _decode_batch(starts, j, tables, self.block_size)
            hidden = forward_batch(self.model, self.graphs, self.uploads[j], step, self.block_size, token)
            token = draws.draw(self.model.compute_logits(hidden), j)
        return draws.output()

    def _mirror(self, out: SchedulerOutput) -> tuple[SchedulerOutput, list[int]]:
        """The step as the draft sees it: each chunk from the draft's own progress to its last real
        token; speculating chunks sample (proposal 0). Also their pending tokens' positions."""
        mirror = SchedulerOutput(chunks=[], block_copies=[])
        starts = []
        # all speculating: each mirror chunk is widened to its last MIRROR_Q real tokens where it is
        # shorter (recomputing a valid position rewrites the same KV), so one captured graph runs it
        uniform = all(c.num_draft for c in out.chunks)
        for chunk in out.chunks:
            seq = chunk.seq
            if seq.spec is None:
                seq.spec = SpecState(draft_computed=chunk.start)  # trusts cached blocks' draft KV
            real_end = chunk.start + chunk.num_tokens - chunk.num_draft
            begin = min(seq.spec.draft_computed, chunk.start)
            if uniform and real_end - begin < MIRROR_Q <= real_end:
                begin = real_end - MIRROR_Q
            seq.spec.draft_computed = real_end
            samples = [seq] if chunk.num_draft else []
            mirror.chunks.append(ScheduledChunk(seq, begin, real_end - begin, samples))
            if chunk.num_draft:
                starts.append(chunk.start)
        return mirror, starts

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]


def _decode_batch(starts: list[int], j: int, tables: list[list[int]], block_size: int) -> StepBatch:
    """Draft forward j of the speculating rows: proposal j - 1 (fed back on the device) at position
    start + j, where start is the row's pending token's position."""
    positions = [s + j for s in starts]
    return StepBatch(
        input_ids=[0] * len(starts),
        positions=positions,
        slot_mapping=[slots(t, (p,), block_size)[0] for t, p in zip(tables, positions)],
        query_lens=[1] * len(starts),
        seq_lens=[p + 1 for p in positions],
        block_tables=tables,
    )


class _Draws:
    """The k draws of one step's speculating rows, and their q when some row samples. A sampled row's
    q is the draft's distribution under the row's own temperature and top-k / top-p / min-p (penalties
    left out: any q is lossless, a closer one is accepted more often). Draw j uses tensors[j]."""

    def __init__(self, rows: list[SamplingRow], tensors: list[RowTensors]):
        self.rows, self.tensors = rows, tensors
        self.sampled = any(not r.params.greedy for r in rows)
        self.keys, self.counters = tensors[0].streams(rows, DRAFT_SALT)
        if self.sampled:  # logits are divided by T first, then drawn at temperature 1 (0: greedy rows)
            self.divisors = tensors[0].divisors(rows)
        self.temperature = tensors[0].draw_temperatures(rows, divided=self.sampled)
        self.tokens: list[torch.Tensor] = []
        self.probs: list[torch.Tensor] = []

    def draw(self, logits: torch.Tensor, j: int) -> torch.Tensor:
        if not self.sampled:
            token = ops.sample(logits, self.temperature, self.keys, self.counters + j)
        else:
            scaled = self.tensors[j].temper(logits, self.rows, self.divisors)
            token = ops.sample(scaled, self.temperature, self.keys, self.counters + j)
            self.probs.append(scaled.softmax(-1))
        self.tokens.append(token)
        return token

    def output(self) -> DraftOutput:
        probs = torch.stack(self.probs, 1) if self.probs else None
        return DraftOutput(torch.stack(self.tokens, 1), probs)
