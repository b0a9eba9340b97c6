"""The messages between the engine core process (core/process.py) and its client (engine/core_client.py).

They travel pickled over one Unix socket. The client sends commands in batches (one list per flush);
the core answers with one `Step` per engine step. Every message is a NamedTuple: typed, named fields.

A step's per-request news travels as `Records`: named columns, one sequence per field, rather than a
NamedTuple per request. Each NamedTuple instance pickles through a reduce call of its own, which
costs several times a plain tuple's encoding; a column of hundreds of entries pickles at the cost of
its entries. `Records.rows` reads them back as `Record`s of `Sample`s.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from itertools import islice, repeat
from typing import Any, NamedTuple


# ---------------------------------------------------------------- client -> core
class Start(NamedTuple):
    """The first message: what to build (an EngineConfig; a null core when null_step_ms is set), and
    whether its stats carry the prefix cache's summary (only prefix-aware routing reads it)."""

    config: Any
    null_step_ms: float | None
    prefix_summary: bool = False


class Add(NamedTuple):
    request_id: str
    prompt_ids: list[int]
    params: Any  # SamplingParams
    arrival_time: float
    lora_request: Any = None  # engine.LoRARequest, checked by the client; None: the base model


class AddLoRA(NamedTuple):
    """Read an adapter (checked by the client) into the core's host cache."""

    lora_request: Any  # engine.LoRARequest


class RemoveLoRA(NamedTuple):
    """Drop an adapter from the core's caches (requests running with it finish with it)."""

    lora_name: str


class Abort(NamedTuple):
    request_id: str


class StopSample(NamedTuple):
    """The replica found a stop string in this sample's text: finish it and free its blocks."""

    request_id: str
    index: int


class Shutdown(NamedTuple):
    pass


Command = Add | Abort | StopSample | Shutdown | AddLoRA | RemoveLoRA


# ---------------------------------------------------------------- core -> client
class Ready(NamedTuple):
    limits: Any  # engine.sched.admission.Limits
    # engine.lora.adapter.ModuleShapes of the base model, which the client checks adapters against;
    # None when the engine runs without LoRA
    lora_shapes: Any = None


class Failed(NamedTuple):
    """The engine could not be built; the core exits after sending this."""

    error: str


class FinalMetrics(NamedTuple):
    """On a request's final record only (the replica needs them when the request ends)."""

    first_scheduled_time: float | None
    first_token_time: float | None
    spec_draft_tokens: int = 0  # speculative proposals
    spec_accepted_tokens: int = 0
    added_time: float | None = None  # when the core took the request (RequestMetrics.added_time)


class Sample(NamedTuple):
    """One sample's news in a step: its new tokens and, on its last record, how it ended."""

    index: int
    token_ids: list[int]
    masks: list[int]  # 1: sampled, 0: forced
    logprobs: list | None = None  # a TokenLogprob per sampled token, when the request asked for them
    finish_reason: str | None = None
    error: str | None = None
    stop_token: bool = False  # the last token is a stop token / EOS, which is never part of the text


class Record(NamedTuple):
    """One request's news in a step."""

    request_id: str
    samples: Sequence[Sample]
    finished: bool = False
    cached_tokens: int = 0  # prompt tokens found in the prefix cache
    final_metrics: FinalMetrics | None = None
    prompt_logprobs: list | None = None  # on one record: see RequestOutput.prompt_logprobs


_REQUEST_COLUMNS = 6  # Records' fields before its sample columns
_new = tuple.__new__  # builds a NamedTuple from a tuple of its fields without a Python-level call


class Records(NamedTuple):
    """A step's records as columns. Entry i of each request column is request i's; its
    `num_samples[i]` samples are the next entries of the sample columns, which are Sample's fields.
    A NamedTuple's len is its number of fields: `num_requests` counts the records."""

    request_id: Sequence[str]
    finished: Sequence[bool]
    cached_tokens: Sequence[int]
    final_metrics: Sequence[FinalMetrics | None]
    prompt_logprobs: Sequence[list | None]
    num_samples: Sequence[int]
    sample_index: Sequence[int]
    token_ids: Sequence[list[int]]
    masks: Sequence[list[int]]
    logprobs: Sequence[list | None]
    finish_reason: Sequence[str | None]
    error: Sequence[str | None]
    stop_token: Sequence[bool]

    @classmethod
    def from_rows(cls, requests: list[tuple], samples: list[tuple]) -> Records:
        """Columns of rows: `requests` hold the request columns' fields in order, `samples` Sample's."""
        heads = list(zip(*requests)) or [()] * _REQUEST_COLUMNS
        return cls(*heads, *(list(zip(*samples)) or [()] * len(Sample._fields)))

    @classmethod
    def of(cls, records: Iterable[Record]) -> Records:
        records = list(records)
        heads = [
            (r.request_id, r.finished, r.cached_tokens, r.final_metrics, r.prompt_logprobs, len(r.samples))
            for r in records
        ]
        return cls.from_rows(heads, [s for r in records for s in r.samples])

    def concat(self, other: Records) -> Records:
        return Records(*(tuple(a) + tuple(b) for a, b in zip(self, other, strict=True)))

    @property
    def num_requests(self) -> int:
        return len(self.request_id)

    def rows(self) -> Iterator[Record]:
        """Each request's Record (its samples a tuple), in order."""
        samples = map(_new, repeat(Sample), zip(*self[_REQUEST_COLUMNS:]))
        return map(_new, repeat(Record), self._grouped(samples))

    def unpacked(self) -> Iterator[tuple]:
        """`rows` as plain tuples (their samples too), for a reader that unpacks each one into names
        at once: the replica's hot path, where building a NamedTuple per request and sample would
        cost more than the columns save."""
        return self._grouped(zip(*self[_REQUEST_COLUMNS:]))

    def _grouped(self, samples: Iterator) -> Iterator[tuple]:
        """Per request: (request_id, a tuple of its samples, then its other fields in Record's order)."""
        if self.num_samples.count(1) == len(self.num_samples):
            own = zip(samples)  # one sample each, as in a decode step of single-sample requests
        else:
            own = map(tuple, map(islice, repeat(samples), self.num_samples))
        return zip(self.request_id, own, *self[1:5])


# the request columns are Record's fields but its samples, then their count; the rest are Sample's
assert Records._fields[:_REQUEST_COLUMNS] == (*Record._fields[:1], *Record._fields[2:], "num_samples")
assert Records._fields[_REQUEST_COLUMNS:] == ("sample_index", *Sample._fields[1:])


class Step(NamedTuple):
    records: Records
    stats: dict | None  # an engine stats snapshot, at most every STATS_EVERY_S


class Idle(NamedTuple):
    """Nothing left to run: the engine's stats and its KV leak audit at this quiet point."""

    stats: dict
    audit: list[str]


class Dead(NamedTuple):
    """The loop failed; the core exits after sending this."""

    error: str
