"""The scheduler's output contract: what one step computes, and what must happen around its forward.

The scheduler (engine/sched/scheduler.py) fills a SchedulerOutput each step; the model runner builds the
step's tensors from it, the engine applies its block copies and host-tier transfers first, and
update_computed reads it back once the forward is done. Pure data, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sched.host_tier import TierTransfers
from engine.sched.request import Sequence


@dataclass(slots=True)
class ScheduledChunk:
    seq: Sequence
    start: int  # first position computed this step (== seq.num_computed when scheduled)
    num_tokens: int
    samples: list[Sequence] = field(default_factory=list)  # sequences that sample from the last position
    # speculative decoding: the chunk's last num_draft tokens are proposals, not yet in seq.token_ids;
    # verification accepts num_accepted of them (set by the engine before update_computed)
    num_draft: int = 0
    num_accepted: int = 0


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    block_copies: list[tuple[int, int]]  # (src, dst) KV block copies to perform before the forward
    num_preempted: int = 0
    # a step scheduled ahead: row i's input token is the one sampled by row prev_rows[i] of the step
    # before, which the host has not seen yet (see schedule_ahead)
    prev_rows: list[int] | None = None
    # indexes into `chunks` of prompt chunks whose logits at every position are wanted (a request with
    # SamplingParams.prompt_logprobs whose prompt has not been scored yet); empty in almost every step
    prompt_logprob_chunks: list[int] = field(default_factory=list)
    # a step scheduled ahead with a row whose draw reads host state the previous step's tokens change
    # (a grammar matcher, penalties' token history): its draw waits for them (DeferredSample)
    draw_late: bool = False
    # copies between the GPU pool and the host KV tier, done before this step's forward writes
    kv_transfers: TierTransfers | None = None
    # batches of such copies, in flight, into blocks of sequences this step admits: its compute waits
    kv_waits: set[int] = field(default_factory=set)
    # multi-LoRA: the adapters (LoRARequest.key) running sequences hold, whose GPU slots the runner
    # keeps; None without LoRA
    active_loras: set | None = None

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks
