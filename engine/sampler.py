"""Batched sampling on the device: penalties, temperature, top-k / top-p / min-p, seeded draws, logprobs.

One row per sampling sequence. Every step is vectorised over the batch; the only per-row Python work
is drawing noise for rows that carry their own seed. Sampling uses the exponential race (Gumbel-max):
token = argmax(p / E) with E ~ Exp(1) i.i.d. is an exact draw from p, so a seeded row needs only its own
noise vector, drawn from its own generator: its result does not depend on the other rows of the batch.
Logits processors (structured output, budget forcing on the device) plug in before `_filter`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams
from engine.uploader import Uploader
from kernels import ops


@dataclass
class SamplingRow:
    params: SamplingParams
    token_ids: list[int]  # the sequence's tokens (not copied: sliced only when penalties need them)
    num_prompt: int
    generator: torch.Generator | None  # set when params.seed is given

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt]

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt :]


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]  # per row: (chosen lp, top-k) or None


class PendingSample:
    """Sampled ids still on the device. Creating it enqueues their copy to pinned host memory (plus the
    logprobs, only when a row asked), so the device can go on with a step launched after it; the engine
    does other host work meanwhile, and `resolve()` waits for that copy alone: the step's one sync."""

    def __init__(self, sampled: torch.Tensor, raw_logprobs: torch.Tensor | None, rows: list[SamplingRow]):
        self.sampled = sampled  # stays on the device: a step scheduled ahead feeds it back as input
        self.rows = rows
        tensors = [sampled]
        if raw_logprobs is not None:
            k = max(max(r.params.logprobs or 0 for r in rows), 1)
            chosen = raw_logprobs.gather(1, sampled[:, None])[:, 0]
            top_lp, top_ids = raw_logprobs.topk(k, dim=-1)
            tensors += [chosen, top_lp, top_ids]
        self._event = None
        if sampled.is_cuda:
            tensors = [t.to("cpu", non_blocking=True) for t in tensors]  # into pinned memory
            self._event = torch.cuda.Event()
            self._event.record()
        self._host = tensors

    def resolve(self) -> SampleResult:
        if self._event is not None:
            self._event.synchronize()
        rows, host = self.rows, [t.tolist() for t in self._host]
        if len(host) == 1:
            return SampleResult(host[0], [None] * len(rows))
        ids, chosen, top_lp, top_ids = host
        logprobs = []
        for i, r in enumerate(rows):
            n = r.params.logprobs
            logprobs.append(None if n is None else (chosen[i], list(zip(top_ids[i][:n], top_lp[i][:n]))))
        return SampleResult(ids, logprobs)


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        self.upload = Uploader(device)
        self._slot = 0

    def _t(self, values, dtype=torch.float32) -> torch.Tensor:
        self._slot += 1  # one pinned buffer per call site within a step
        return self.upload.values(f"s{self._slot}", values, dtype)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> PendingSample:
        self._slot = 0
        wants_logprobs = _wants_logprobs(rows)
        if not wants_logprobs and all(r.params.greedy and _no_penalty(r.params) for r in rows):
            # The common benchmark case: one argmax, on the model's dtype (widening is exact: same ids).
            return PendingSample(ops.argmax(logits), None, rows)
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if wants_logprobs else None
        logits = self._apply_penalties(logits, rows)
        if all(r.params.greedy for r in rows):
            return PendingSample(ops.argmax(logits), raw_logprobs, rows)
        greedy = self._t([r.params.greedy for r in rows], torch.bool)
        temperature = self._t([r.params.temperature or 1.0 for r in rows])
        scores = self._filter(logits / temperature[:, None], rows)  # filtered tokens are -inf
        # argmax(p / E) == argmax(log p - log E) == argmax(scores - log E): no softmax needed
        noise = self._exponential_noise(rows, scores.shape).log_()
        sampled = torch.where(greedy, ops.argmax(logits), ops.argmax(scores - noise))
        return PendingSample(sampled, raw_logprobs, rows)

    # ------------------------------------------------------------------ logits processors
    def _apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Repetition (prompt + output), presence and frequency (output only) penalties, as in vLLM."""
        if all(_no_penalty(r.params) for r in rows):
            return logits
        n, v = logits.shape
        out_counts = torch.zeros(n, v, device=self.device)
        seen = torch.zeros(n, v, dtype=torch.bool, device=self.device)
        for i, r in enumerate(rows):
            if r.output_ids:
                ids = self._t(r.output_ids, torch.long)
                out_counts[i].index_add_(0, ids, torch.ones(len(ids), device=self.device))
            if r.prompt_ids:
                seen[i, self._t(r.prompt_ids, torch.long)] = True
        seen |= out_counts > 0
        rep = self._t([r.params.repetition_penalty for r in rows])[:, None]
        pres = self._t([r.params.presence_penalty for r in rows])[:, None]
        freq = self._t([r.params.frequency_penalty for r in rows])[:, None]
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
        return logits - freq * out_counts - pres * (out_counts > 0).float()

    def _filter(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Mask tokens outside top-k, the top-p nucleus or below min_p * max prob with -inf."""
        top_k = [r.params.top_k for r in rows]
        top_p = [r.params.top_p for r in rows]
        min_p = [r.params.min_p for r in rows]
        if any(k > 0 for k in top_k):
            ks = [min(k if k > 0 else self.vocab_size, logits.shape[-1]) for k in top_k]
            k = self._t(ks, torch.long)
            kth = torch.topk(logits, max(ks), dim=-1).values.gather(1, (k - 1)[:, None])
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if any(p < 1.0 for p in top_p):
            p = self._t(top_p)[:, None]
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            drop_sorted = (cum - sorted_logits.softmax(dim=-1)) >= p  # keep the token that crosses p
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        if any(m > 0.0 for m in min_p):
            m = self._t(min_p)[:, None]
            probs = logits.softmax(dim=-1)
            logits = logits.masked_fill(probs < m * probs.max(dim=-1, keepdim=True).values, float("-inf"))
        return logits

    # ------------------------------------------------------------------ draws
    def _exponential_noise(self, rows: list[SamplingRow], shape: torch.Size) -> torch.Tensor:
        noise = torch.empty(shape, device=self.device).exponential_()
        for i, r in enumerate(rows):
            if r.generator is not None and not r.params.greedy:
                noise[i].exponential_(generator=r.generator)
        return noise


def _wants_logprobs(rows: list[SamplingRow]) -> bool:
    return any(r.params.logprobs is not None for r in rows)


def _no_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
