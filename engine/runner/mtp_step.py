"""The gated-LoRA MTP step (speculative_config method gated_lora_mtp): one forward verifies each
speculating sequence's proposals and drafts its next ones.

A speculating chunk is packed as [x0, m1..mk, x1, m1..mk, ..., xd, m1..mk] (engine/runner/step_inputs.py):
real tokens x_j (the pending token, then the proposals) at their positions, each followed by k mask
tokens. What this module adds around the model's forward:
  * visibility: x_j is ordinary causal; m_i after x_j sees the cache up to x_j and m_1..m_i of its own
    group, whose K/V sit in scratch slots past the block pool (TokenVisibility);
  * inputs: mask rows take the head's mask embeddings instead of a token's;
  * the gate: mask rows run the gated LoRA (its own slot), real rows never do, so the target's logits
    at real rows are the base model's;
  * drafting: once verification has decided, on the device, how many proposals a row keeps (a) and the
    token after them (the bonus), the masks of group a turn into the next k drafts through the sampler
    head, each conditioned on the token before it (the bonus, then the previous draft); with a draft
    vocabulary as a DraftChain (engine/spec/mtp_chain.py).
Steps whose every chunk is a full MTP chunk replay MtpGraphs (by batch size), and their drafting
replays DraftGraphs (the k passes of the sampler head, by the same batch sizes); other steps with MTP
chunks run eagerly; steps without take the engine's usual graphs.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.device.uploader import Uploader
from engine.models.attention_context import TokenVisibility, attention_context
from engine.runner.cuda_graph import DecodeGraphs, eager_inputs
from engine.runner.step_inputs import StepBatch, unpack
from engine.spec.mtp_head import MtpHead


def visibility_arrays(batch: StepBatch, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ctx_lens, local_start, local_len) of every row: causal rows see their position and before; each
    mask row m_i sees what its real token sees plus the i masks of its group up to itself."""
    ctx = np.asarray(batch.positions, dtype=np.int32) + 1
    local_start = np.zeros_like(ctx)
    local_len = np.zeros_like(ctx)
    masks = np.asarray(batch.mask_rows, dtype=np.int64)
    offset = np.tile(np.arange(1, k + 1, dtype=np.int32), len(masks) // k)  # i of each mask row m_i
    group = masks - offset  # the row of its real token
    ctx[masks] = ctx[group]
    local_start[masks] = group + 1
    local_len[masks] = offset
    return ctx, local_start, local_len


class MtpStep:
    """The gated-LoRA MTP pieces of a runner: its head, the gate's slot, the scratch slots."""

    def __init__(
        self, model, head: MtpHead, k: int, lora_slot: int, scratch: int, capacity: int, upload: Uploader
    ):
        self.model, self.head, self.k, self.lora_slot = model, head, k, lora_slot
        self.scratch, self.capacity = scratch, capacity  # first scratch slot, scratch slots
        self.upload = upload
        self.graphs: MtpGraphs | None = None  # captured on a GPU unless enforce_eager
        self.draft_graphs: DraftGraphs | None = None  # the drafting after a replay of `graphs`
        self.graphs_q = (k + 1) ** 2  # the query length of a full MTP chunk
        self.chain = head.chain  # with a draft vocabulary (engine/runner/mtp_setup.py), else None
        self.columns = torch.arange(1, k + 1, device=head.mask_embeddings.device)  # m_i's offset from x_0

    def lora_rows(self, chunks: list, batch: StepBatch, adapter_rows: list[int] | None) -> list[int]:
        """Each row's LoRA slot: the gate's on mask rows, the request's adapter (or -1) on every other
        row, real rows of MTP chunks included, so that verification scores with the model the request
        asked for (`adapter_rows`: the LoRA manager's, one entry per scheduled token, None when no
        chunk has an adapter). A mask row takes the gate alone: its drafts come from the base model
        with the gate, reading the adapted model's keys, which only lowers their acceptance."""
        rows = np.full(len(batch.input_ids), -1, dtype=np.int32)
        if adapter_rows is not None:
            src = dst = 0
            for chunk, q in zip(chunks, batch.query_lens):
                if q == chunk.num_tokens:  # not an MTP chunk: its rows are its tokens
                    rows[dst : dst + q] = adapter_rows[src : src + q]
                else:  # every token of a chunk is its request's
                    rows[dst : dst + q] = adapter_rows[src]
                src, dst = src + chunk.num_tokens, dst + q
        rows[batch.mask_rows] = self.lora_slot
        return rows.tolist()

    def forward(self, batch: StepBatch, block_size: int) -> torch.Tensor:
        """The step's hidden rows, with the masks' visibility, input vectors and gate: a captured graph
        when every chunk is a full MTP chunk, else eagerly."""
        if self.graphs is not None and self.graphs.fits(batch):
            return self.graphs.run(batch, self.upload)
        if len(batch.mask_rows) > self.capacity:
            raise RuntimeError(f"{len(batch.mask_rows)} mask rows exceed the {self.capacity} scratch slots")
        ids, pos, meta = eager_inputs(batch, self.upload, block_size)
        ctx, start, length = (torch.from_numpy(a) for a in visibility_arrays(batch, self.k))
        meta.visibility = TokenVisibility(
            self.upload("vis_ctx", ctx), self.upload("vis_start", start), self.upload("vis_len", length), pos
        )
        rows = self.upload.values("mask_rows", batch.mask_rows, torch.long)
        index = self.upload.values(
            "mask_index", list(range(self.k)) * (len(batch.mask_rows) // self.k), torch.long
        )
        meta.embed_rows = (rows, self.head.mask_embedding(index))
        with attention_context(meta):
            return self.model(ids, pos)

    def drafter(self, batch: StepBatch, hidden: torch.Tensor):
        """The drafting of this step, for SpecSampler: (accepted [R], bonus [R]) on the device -> the
        next drafts [R, k] of the R speculating chunks; a graph replay after a graph step."""
        if self.draft_graphs is not None and self.graphs.fits(batch):
            n = len(batch.seq_lens)
            return lambda accepted, bonus: self.draft_graphs.run(n, accepted, bonus)
        first = self.upload.values("mtp_first", batch.mtp_first, torch.long)
        return lambda accepted, bonus: self.drafts(hidden, first, accepted, bonus)

    def mask_offsets(self, first: torch.Tensor) -> torch.Tensor:
        """[R, k]: the rows of m_1..m_k after the pending token of chunks whose first rows are `first`."""
        return first[:, None] + self.columns

    def drafts(self, hidden, first, accepted, bonus, offsets: torch.Tensor | None = None) -> torch.Tensor:
        """The next k drafts [R, k] of chunks whose first rows are `first` [R] in `hidden` (`offsets`:
        their mask_offsets, when already known)."""
        offsets = self.mask_offsets(first) if offsets is None else offsets
        # the masks after the last kept real token: group `accepted`, k + 1 rows per group
        rows = torch.add(offsets, accepted[:, None], alpha=self.k + 1)
        masks = hidden.index_select(0, rows.reshape(-1)).view(len(rows), self.k, -1)
        if self.chain is not None:
            return self.chain.run(masks, bonus)
        prev, out = bonus, []
        for i in range(self.k):
            prev = self.head.draft(masks[:, i], prev, self.model.embed, self.model.compute_logits)
            out.append(prev)
        return torch.stack(out, dim=1)

    def capture_drafting(self, pool) -> None:
        """Capture DraftGraphs for the buckets of `graphs` (after they are captured), in `pool`."""
        self.draft_graphs = DraftGraphs(self)
        self.draft_graphs.capture(pool)


class MtpGraphs(DecodeGraphs):
    """CUDA graphs by batch size for steps whose every chunk is an MTP chunk with k proposals: (k + 1)^2
    rows each, [x0, m1..mk, x1, m1..mk, ...]. The layout is the same in every such step, so the mask
    rows, their input vectors, their local ranges and the gate's slots are fixed per bucket; the cache
    bound of each row comes from the positions in the graph (its real token's position + 1), and
    padding rows (slot -1) see nothing."""

    lora = True  # the gate's slot on mask rows, from the step's lora_slots buffer

    def __init__(self, model, head: MtpHead, k: int, device, max_batch: int, width: int, block_size: int,
                 hidden_size: int, dtype: torch.dtype):  # fmt: skip
        q = (k + 1) ** 2
        super().__init__(model, device, max_batch, width, block_size, hidden_size, dtype, q)
        self.head, self.k = head, k
        row = torch.arange(max_batch * q, device=device)
        offset = row % (k + 1)  # i of mask row m_i; 0 on real rows
        self.group = row - offset  # each row's real token
        self.local_start = torch.where(offset > 0, self.group + 1, 0).to(torch.int32)
        self.local_len = offset.to(torch.int32)
        self.ctx_shift = 1 - offset  # m_i sits at its real token's position + i and sees up to that token
        self.mask_rows = row[offset > 0]
        self.mask_vectors = head.mask_embedding(offset[offset > 0] - 1)  # fixed per row: no kernel a step

    def _forward(self, key: int, shape: StepBatch) -> None:
        i64, i32 = self.inputs[key]
        args = (key, self.width, self.block_size, self.pad_q, None, False, True)
        ids, pos, meta = unpack(i64, i32, shape, *args)
        n, masks = ids.shape[0], key * self.k * (self.k + 1)
        # padding rows (slot -1) see no cache; their local rows have no slot either, so they read nothing
        ctx = (pos + self.ctx_shift[:n]) * (meta.slot_mapping >= 0)
        meta.visibility = TokenVisibility(ctx, self.local_start[:n], self.local_len[:n], pos)
        meta.embed_rows = (self.mask_rows[:masks], self.mask_vectors[:masks])
        with attention_context(meta):
            self.hidden[:n] = self.model(ids, pos)

    def fits(self, batch: StepBatch) -> bool:
        """Every chunk of the step is an MTP chunk with k proposals, and a bucket holds them."""
        n = len(batch.seq_lens)
        return len(batch.mask_rows) == n * self.k * (self.k + 1) and self.bucket(n) is not None


class DraftGraphs:
    """The drafting of a step MtpGraphs replayed, captured per batch bucket: index the mask rows after
    each sequence's kept proposals, then k passes of the sampler head (embedding, fc1, fc2, norm, LM
    head or the draft vocabulary's rows, argmax). It reads the graphs' static hidden rows; each step's
    kept counts and bonus tokens are copied into static buffers. Padding sequences draft from their
    (finite) padding rows and stale counts, always within their own rows; nobody reads their drafts."""

    def __init__(self, step: MtpStep):
        graphs = step.graphs
        self.step, self.hidden, self.buckets = step, graphs.hidden, graphs.buckets
        top, device = max(graphs.buckets), graphs.hidden.device
        self.first = torch.arange(top, device=device) * step.graphs_q
        self.offsets = step.mask_offsets(self.first)
        self.accepted = torch.zeros(top, dtype=torch.long, device=device)
        self.bonus = torch.zeros(top, dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.out: dict[int, torch.Tensor] = {}

    def _draft(self, b: int) -> torch.Tensor:
        step, accepted, bonus = self.step, self.accepted[:b], self.bonus[:b]
        return step.drafts(self.hidden, self.first[:b], accepted, bonus, self.offsets[:b])

    @torch.inference_mode()
    def capture(self, pool) -> None:
        """Largest bucket first, in `pool` (the runner's graphs' own): their temporaries share memory,
        while each graph's outputs (`out`, and the MTP graphs' hidden rows it reads) stay allocated."""
        for b in reversed(self.buckets):
            self._draft(b)  # warm-up: compiles every kernel outside capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.out[b] = self._draft(b)
            self.graphs[b] = graph
        torch.cuda.synchronize()

    def run(self, n: int, accepted: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
        """The drafts [n, k] of a graph step's n sequences (a copy: the next replay reuses the buffer)."""
        b = next(b for b in self.buckets if b >= n)
        self.accepted[:n].copy_(accepted)
        self.bonus[:n].copy_(bonus)
        self.graphs[b].replay()
        return self.out[b][:n].clone()
