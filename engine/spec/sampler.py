"""Verification of one step's proposals on the device: the target's logits at every proposed position
become the tokens each speculating sequence emits (engine/spec/verify.py holds the rule itself).

Row i of a step proposed d_i tokens and the target scored d_i + 1 positions (logits rows in order).
Logits processors (logit_bias, penalties) see, at position j, the sequence's tokens followed by its
first j proposals, exactly the history a plain decode would have had there.
* Greedy rows: the argmax of every position goes to the host, which accepts the longest agreeing
  prefix plus one token: the argmax where they first differ (or after the last proposal).
* Sampled rows: temperature, top-k / top-p / min-p, then `verify` on the device with uniforms keyed by
  (the sequence's stream, position), so a seeded request emits the same text whatever its batch.
  A draft model's q is its own softmax(logits / T); n-gram proposals are one-hot.
* `synthetic_acceptance_rate` (benchmarks only) accepts each proposal with that probability, then
  emits the target's argmax. The coin of a proposal is a hash of its request (prompt and noise stream)
  and its position, so the same requests meet the same coins whatever the proposer, batch or step:
  proposers compared at one rate verify the same tokens per step, not just the same on average.
The step's one sync copies the argmaxes, the sampled rows' tokens and a draft model's proposals.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.device.stream import record
from engine.sampling.rows import RowTensors, SamplingRow
from engine.sampling.sampler import (
    EnqueuedDraw,
    PendingSample,
    Sampler,
    SampleResult,
    _no_processor,
    stream_key,
)
from engine.spec.verify import verify
from kernels import ops

_M64 = (1 << 64) - 1
_C1 = 0xBF58476D1CE4E5B9 - (1 << 64)  # SplitMix64's multipliers as signed int64
_C2 = 0x94D049BB133111EB - (1 << 64)
VERIFY_SALT = 0x5EC  # uniforms of verification differ from a draft model's noise (DRAFT_SALT)


def _srl(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (>> is arithmetic in torch)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _srl(z, 30)) * _C1
    z = (z ^ _srl(z, 27)) * _C2
    return z ^ _srl(z, 31)


def keyed_uniforms(keys: torch.Tensor, counters: torch.Tensor, cols: int, salt: int) -> torch.Tensor:
    """[rows, cols] float64 uniforms in [0, 1), a function of (key, counter, column, salt) only."""
    col = torch.arange(cols, device=keys.device, dtype=torch.long)
    z = _mix(keys[:, None] ^ _mix(counters[:, None] * 64 + col[None, :] + salt * 4096))
    return _srl(z, 11).double() / float(1 << 53)


@dataclass
class SpecRows:
    """The speculating rows of a step: their sampling rows, scored proposal positions (`positions`:
    the target scored positions + 1 rows each), real proposals among them (`num_draft`; the rest are
    padding that keeps the step's shape uniform for a CUDA graph), host proposals (None where a draft
    model's are on the device: `draft_tokens` [rows, k], `draft_probs` [rows, k, V] or None)."""

    rows: list[SamplingRow]
    positions: list[int]
    num_draft: list[int]
    host_drafts: list[list[int]] | None
    draft_tokens: torch.Tensor | None = None
    draft_probs: torch.Tensor | None = None


class PendingSpec(EnqueuedDraw):
    """A step's draws: its plain rows (a PendingSample or None) and its speculating rows, copies to the
    host enqueued; `resolve` waits for them and returns a SampleResult with `spec_tokens` set."""

    def __init__(self, plain, spec: SpecRows, argmax, sampled, synthetic: float | None, drafts=None):
        self.plain, self.spec, self.synthetic = plain, spec, synthetic
        self.sampled = plain.sampled if plain is not None else None
        self.has_drafts = drafts is not None  # gated-LoRA MTP: the next step's drafts [rows, k]
        tensors = [argmax] + ([drafts] if self.has_drafts else [])
        if spec.host_drafts is None:
            tensors.append(spec.draft_tokens)
        if sampled is not None:
            tensors += [sampled[0], sampled[1]]
        self._event = None
        if argmax.is_cuda:
            tensors = [t.to("cpu", non_blocking=True) for t in tensors]
            self._event = torch.cuda.Event()
            record(self._event, argmax.device)
        self._host = tensors
        self._sampled_index = sampled[2] if sampled is not None else []

    def resolve(self) -> SampleResult:
        result = self.plain.resolve() if self.plain is not None else SampleResult([], [])
        if self._event is not None:
            self._event.synchronize()
        host = [t.tolist() for t in self._host]
        argmax = host.pop(0)
        if self.has_drafts:
            result.spec_drafts = host.pop(0)
        drafts = self.spec.host_drafts if self.spec.host_drafts is not None else host.pop(0)
        if self.synthetic is not None:  # benchmarks: every row, sampled or not, by the coin alone
            coin = synthetic_coin(self.synthetic, self.spec.rows)
            result.spec_tokens = _accept_prefix(argmax, drafts, self.spec, coin)
            return result
        tokens = _accept_prefix(argmax, drafts, self.spec, lambda i, a, x, t: x == t)
        if host:  # sampled rows: verify's tokens, PAD after the emitted ones
            for row, (n_acc, toks) in zip(self._sampled_index, zip(host[0], host[1])):
                tokens[row] = toks[: n_acc + 1]
        result.spec_tokens = tokens
        return result


def _accept_prefix(argmax: list[int], drafts, spec: SpecRows, accept) -> list[list[int]]:
    """Per row i: its proposals a = 0, 1, ... while accept(i, a, proposal, target argmax there) holds,
    then the argmax where it first fails (or after the last real proposal)."""
    out, at = [], 0
    for i, (draft, d, pos) in enumerate(zip(drafts, spec.num_draft, spec.positions)):
        a = 0
        while a < d and accept(i, a, draft[a], argmax[at + a]):
            a += 1
        out.append(list(draft[:a]) + [argmax[at + a]])
        at += pos + 1
    return out


def synthetic_coin(alpha: float, rows: list[SamplingRow]) -> Callable[[int, int, int, int], bool]:
    """accept(i, a, ...) for synthetic acceptance: row i's proposal a (at position rows[i].counter + a)
    is kept with probability alpha, by a hash of its request (prompt ids and noise stream) and position."""
    keys = [hash((tuple(r.prompt_ids), r.key)) & _M64 for r in rows]
    bar = alpha * 2**63  # stream_key is uniform over 63 bits
    return lambda i, a, x, t: stream_key(keys[i], rows[i].counter + a) < bar


class SpecSampler:
    def __init__(self, sampler: Sampler, synthetic: float | None = None):
        self.sampler = sampler
        self.tensors = RowTensors(sampler.upload, sampler.vocab_size, "spec_")
        self.synthetic = synthetic

    @torch.inference_mode()
    def __call__(
        self, logits: torch.Tensor, spec: SpecRows, plain: PendingSample | None, drafter=None
    ) -> PendingSpec:
        """logits [sum(d_i + 1), V]: each speculating row's positions in order. `drafter` (gated-LoRA
        MTP): (kept proposals [rows], the token after them [rows]) on the device -> next drafts."""
        sampled_rows = [i for i, r in enumerate(spec.rows) if not r.params.greedy]
        processors = not all(_no_processor(r.params) for r in spec.rows)
        # per-position rows only where something reads them: the common greedy step needs none
        per_pos = self._position_rows(spec) if processors or sampled_rows else None
        raw = logits
        if processors:
            logits = self.sampler.apply_processors(logits.float(), per_pos)
        argmax = ops.argmax(logits)
        sampled = self._verify_sampled(logits, raw, spec, per_pos, sampled_rows) if sampled_rows else None
        drafts = None if drafter is None else drafter(*self._outcome(argmax, spec, sampled))
        return PendingSpec(plain, spec, argmax, sampled, self.synthetic, drafts)

    def _outcome(self, argmax: torch.Tensor, spec: SpecRows, sampled) -> tuple[torch.Tensor, torch.Tensor]:
        """Per speculating row, on the device and before the host hears of it: how many host proposals
        it keeps and the token it emits after them (greedy: the longest prefix agreeing with the argmax,
        then the argmax; sampled: verify's). With a synthetic rate the host decides later: 0 kept."""
        upload, width = self.sampler.upload.values, max(spec.positions) + 1
        starts = itertools.accumulate([p + 1 for p in spec.positions[:-1]], initial=0)
        index = [s + min(j, p) for s, p in zip(starts, spec.positions) for j in range(width)]
        am = argmax.index_select(0, upload("mtp_argmax", index, torch.long)).view(-1, width)
        if self.synthetic is None and width > 1:
            host = [t for d in spec.host_drafts for t in [*d, *[-1] * (width - 1 - len(d))]]  # -1: no match
            agree = am[:, :-1] == upload("mtp_drafts", host, torch.long).view(-1, width - 1)
            accepted = agree.long().cumprod(1).sum(1)
        else:
            accepted = torch.zeros(am.shape[0], dtype=torch.long, device=am.device)
        bonus = am.gather(1, accepted[:, None]).squeeze(1)
        if sampled is not None:
            num_accepted, tokens, rows = sampled
            at = upload("mtp_sampled", rows, torch.long)
            accepted = accepted.index_copy(0, at, num_accepted)
            bonus = bonus.index_copy(0, at, tokens.gather(1, num_accepted[:, None]).squeeze(1))
        return accepted, bonus

    def _position_rows(self, spec: SpecRows) -> list[SamplingRow]:
        """One SamplingRow per scored position; its history holds the proposals before it (only built
        out where a penalty reads it)."""
        drafts = spec.host_drafts
        if drafts is None and not all(_no_processor(r.params) for r in spec.rows):
            drafts = spec.draft_tokens.tolist()  # a draft model's proposals, needed by penalties
        out = []
        for i, (r, pos) in enumerate(zip(spec.rows, spec.positions)):
            plain = _no_processor(r.params)
            for j in range(pos + 1):
                history = r.token_ids if plain or j == 0 else r.token_ids + list(drafts[i][:j])
                out.append(SamplingRow(r.params, history, r.num_prompt, r.key, r.counter + j))
        return out

    def _verify_sampled(self, logits, raw, spec: SpecRows, per_pos, sampled_rows: list[int]):
        """Lossless verification of the sampled rows, padded to their longest proposal."""
        starts = [0]
        for pos in spec.positions:
            starts.append(starts[-1] + pos + 1)
        k = max(1, max(spec.num_draft[i] for i in sampled_rows))  # verify needs a proposal column
        index = [starts[i] + min(j, spec.num_draft[i]) for i in sampled_rows for j in range(k + 1)]
        upload = self.sampler.upload.values
        idx = upload("spec_index", index, torch.long)
        probs = self.tensors.temper(logits.index_select(0, idx), [per_pos[i] for i in index])
        probs = probs.softmax(-1).view(len(sampled_rows), k + 1, -1)
        num_draft = upload("spec_num_draft", [spec.num_draft[i] for i in sampled_rows], torch.long)
        q = None
        if spec.host_drafts is not None:
            x = [list(spec.host_drafts[i]) + [0] * (k - spec.num_draft[i]) for i in sampled_rows]
            x = upload("spec_drafts", x, torch.long)
        else:
            rows = upload("spec_rows", sampled_rows, torch.long)
            x = spec.draft_tokens.index_select(0, rows)[:, :k]
            if spec.draft_probs is not None:
                q = spec.draft_probs.index_select(0, rows)[:, :k]
        keys, counters = self.tensors.streams([spec.rows[i] for i in sampled_rows])
        u = keyed_uniforms(keys, counters, k + 1, VERIFY_SALT)
        greedy = torch.zeros(len(sampled_rows), dtype=torch.bool, device=probs.device)
        res = verify(probs, x, num_draft, q, greedy, u)
        return self._plain_draws(raw, spec, starts, sampled_rows, res)

    def _plain_draws(self, logits, spec: SpecRows, starts: list[int], sampled_rows: list[int], res):
        """Rows without a real proposal (n-gram padding) take the plain sampler's draw from their first
        position, the token a step without speculation would give them: a seeded row's text must not
        depend on whether a neighbour's lookup matched."""
        idle = [n for n, i in enumerate(sampled_rows) if spec.num_draft[i] == 0]
        if not idle:
            return res.num_accepted, res.tokens, sampled_rows
        first = self.sampler.upload.values("spec_first", [starts[sampled_rows[n]] for n in idle], torch.long)
        ids, _ = self.sampler.draw(logits.index_select(0, first), [spec.rows[sampled_rows[n]] for n in idle])
        at = self.sampler.upload.values("spec_idle", idle, torch.long)
        tokens = res.tokens.index_copy(0, at, torch.cat([ids[:, None], res.tokens[at, 1:]], 1))
        return res.num_accepted.index_fill(0, at, 0), tokens, sampled_rows
