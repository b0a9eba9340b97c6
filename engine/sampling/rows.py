"""A sampling row (one sequence's draw of one token) and the per-row tensors of a batch of them, on
the device: the one place those tensors are built.

Three samplers read them: the plain draw (engine/sampling/sampler.py), a draft model's proposals
(engine/runner/draft_runner.py) and speculative verification (engine/spec/sampler.py). Each holds a
RowTensors over its own Uploader and slot prefix, so they never share an upload slot (a slot alternates
two pinned buffers: a third refill within one step would wait for the device). Each list goes up in
one upload: a row's Philox key with its counter, the three penalties together.

Temperature: a draw that filters (top-k / top-p / min-p) divides the logits by T first (`temper`), then
draws at temperature 1, or 0 for greedy rows: the argmax (`draw_temperatures(divided=True)`); without
filters the draw applies T itself (`divided=False`). Greedy rows (T = 0) divide by 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.device.uploader import Uploader
from engine.sampling_params import SamplingParams

_UNIFORM_KEPT = 256  # uniform vectors kept at most (batch sizes x values): a bound, never reached in practice
_SLOTS = ("streams", "temperature", "draw_temperature", "top_k", "top_p", "min_p", "penalties")


@dataclass(slots=True)
class SamplingRow:
    params: SamplingParams
    token_ids: list[int]  # the sequence's tokens (not copied: sliced only when penalties need them)
    num_prompt: int
    key: int  # the sequence's noise stream (engine/sampling/sampler.stream_key), an int64
    counter: int  # the position of the token this row draws

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt]

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt :]


class RowTensors:
    """Builds the per-row tensors of a batch of SamplingRows through `upload`, in slots named with
    `prefix` (one per sampler that shares the Uploader)."""

    def __init__(self, upload: Uploader, vocab_size: int, prefix: str = ""):
        self.upload = upload
        self.vocab_size = vocab_size  # top-k's bound for rows without top-k
        self._slot = {name: prefix + name for name in _SLOTS}
        # (rows, value) -> a device vector of that value, for a batch whose rows all share it (the
        # usual case: one temperature for every request); never written, so it is kept across steps
        self._uniform: dict[tuple[int, float], torch.Tensor] = {}

    def streams(self, rows: list[SamplingRow], salt: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """[rows] int64 each: every row's Philox key (XOR `salt`: another stream of the same row) and
        counter, in one upload, each 16-byte aligned."""
        keys = [r.key for r in rows] if not salt else [r.key ^ salt for r in rows]
        counters = [r.counter for r in rows]
        return tuple(self.upload.segments(self._slot["streams"], [keys, counters], torch.long))

    def divisors(self, rows: list[SamplingRow]) -> torch.Tensor:
        """[rows, 1] float32: every row's temperature, 1 for greedy rows."""
        temps = [r.params.temperature or 1.0 for r in rows]
        return self._floats("temperature", temps)[:, None]

    def draw_temperatures(self, rows: list[SamplingRow], divided: bool) -> torch.Tensor:
        """[rows] float32, the temperature ops.sample applies: each row's own, or, for logits already
        divided by it, 1 (0 for greedy rows either way: the argmax)."""
        if divided:
            temps = [1.0 if r.params.temperature else 0.0 for r in rows]
        else:
            temps = [r.params.temperature for r in rows]
        return self._floats("draw_temperature", temps)

    def _floats(self, slot: str, values: list[float]) -> torch.Tensor:
        """[rows] float32 on the device, read-only: a kept vector when every row has the same value
        (no upload; a step's uploads cost host time that a decode step cannot spare), else uploaded."""
        if not values or values.count(values[0]) != len(values):
            return self.upload.values(self._slot[slot], values, torch.float32)
        key = (len(values), values[0])
        kept = self._uniform.get(key)
        if kept is None:
            if len(self._uniform) >= _UNIFORM_KEPT:
                self._uniform.clear()  # a freed vector is reused only after the kernels that read it
            kept = torch.full((len(values),), values[0], dtype=torch.float32, device=self.upload.device)
            self._uniform[key] = kept
        return kept

    def temper(
        self, logits: torch.Tensor, rows: list[SamplingRow], divisors: torch.Tensor | None = None
    ) -> torch.Tensor:
        """float32 logits divided by each row's temperature (`divisors`, uploaded once when a caller
        reuses them), then filtered: tokens outside top-k / top-p / min-p are -inf."""
        if divisors is None:
            divisors = self.divisors(rows)
        return self.filter(logits.float() / divisors, rows)

    def filter(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Mask tokens outside top-k, the top-p nucleus or below min_p * max prob with -inf."""
        top_k = [r.params.top_k for r in rows]
        top_p = [r.params.top_p for r in rows]
        min_p = [r.params.min_p for r in rows]
        if any(k > 0 for k in top_k):
            ks = [min(k if k > 0 else self.vocab_size, logits.shape[-1]) for k in top_k]
            k = self.upload.values(self._slot["top_k"], ks, torch.long)
            kth = torch.topk(logits, max(ks), dim=-1).values.gather(1, (k - 1)[:, None])
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if any(p < 1.0 for p in top_p):
            p = self.upload.values(self._slot["top_p"], top_p, torch.float32)[:, None]
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            drop_sorted = (cum - sorted_logits.softmax(dim=-1)) >= p  # keep the token that crosses p
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        if any(m > 0.0 for m in min_p):
            m = self.upload.values(self._slot["min_p"], min_p, torch.float32)[:, None]
            probs = logits.softmax(dim=-1)
            logits = logits.masked_fill(probs < m * probs.max(dim=-1, keepdim=True).values, float("-inf"))
        return logits

    def penalties(self, rows: list[SamplingRow]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[rows, 1] float32 each: the repetition, presence and frequency penalties, in one upload."""
        values = [r.params.repetition_penalty for r in rows]
        values += [r.params.presence_penalty for r in rows]
        values += [r.params.frequency_penalty for r in rows]
        rep, pres, freq = self.upload.values(self._slot["penalties"], values, torch.float32).view(3, -1, 1)
        return rep, pres, freq
