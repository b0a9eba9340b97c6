"""Batched sampling on the device: penalties, temperature, top-k / top-p / min-p, seeded draws, logprobs.

One row per sampling sequence, every step vectorised over the batch. A draw is the Gumbel-max trick,
token = argmax(logits / T + G) with G ~ Gumbel(0, 1) i.i.d., an exact draw from softmax(logits / T),
done in one kernel pass over the logits (ops.sample). Its noise is counter-based (Philox): row r's
noise is a function of (key, counter) only, where the key names the sequence's stream (from the
request's seed and sample index, or from the engine's base key and the sequence id when unseeded) and
the counter is the position of the token being drawn. So a seeded sample does not depend on its batch
neighbours, and a sequence recomputed after preemption draws the same tokens again.
Logits processors (logit_bias, penalties, then the grammar mask of structured output) plug in before
`_filter`; only the rows that ask pay for them, and a step without a constrained row never looks for
a mask (the runner passes none).
Prompt logprobs (`score_prompt`) are log_softmax over the logits of every position of a prompt chunk,
computed only for the chunks of requests that ask (engine/runner/step_inputs.prompt_logprob_rows).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.device.stream import record
from engine.device.uploader import Uploader
from engine.sampling.rows import RowTensors, SamplingRow
from engine.sampling_params import SamplingParams
from kernels import ops


@dataclass
class TokenMask:
    """The allowed tokens of a step's constrained rows, on the device (engine/structured/state.py):
    bitmask row i applies to sampling row rows[i], and sampling row r takes bitmask row row_of[r] (-1:
    unconstrained); both None when every row is constrained (row i takes bitmask row i)."""

    bitmask: torch.Tensor  # [R, ceil(V / 32)] int32
    rows: torch.Tensor | None = None  # [R] int64
    row_of: torch.Tensor | None = None  # [rows] int64


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]  # per row: (chosen lp, top-k) or None
    # prompt scores of the step (see PromptScores), on the host: (spans, chosen, top ids, top lps)
    prompt: tuple[list[tuple], list[float], list[list[int]], list[list[float]]] | None = None
    # speculative decoding: the tokens each speculating row emits (engine/spec/sampler.py), else None
    spec_tokens: list[list[int]] | None = None
    spec_drafts: list[list[int]] | None = None  # gated-LoRA MTP: each speculating row's next drafts


@dataclass
class PromptScores:
    """Prompt-token logprobs of one step, still on the device: for each row of a PromptLogprobRows
    (engine/runner/step_inputs.py), the target token's logprob and the top k (ids and logprobs, best
    first)."""

    spans: list[tuple]
    chosen: torch.Tensor
    top_lp: torch.Tensor
    top_ids: torch.Tensor


class EnqueuedDraw:
    """A step's draw enqueued on the device when created: no host work of it is left to begin or to
    join (the Draw protocol of engine/runner/in_flight.py, which DeferredSample also follows)."""

    deferred = False

    def start(self) -> None:
        """Nothing to begin."""

    def finish(self) -> EnqueuedDraw:
        return self


class PendingSample(EnqueuedDraw):
    """Sampled ids still on the device. Creating it enqueues their copy to pinned host memory (plus the
    logprobs, only when a row asked), so the device can go on with a step launched after it; the engine
    does other host work meanwhile, and `resolve()` waits for that copy alone: the step's one sync."""

    def __init__(
        self,
        sampled: torch.Tensor,
        raw_logprobs: torch.Tensor | None,
        rows: list[SamplingRow],
        prompt: PromptScores | None = None,
    ):
        self.sampled = sampled  # stays on the device: a step scheduled ahead feeds it back as input
        self.rows = rows
        self.prompt_spans = None if prompt is None else prompt.spans
        tensors = [] if prompt is None else [prompt.chosen, prompt.top_ids, prompt.top_lp]
        tensors.append(sampled)
        if raw_logprobs is not None:
            k = max(max(r.params.logprobs or 0 for r in rows), 1)
            chosen = raw_logprobs.gather(1, sampled[:, None])[:, 0]
            top_lp, top_ids = raw_logprobs.topk(k, dim=-1)
            tensors += [chosen, top_lp, top_ids]
        self._event = None
        if sampled.is_cuda:
            tensors = [t.to("cpu", non_blocking=True) for t in tensors]  # into pinned memory
            self._event = torch.cuda.Event()
            record(self._event, sampled.device)
        self._host = tensors

    def resolve(self) -> SampleResult:
        if self._event is not None:
            self._event.synchronize()
        rows, host = self.rows, [t.tolist() for t in self._host]
        prompt = None
        if self.prompt_spans is not None:
            prompt, host = (self.prompt_spans, *host[:3]), host[3:]
        if len(host) == 1:
            return SampleResult(host[0], [None] * len(rows), prompt)
        ids, chosen, top_lp, top_ids = host
        logprobs = []
        for i, r in enumerate(rows):
            n = r.params.logprobs
            logprobs.append(None if n is None else (chosen[i], list(zip(top_ids[i][:n], top_lp[i][:n]))))
        return SampleResult(ids, logprobs, prompt)


