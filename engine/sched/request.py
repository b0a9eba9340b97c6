"""Requests and their sequences: the scheduler's bookkeeping objects. Pure Python, no torch.

A Request holds one prompt and n samples. Each sample is a Sequence with its own token list and block
table. Only sample 0 exists until the prompt is computed; then it forks into n sequences that share the
prompt's KV blocks by reference ("prefill once, then replicate").

Token accounting ("no prefill phase, only computed tokens catching up"): a sequence's KV cache holds
its first `num_computed` tokens. Each step computes token_ids[num_computed : num_computed + k] for some
k chosen by the scheduler. When that chunk reaches the end of token_ids, its last position yields logits
and a new token is sampled. Prompt chunks, single-token decodes, tokens forced by a tool or by budget
forcing, and recomputation after preemption are all the same thing: computed tokens catching up.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from engine.outputs import RequestMetrics, TokenLogprob
from engine.sampling_params import SamplingParams
from engine.sched.block_manager import BlockTable, adapter_seed

_seq_ids = itertools.count()


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SampleState:
    """What the output processor (engine/output/processor.py) keeps per sample between steps;
    `pending_*` is what the next RequestOutput will carry."""

    # engine.output.text.TextStream (the output room's type; sched imports nothing above it), made on
    # first use by an engine that detokenizes; else None
    text: Any = None
    num_seen: int = 0  # output tokens already detokenised
    pending_ids: list[int] = field(default_factory=list)
    pending_masks: list[int] = field(default_factory=list)
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    ends_with_stop_token: bool = False  # the last token is a stop token / EOS: never part of the text
    reported: bool = False  # the sample's final delta went out
    budget_forcings: int = 0  # suppress tokens replaced so far; picks the next replacement string


@dataclass(eq=False)
class Sequence:
    request: Request
    index: int  # sample index within the request (0 .. n-1)
    token_ids: list[int]  # prompt followed by output
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    num_computed: int = 0  # tokens whose K/V are in the cache
    table: BlockTable = field(default_factory=BlockTable)
    status: SeqStatus = SeqStatus.WAITING
    masks: list[int] = field(default_factory=list)  # per output token: 1 sampled, 0 forced
    finish_reason: str | None = None
    error: str | None = None
    state: SampleState = field(default_factory=SampleState)  # a forked sample starts with its own
    # engine.structured.state.GrammarState of a structured-output request (None: unconstrained); its
    # matcher's consumed tokens and its pending ones are exactly this sequence's sampled output tokens
    grammar: Any = None
    # speculative decoding (engine/spec/speculator.py): draft positions the scheduler should add to this
    # sequence's next decode chunk, the proposed tokens when the host knows them (n-gram; a draft model's
    # stay on the device), and the speculator's per-sequence state (a SpecState, made on first use)
    lookahead: int = 0
    draft: list[int] = field(default_factory=list)
    spec: Any = None
    # gated-LoRA MTP: mask tokens after each real token of its next decode chunk (they cost compute, not
    # KV positions: the step's token budget counts (1 + lookahead) * (1 + mask_tokens))
    mask_tokens: int = 0
    num_prompt: int = field(init=False)  # a plain attribute: read for every token on the hot path

    def __post_init__(self) -> None:
        self.num_prompt = len(self.request.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt :]

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the KV cache: a prompt chunk, a decode token, or forced tokens."""
        return self.num_tokens - self.num_computed

    @property
    def prompt_done(self) -> bool:
        return self.num_computed >= self.num_prompt

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.time)
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False  # the n samples exist
    aborted: bool = False
    cached_tokens: int = 0
    # engine.lora.LoRARequest of the adapter the request runs with (None: the base model)
    lora_request: Any = None
    metrics: RequestMetrics = field(init=False)
    num_prompt: int = field(init=False)
    cache_seed: int | None = field(init=False)  # its prefix-cache chain's start (block_manager)

    def __post_init__(self) -> None:
        self.num_prompt = len(self.prompt_ids)
        self.cache_seed = adapter_seed(self.lora_request)
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        self.seqs.append(Sequence(self, 0, list(self.prompt_ids)))
        self.forked = self.params.n == 1

    @property
    def finished(self) -> bool:
        return self.forked and all(s.finished for s in self.seqs)

    @property
    def completion_tokens(self) -> int:
        return sum(s.num_tokens - self.num_prompt for s in self.seqs)
