"""The draw of a step's plain rows: one token per sampling sequence, from the logits of its last
scheduled position (n > 1 siblings share one logits row).

Each sample of a seeded request draws from its own stream (seed, sample index), so its tokens depend on
the seed alone; an unseeded one from (engine base, sequence id). Rows with a grammar take its token
bitmask, filled on the host (`bitmasks`) once the forward is enqueued, so on a GPU the fill overlaps it.
Speculative steps (engine/runner/spec_step.py) draw their plain rows here too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from engine.device.uploader import Uploader
from engine.runner.step_inputs import StepBatch
from engine.sampling.rows import SamplingRow
from engine.sampling.sampler import PendingSample, PromptScores, Sampler, TokenMask, row_kinds, stream_key
from engine.sched.request import Sequence
from engine.structured.state import BitmaskFiller


class PlainDraw:
    """Draws the plain rows of each step with `sampler`, under the grammar masks of `bitmasks`."""

    def __init__(self, sampler: Sampler, bitmasks: BitmaskFiller, upload: Uploader, unseeded_base: int):
        self.sampler, self.bitmasks, self.upload = sampler, bitmasks, upload
        self.unseeded_base = unseeded_base
        self._no_samples = torch.empty(0, dtype=torch.long, device=upload.device)  # a step that only scores
        # the last (sampling rows, constrained rows) and their device row maps: a decode batch keeps
        # the same rows for many steps, and an upload costs more host time than the draw's launch
        self._mask_rows: tuple[tuple[int, list[int]], torch.Tensor, torch.Tensor] | None = None

    def row(self, seq: Sequence, position: int) -> SamplingRow:
        """The sampling row of `seq` drawing the token at `position`, on its own noise stream."""
        params = seq.request.params
        if params.greedy:
            key = 0  # draws nothing: the argmax needs no noise (and the hot batch-1 path no key)
        elif params.seed is not None:
            key = stream_key(params.seed, seq.index)
        else:
            key = stream_key(self.unseeded_base, seq.seq_id)
        return SamplingRow(params, seq.token_ids, seq.num_prompt, key, position)

    def rows(self, batch: StepBatch) -> list[SamplingRow]:
        """The sampling row of each sampling sequence of the batch."""
        row = self.row
        return [row(s, p) for s, p in zip(batch.samplers, batch.draw_positions, strict=True)]

    def select(self, batch: StepBatch, logits: torch.Tensor) -> torch.Tensor:
        """The logits of each sampling sequence, from those of the batch's logit rows."""
        if batch.shares_logit_rows:
            logits = logits.index_select(0, self.upload.values("sample_rows", batch.sample_rows, torch.long))
        return logits

    @staticmethod
    def plain(batch: StepBatch, rows: list[SamplingRow]) -> bool:
        """True when the step's draw is one token per logit row from the bare logits (DrawGraphs can
        take it): no n > 1 fan-out, grammar, logprobs, logit_bias, penalty or top-k / top-p / min-p."""
        if batch.shares_logit_rows or any(s.grammar is not None for s in batch.samplers):
            return False
        logprobs, processors, _, filters = row_kinds(rows)
        return not (logprobs or processors or filters)

    def scores_only(self, scores: PromptScores | None) -> PendingSample | None:
        """The result of a step that samples nothing: its prompt scores, if any."""
        return None if scores is None else PendingSample(self._no_samples, None, [], scores)

    def start(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        scores: PromptScores | None,
        samplers: list[Sequence],
        background: bool = False,
    ) -> Callable[[], PendingSample]:
        """Begin the draw: with constrained rows, their bitmask fill on the host (the forward is already
        enqueued, so on a GPU this overlaps it; in the `background`, it overlaps the caller's work too).
        The returned function joins the fill and enqueues the sampling."""
        constrained = [i for i, s in enumerate(samplers) if s.grammar is not None]
        if not constrained:
            return functools.partial(self.sample, logits, rows, scores, None, constrained)
        join = self.bitmasks.start([samplers[i].grammar for i in constrained], background)
        return lambda: self.sample(logits, rows, scores, join, constrained)

    @torch.inference_mode()
    def sample(self, logits, rows, scores, join_mask, constrained: list[int]) -> PendingSample:
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
            maps = self.upload.segments("mask_rows", [constrained, row_of], torch.long)  # one upload
            self._mask_rows = (key, *maps)
        return self._mask_rows[1], self._mask_rows[2]
