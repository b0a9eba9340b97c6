"""The host side of speculative decoding: who speculates this step, with which proposals, and how it went.

Before each scheduled step, `prepare` gives every running sequence its lookahead: the number of
proposal positions the scheduler adds to its decode chunk (engine/sched/scheduler.py). n-gram proposals are
made here, on the host (engine/spec/ngram.NgramIndex); a draft model's are made on the device by
engine/runner/draft_runner.py once the step is scheduled (always k of them). After verification,
`record` counts proposed and accepted tokens per sequence and for the engine's stats, and stops a
sequence whose acceptance is too low to pay (SpeculativeConfig.disable_below_acceptance).

A sequence speculates only as a plain decode: prompt done, one pending token, no grammar (its matcher
would have to check every proposal), no logprobs, room for k more positions under max_model_len, and
at least two tokens left of max_tokens. Forced tokens (budget forcing, the calculator tool) do not stop
it: the host appends a chunk's verified tokens one by one through the output processor, exactly as a
plain decode's, and stops after the first that brings forced tokens (engine/output/sink.TokenSink.accept);
`record` then gets the proposals before it as the accepted ones, for whatever proposer made them.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.sched.request import SeqStatus, Sequence
from engine.spec.ngram import NgramIndex
from engine.spec_config import SpeculativeConfig


@dataclass
class SpecState:
    """One sequence's speculation: its n-gram index, what the draft model's KV holds, its record."""

    ngram: NgramIndex | None = None
    draft_computed: int = 0  # positions whose draft-model KV is valid (<= the target's num_computed)
    proposed: int = 0
    accepted: int = 0
    off: bool = False  # stopped for low acceptance: plain decoding from now on
    # gated-LoRA MTP: the drafts the last verified step made, valid while the sequence holds exactly
    # mtp_for tokens (they follow its last token); any other token count means they are stale
    mtp_drafts: list[int] | None = None
    mtp_for: int = -1


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.mtp = config.method == "gated_lora_mtp"
        # positions past the pending token a chunk may reach: its k proposals, and with MTP the k mask
        # tokens after the last of them
        self.reach = 2 * self.k if self.mtp else self.k
        # spec_forced_cuts: verified chunks whose tokens after a forced one (budget forcing, a tool) were
        # dropped, their positions having scored a history the sequence does not have
        self.stats = {
            "spec_draft_tokens": 0,
            "spec_accepted_tokens": 0,
            "spec_verify_rows": 0,
            "spec_forced_cuts": 0,
        }

    @staticmethod
    def state(seq: Sequence) -> SpecState:
        if seq.spec is None:
            seq.spec = SpecState()
        return seq.spec

    def batch_off(self, running: list[Sequence]) -> bool:
        limit = self.config.batch_limit
        return limit is not None and len(running) > limit

    def eligible(self, seq: Sequence) -> bool:
        params = seq.request.params
        return (
            seq.status is SeqStatus.RUNNING
            and seq.num_computed >= seq.num_prompt
            and seq.num_tokens - seq.num_computed == 1
            and seq.grammar is None
            and params.logprobs is None
            and (seq.spec is None or not seq.spec.off)
            and seq.num_tokens + self.reach <= self.max_model_len
            and params.max_tokens - seq.num_output >= 2
        )

    def idle(self, running: list[Sequence]) -> bool:
        """No running sequence would speculate next step (then a step may be scheduled ahead)."""
        return self.batch_off(running) or not any(self.eligible(s) for s in running)

    def prepare(self, running: list[Sequence]) -> None:
        """Set every running sequence's lookahead (and its proposals, for n-gram) for the next step."""
        off = self.batch_off(running)
        chosen = []
        for seq in running:
            seq.lookahead, seq.draft, seq.mask_tokens = 0, [], 0
            if not off and self.eligible(seq):
                chosen.append(seq)
                if self.config.method == "ngram":
                    seq.draft = self._ngram(seq)
                elif self.mtp:
                    seq.draft, seq.mask_tokens = self._mtp(seq), self.k
        if self.config.method == "ngram" and not any(s.draft for s in chosen):
            return  # no lookup matched: a plain decode step
        # k positions each, padded past the proposals: every speculating row of the step then has the
        # same query length, which one captured CUDA graph runs
        for seq in chosen:
            seq.lookahead = self.k

    def _ngram(self, seq: Sequence) -> list[int]:
        cfg, state = self.config, self.state(seq)
        if state.ngram is None:
            state.ngram = NgramIndex(cfg.prompt_lookup_max, cfg.prompt_lookup_min)
        k = min(self.k, seq.request.params.max_tokens - seq.num_output - 1)
        return self._padded(seq, state.ngram.propose(seq.token_ids, k), k)

    def _mtp(self, seq: Sequence) -> list[int]:
        """The drafts the previous step's mask tokens made for this sequence, while still valid (none
        after prefill, a preemption, forced tokens or a plain step: its chunk then only drafts)."""
        state = self.state(seq)
        k = min(self.k, seq.request.params.max_tokens - seq.num_output - 1)
        draft = state.mtp_drafts[:k] if state.mtp_drafts and state.mtp_for == seq.num_tokens else []
        state.mtp_drafts = None
        return self._padded(seq, draft, k)

    def _padded(self, seq: Sequence, draft: list[int], k: int) -> list[int]:
        if self.config.synthetic_acceptance_rate is not None:  # benchmarks: always k positions to verify
            draft = draft + [seq.token_ids[-1]] * (k - len(draft))
        return draft

    def keep_drafts(self, seq: Sequence, last: int, drafts: list[int]) -> None:
        """MTP: store the drafts a verified step made after `last`, its final emitted token, if that is
        still the sequence's last token (nothing was forced after it)."""
        if seq.token_ids and seq.token_ids[-1] == last:
            state = self.state(seq)
            state.mtp_drafts, state.mtp_for = drafts, seq.num_tokens

    def record(self, seq: Sequence, positions: int, num_accepted: int, cut: bool = False) -> None:
        """Count one verified chunk of `positions` scored proposal positions (n-gram: seq.draft are the
        real proposals among them, the rest padding) whose first `num_accepted` proposals stand in the
        sequence (`cut`: verified tokens after a forced one were dropped); stop the sequence speculating
        when its acceptance does not pay."""
        num_draft = positions if self.config.method == "draft_model" else len(seq.draft)
        state, stats = self.state(seq), self.stats
        state.proposed += num_draft
        state.accepted += num_accepted
        stats["spec_draft_tokens"] += num_draft
        stats["spec_accepted_tokens"] += num_accepted
        stats["spec_verify_rows"] += 1
        stats["spec_forced_cuts"] += cut
        # the draft's KV of the accepted proposals is valid; after a forced cut, num_accepted stops before
        # the forced token, so the draft's KV of the dropped positions is left out too
        if self.config.method == "draft_model":
            state.draft_computed += min(num_accepted, self.k - 1)
        metrics = seq.request.metrics
        metrics.spec_draft_tokens += num_draft
        metrics.spec_accepted_tokens += num_accepted
        cfg = self.config
        if (
            state.proposed >= cfg.acceptance_window
            and state.accepted < cfg.disable_below_acceptance * state.proposed
        ):
            state.off = True

    def get_stats(self) -> dict:
        s = self.stats
        rows, drafts, accepted = s["spec_verify_rows"], s["spec_draft_tokens"], s["spec_accepted_tokens"]
        return {
            **s,
            "spec_acceptance_rate": accepted / drafts if drafts else 0.0,
            # tokens each verified chunk emitted: its accepted proposals plus the one drawn from the target
            "spec_mean_accepted_length": (accepted + rows) / rows if rows else 0.0,
        }
