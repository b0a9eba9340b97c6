"""The model as rank 0 of a tensor-parallel group runs it: each forward and each logits computation
first reaches the other ranks, which run the same computation on their shares.

`TPModel` wraps rank 0's share, so the runner, the CUDA graphs and the sampler call it as they call a
whole model. A forward sends its header (engine/runner/tp_wire.py), broadcasts the step's input
buffers and runs; every rank then computes the same hidden rows. Its logits: rank 0 broadcasts the
hidden rows it wants scored (whatever rows the caller picked: sampling rows, prompt-logprob rows,
speculative positions), every rank computes its vocabulary columns, and rank 0 gathers them. Where the
rows are the last forward's own (a decode step samples every row), no broadcast: each rank scores its
copy of them (`compute_own_logits`). Sampling
stays on rank 0; so does a gated-LoRA MTP head, whose drafts reach the ranks through `embed` (each
draft's previous token) and the logits computation.

CUDA graphs: while the ranks capture in lockstep (TPGroup.in_lockstep), a forward sends no header and
only broadcasts, so each rank's graph of a bucket holds the broadcast of that bucket's static buffers.
`announce_replays` makes each of rank 0's graphs name its bucket to the workers before it replays, and
each worker replays its own graph of that bucket, whose broadcast receives rank 0's buffers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from engine.models.attention_context import get_context
from engine.runner import tp_wire
from engine.runner.graph_sets import capture_sets
from engine.runner.tp_group import TPGroup


class TPModel(nn.Module):
    """Rank 0's share of the model, called as the whole model: forwards and logits reach every rank."""

    def __init__(self, inner: nn.Module, group: TPGroup, vocab_size: int):
        super().__init__()
        self.inner, self.group, self.vocab_size = inner, group, vocab_size

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        header, spans = tp_wire.encode_forward(input_ids, positions, get_context())
        self.group.send(header)
        with self.group.guard():
            for span in spans:
                dist.broadcast(span, 0)
            return self.inner(input_ids, positions)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input vectors of `input_ids` [N] (a gated-LoRA MTP draft's previous tokens): every rank
        looks up its vocabulary rows, and the all-reduce sums them."""
        input_ids = input_ids.to(torch.long).contiguous()  # the workers receive int64
        self.group.send([tp_wire.EMBED, input_ids.shape[0]])
        with self.group.guard():
            dist.broadcast(input_ids, 0)
            return self.inner.embed(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] on rank 0, from every rank's columns."""
        hidden = hidden.contiguous()
        self.group.send([tp_wire.LOGITS, hidden.shape[0]])
        with self.group.guard():
            dist.broadcast(hidden, 0)
            return gather_logits(self.inner.compute_logits(hidden), self.group.shard.size, self.vocab_size)

    def compute_own_logits(self, hidden: torch.Tensor, n: int) -> torch.Tensor:
        """compute_logits of the last forward's first `n` hidden rows, `hidden` being them with the
        last repeated up to its row count. Every rank holds those rows already, with the same bits:
        each all-reduce path leaves every rank the same sum (the fused kernel and PyTorch's one-shot add
        the ranks' parts in rank order on each rank; NCCL sends one sum to all). So nothing is
        broadcast: each worker pads its own rows alike."""
        hidden = hidden.contiguous()
        self.group.send([tp_wire.OWN_LOGITS, n, hidden.shape[0]])
        with self.group.guard():
            return gather_logits(self.inner.compute_logits(hidden), self.group.shard.size, self.vocab_size)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "inner":
                raise
            return getattr(self.inner, name)  # the family's attributes (cfg, ...)


def gather_logits(local: torch.Tensor, size: int, vocab_size: int | None) -> torch.Tensor | None:
    """Every rank's logits columns, concatenated on rank 0 (vocab_size None: this is a worker)."""
    if vocab_size is None:
        dist.gather(local, None, dst=0)
        return None
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.gather(local, parts, dst=0)
    logits = torch.cat(parts, dim=1)
    return logits if logits.shape[1] == vocab_size else logits[:, :vocab_size].contiguous()


class _AnnouncedGraph:
    """A captured graph of rank 0 that names its bucket to the workers before each replay."""

    def __init__(self, graph, group: TPGroup, kind: int, key: int):
        self.graph, self.group, self.header = graph, group, [tp_wire.REPLAY, kind, key]

    def replay(self) -> None:
        self.group.send(self.header)
        with self.group.guard():
            self.graph.replay()

    def __getattr__(self, name: str):
        return getattr(self.graph, name)


def capture_on_all_ranks(group: TPGroup, model: TPModel, *args) -> tuple[dict, object]:
    """capture_sets on rank 0 while every worker runs it too, then announced replays."""
    group.send([tp_wire.CAPTURE])
    with group.in_lockstep(), group.guard():
        graphs, mixed = capture_sets(model, *args)
    announce_replays(group, graphs, mixed)
    return graphs, mixed


class CaptureModel(nn.Module):
    """A worker's share as its graphs capture it: each forward first receives rank 0's inputs into
    its own (static) input buffers, the broadcast rank 0's graph of the same bucket sends."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        for span in tp_wire.encode_forward(input_ids, positions, get_context())[1]:
            dist.broadcast(span, 0)
        return self.inner(input_ids, positions)


def announce_replays(group: TPGroup, graphs: dict, mixed) -> None:
    """Wrap every captured graph of rank 0 (kind: query length of a uniform set, 0 for mixed)."""
    sets = [(q, g) for q, g in graphs.items()] + ([(0, mixed)] if mixed is not None else [])
    for kind, graph_set in sets:
        for key, graph in list(graph_set.graphs.items()):
            graph_set.graphs[key] = _AnnouncedGraph(graph, group, kind, key)
