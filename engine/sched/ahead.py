"""The plan of a step scheduled ahead (Scheduler.schedule_ahead): which running sequences it computes,
from where, and which of them take their input token from the step still on the device.

Pure functions of the scheduler's running list and the step in flight; no torch.
"""

from __future__ import annotations

from engine.sched.output import ScheduledChunk, SchedulerOutput
from engine.sched.request import Sequence

# (sequence, first position, tokens, sampling row of the step in flight fed back, or None)
PlanEntry = tuple[Sequence, int, int, int | None]


def plan(running: list[Sequence], prev: SchedulerOutput, max_model_len: int) -> list[PlanEntry] | None:
    """Every running sequence as it will stand once `prev` is in: fed-back decodes in row order,
    decodes of host tokens, prompt chunks. None where a step must not be scheduled ahead of `prev`
    (it verifies proposals, forks, or a sampling sequence needs host tokens next)."""
    in_prev: dict[int, tuple[ScheduledChunk, int | None]] = {}
    row = 0
    for chunk in prev.chunks:
        if chunk.num_draft or len(chunk.samples) > 1:
            return None  # verification decides the next input; a fork's children start sampling
        in_prev[chunk.seq.seq_id] = (chunk, row if chunk.samples else None)
        row += len(chunk.samples)
    fed, decodes, prompts = [], [], []
    for seq in running:
        entry = in_prev.get(seq.seq_id)
        if entry is None:  # not in flight: the host holds its state
            entry = (seq, seq.num_computed, seq.num_pending, None)
            (decodes if seq.prompt_done else prompts).append(entry)
            continue
        chunk, row = entry
        end = chunk.start + chunk.num_tokens
        if row is None:  # mid-prompt: the rest of its tokens are on the host
            prompts.append((seq, end, seq.num_tokens - end, None))
            continue
        params = seq.request.params
        if params.needs_host_tokens:
            return None
        # after `prev` the sequence holds end + 1 tokens, end + 1 - num_prompt of them output
        if end + 1 - seq.num_prompt < params.max_tokens and end + 1 < max_model_len:
            fed.append((seq, end, 1, row))
    fed.sort(key=lambda entry: entry[3])
    return fed + decodes + prompts


def only_fed_back_decodes(prev: SchedulerOutput, entries: list[PlanEntry]) -> bool:
    """`prev` only decodes and every planned chunk takes its input from it."""
    decodes = all(c.num_tokens == 1 and c.samples for c in prev.chunks)
    return decodes and all(row is not None for *_, row in entries)


def within_budget(entries: list[PlanEntry], budget: int) -> list[PlanEntry]:
    """The plan's chunks cut to the step's token budget, in order."""
    kept = []
    for seq, start, n, row in entries:
        if budget == 0:
            break
        n = min(n, budget)
        if n:
            kept.append((seq, start, n, row))
            budget -= n
    return kept