_M64 = (1 << 64) - 1
SCORE_ROWS = 256  # prompt positions scored per slice (a 128k vocabulary: 128 MiB of float32 logprobs)


@functools.lru_cache(maxsize=1 << 14)
def stream_key(a: int, b: int) -> int:
    """A 63-bit Philox key for stream (a, b): (seed, sample index) or (engine base key, sequence id).
    SplitMix64's finaliser scatters nearby inputs (seed 7 index 1 vs seed 8 index 0) across the keys.
    Cached: a running sequence asks for its key every step, and a lookup is several times cheaper than
    the arithmetic on Python's big ints."""
    z = (a * 0x9E3779B97F4A7C15 + b + 1) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return (z ^ (z >> 31)) >> 1


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        self.upload = Uploader(device)
        self.tensors = RowTensors(self.upload, vocab_size)  # the rows' temperatures, streams, filters

    def _t(self, slot: str, values, dtype=torch.float32) -> torch.Tensor:
        return self.upload.values(slot, values, dtype)  # one pinned buffer per named slot

    def __call__(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        prompt: PromptScores | None = None,
        mask: TokenMask | None = None,
    ) -> PendingSample:
        """Sample one token per row. `logits` belongs to the sampler (a grammar mask writes into it)."""
        sampled, raw_logprobs = self.draw(logits, rows, mask)
        return PendingSample(sampled, raw_logprobs, rows, prompt)

    def draw(
        self, logits: torch.Tensor, rows: list[SamplingRow], mask: TokenMask | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(sampled ids, raw logprobs or None) on the device; speculative verification draws its rows
        without proposals here too, so they get the very token a plain step would give them."""
        wants_logprobs, processors, greedy, filters = row_kinds(rows)
        if mask is None and not wants_logprobs and greedy and not processors:
            # The common benchmark case: one argmax, on the model's dtype (widening is exact: same ids).
            return ops.argmax(logits), None
        # reported logprobs are the model's own distribution, before logit_bias and penalties (vLLM's
        # raw logprobs)
        raw_logprobs = torch.log_softmax(logits.float(), dim=-1) if wants_logprobs else None
        if processors:
            logits = self.apply_processors(logits.float(), rows)
        if mask is not None and filters:  # after logit_bias and penalties, before the filters
            ops.apply_token_bitmask(logits, mask.bitmask, mask.rows)
            mask = None
        # otherwise the draw itself reads the mask as it loads the logits (no masking pass)
        bits = (None, None) if mask is None else (mask.bitmask, mask.row_of)
        if greedy:
            return ops.argmax(logits, *bits), raw_logprobs
        if filters:
            logits = self.tensors.temper(logits, rows)  # divided by T; filtered tokens are -inf
        keys, counters = self.tensors.streams(rows)
        temperature = self.tensors.draw_temperatures(rows, divided=filters)  # 0 for greedy rows: argmax
        return ops.sample(logits, temperature, keys, counters, *bits), raw_logprobs

    def score_prompt(
        self, compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, plan
    ) -> PromptScores:
        """Prompt logprobs at the rows of `plan` (a PromptLogprobRows): log_softmax over the vocabulary
        in float32, the target token's logprob and the top plan.k. Slices of SCORE_ROWS rows bound the
        [rows, vocab] temporaries of a long prompt chunk."""
        if not plan.rows:  # e.g. a one-token prompt: nothing to score, but its span completes it
            empty = torch.empty(0, plan.k, device=self.device)
            return PromptScores(plan.spans, empty.sum(dim=1), empty, empty.long())
        rows = self._t("score_rows", plan.rows, torch.long)
        targets = self._t("score_targets", plan.targets, torch.long)
        chosen, top_lp, top_ids = [], [], []
        for i in range(0, len(plan.rows), SCORE_ROWS):
            logits = compute_logits(hidden.index_select(0, rows[i : i + SCORE_ROWS]))
            lp = torch.log_softmax(logits.float(), dim=-1)
            chosen.append(lp.gather(1, targets[i : i + SCORE_ROWS, None])[:, 0])
            values, ids = lp.topk(plan.k, dim=-1)
            top_lp.append(values)
            top_ids.append(ids)
        return PromptScores(plan.spans, torch.cat(chosen), torch.cat(top_lp), torch.cat(top_ids))

    # ------------------------------------------------------------------ logits processors
    def apply_processors(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """logit_bias on the raw logits first, then penalties (each only when some row has it)."""
        if any(r.params.logit_bias is not None for r in rows):
            logits = self._apply_bias(logits, rows)
        if not all(_no_penalty(r.params) for r in rows):
            logits = self._apply_penalties(logits, rows)
        return logits

    def _apply_bias(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Add each biased row's logit_bias: one index_add over the flattened logits of the step."""
        n, v = logits.shape
        index: list[int] = []
        values: list[float] = []
        for i, r in enumerate(rows):
            bias = r.params.logit_bias
            if bias is not None:
                index += [i * v + t for t in bias]
                values += bias.values()
        flat = logits.reshape(-1).index_add(
            0, self._t("bias_index", index, torch.long), self._t("bias_values", values)
        )
        return flat.view(n, v)

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Repetition (prompt + output), presence and frequency (output only) penalties, as in vLLM."""
        n, v = logits.shape
        out_counts = torch.zeros(n, v, device=self.device)
        seen = torch.zeros(n, v, dtype=torch.bool, device=self.device)
        for i, r in enumerate(rows):
            if r.output_ids:
                ids = self._t(f"output_ids{i}", r.output_ids, torch.long)
                out_counts[i].index_add_(0, ids, torch.ones(len(ids), device=self.device))
            if r.prompt_ids:
                seen[i, self._t(f"prompt_ids{i}", r.prompt_ids, torch.long)] = True
        seen |= out_counts > 0
        rep, pres, freq = self.tensors.penalties(rows)
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
        return logits - freq * out_counts - pres * (out_counts > 0).float()


def row_kinds(rows: list[SamplingRow]) -> tuple[bool, bool, bool, bool]:
    """(some row wants logprobs, some row has logit_bias or a penalty, every row is greedy, some sampled
    row filters by top-k / top-p / min-p), in one pass: it runs over every row every step."""
    logprobs = processors = filters = False
    greedy = True
    for r in rows:
        p = r.params
        if p.logprobs is not None:
            logprobs = True
        if (
            p.logit_bias is not None
            or p.repetition_penalty != 1.0
            or p.presence_penalty != 0.0
            or p.frequency_penalty != 0.0
        ):
            processors = True
        if p.temperature != 0.0:
            greedy = False
            if p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0:
                filters = True
    return logprobs, processors, greedy, filters


def _no_processor(p: SamplingParams) -> bool:
    """No logit_bias and no penalties."""
    return p.logit_bias is None and _no_penalty(p)


def _no_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
