"""The messages between the engine core process (engine/core.py) and its client (engine/core_client.py).

They travel pickled over one Unix socket. The client sends commands in batches (one list per flush);
the core answers with one `Step` per engine step. NamedTuples are typed and cost what plain tuples
cost to pickle. The per-request records inside a `Step` stay plain tuples (`Record`): there are
hundreds of them per step, and they are read positionally on the replica's hot path.
"""

from __future__ import annotations

from typing import Any, NamedTuple

# What the core sends per request and step: request id, samples, finished, cached prompt tokens, the
# final metrics (on the final record only, None otherwise: the replica needs them only when the
# request ends): first scheduled time, first token time, speculative proposals, accepted proposals;
# and the prompt logprobs (a list of TokenLogprob or None, see RequestOutput.prompt_logprobs) on the
# one record that carries them, None on every other (a None costs one byte per record). A sample:
# (index, token ids, masks, logprobs or None, finish reason or None, error or None, whether the last
# token is a stop token / EOS).
Record = tuple[str, list[tuple], bool, int, tuple | None, list | None]


# ---------------------------------------------------------------- client -> core
class Start(NamedTuple):
    """The first message: what to build (an EngineConfig; a null core when null_step_ms is set)."""

    config: Any
    null_step_ms: float | None


class Add(NamedTuple):
    request_id: str
    prompt_ids: list[int]
    params: Any  # SamplingParams
    arrival_time: float


class Abort(NamedTuple):
    request_id: str


class StopSample(NamedTuple):
    """The replica found a stop string in this sample's text: finish it and free its blocks."""

    request_id: str
    index: int


class Shutdown(NamedTuple):
    pass


Command = Add | Abort | StopSample | Shutdown


# ---------------------------------------------------------------- core -> client
class Ready(NamedTuple):
    limits: Any  # engine.admission.Limits


class Failed(NamedTuple):
    """The engine could not be built; the core exits after sending this."""

    error: str


class Step(NamedTuple):
    records: list[Record]
    stats: dict | None  # an engine stats snapshot, at most every STATS_EVERY_S


class Idle(NamedTuple):
    """Nothing left to run: the engine's stats and its KV leak audit at this quiet point."""

    stats: dict
    audit: list[str]


class Dead(NamedTuple):
    """The loop failed; the core exits after sending this."""

    error: str
