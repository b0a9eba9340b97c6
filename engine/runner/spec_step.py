"""The speculative part of a step: proposals before the target's forward, their verification after it.

ModelRunner.execute asks `propose` on every step of an engine that speculates; when it returns
Proposals, `verify` takes the place of the plain draw. Proposals come from the host (n-gram: each
sequence's `draft`, which build_batch packs into the input ids) or from a draft model (`proposer`, a
DraftRunner: it mirrors every step into its own KV and writes its proposals over the input rows on the
device). Steps scheduled ahead carry no proposals; the draft catches up on them at its next mirror.
The step's plain rows (prompt chunks, sequences that do not speculate, constrained rows) draw through
`draw` as in any step, grammar masks included; `verifier` turns the speculating rows' logits into the
tokens they emit (engine/spec/sampler.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.device.uploader import Uploader
from engine.runner.draft_runner import DraftOutput, DraftRunner
from engine.runner.mtp_step import MtpStep
from engine.runner.plain_draw import PlainDraw
from engine.runner.step_inputs import StepBatch
from engine.sampling.rows import SamplingRow
from engine.sampling.sampler import PromptScores
from engine.sched.output import SchedulerOutput
from engine.spec.sampler import PendingSpec, SpecRows, SpecSampler


@dataclass
class Proposals:
    """The speculating rows of one step and where their proposals are."""

    rows: list[SamplingRow]  # the sampling rows of the chunks with proposals, in chunk order
    drafts: DraftOutput | None  # a draft model's, on the device; None: the host's (Sequence.draft)
    draft_ids: tuple[torch.Tensor, torch.Tensor] | None = None  # (input rows, ids) the drafts fill


class SpecStep:
    """Proposes before and verifies after the target's forward, for an engine that speculates."""

    def __init__(
        self,
        draw: PlainDraw,
        verifier: SpecSampler,
        proposer: DraftRunner | None,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
        upload: Uploader,
    ):
        self.draw, self.verifier, self.proposer = draw, verifier, proposer
        self.compute_logits, self.upload = compute_logits, upload
        self.mtp: MtpStep | None = None  # gated-LoRA MTP: the step also drafts (engine/runner/mtp_step.py)

    def propose(self, out: SchedulerOutput, batch: StepBatch) -> Proposals | None:
        """The step's speculating rows and their proposals; None when no chunk has any."""
        row = self.draw.row
        rows = [row(s, s.num_computed + 1) for s in batch.spec_samplers]
        drafts = None
        if self.proposer is not None and out.prev_rows is None:
            drafts = self.proposer.propose(out, rows)  # mirrors the step even when nothing speculates
        if not rows:
            return None
        if drafts is None:
            return Proposals(rows, None)
        ids = self.upload.values("draft_rows", batch.spec_draft_rows, torch.long)
        return Proposals(rows, drafts, (ids, drafts.tokens.reshape(-1)))

    def verify(
        self, batch: StepBatch, hidden: torch.Tensor, scores: PromptScores | None, proposals: Proposals
    ) -> PendingSpec:
        """One logits pass over the plain rows' draw positions and every scored position of the
        speculating rows; the plain rows draw as in any step, the others verify."""
        index = self.upload.values("logit_rows", batch.logit_rows + batch.spec_logit_rows, torch.long)
        logits = self.compute_logits(hidden.index_select(0, index))
        n = len(batch.logit_rows)
        if batch.samplers:
            own, rows = self.draw.select(batch, logits[:n]), self.draw.rows(batch)
            plain = self.draw.start(own, rows, scores, batch.samplers)()
        else:
            plain = self.draw.scores_only(scores)
        drafter = self.mtp.drafter(batch, hidden) if self.mtp is not None and batch.mask_rows else None
        return self.verifier(logits[n:], _spec_rows(batch, proposals), plain, drafter)


def _spec_rows(batch: StepBatch, proposals: Proposals) -> SpecRows:
    """The verifier's view of the speculating rows: every row scores batch.spec_num_draft positions;
    host proposals may be fewer (the rest is padding), a draft model's never are."""
    drafts = proposals.drafts
    if drafts is None:
        host = [s.draft for s in batch.spec_samplers]
        return SpecRows(proposals.rows, batch.spec_num_draft, [len(d) for d in host], host)
    num = batch.spec_num_draft
    return SpecRows(proposals.rows, num, num, None, drafts.tokens, drafts.probs)
