"""Turning a prompt into token ids and checking that a request can ever run: shared by the engine and
the server's replica process, which admits requests before they reach the engine core.

Pure Python (no torch): the replica imports it without the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import InvalidRequestError, PromptTooLongError
from engine.sampling_params import SamplingParams

Prompt = str | list[int] | list[dict]


@dataclass(frozen=True)
class Limits:
    """What the engine can hold, known once its KV pool is sized."""

    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_waiting: int


def tokenize(tokenizer, prompt: Prompt, vocab_size: int) -> list[int]:
    """Text, chat messages or token ids -> token ids; ids outside the vocabulary are refused."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if prompt and all(isinstance(m, dict) for m in prompt):
        return tokenizer.encode_chat(prompt)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise InvalidRequestError(
            "prompt: must be a string, a list of token ids or chat messages", field="prompt"
        )
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"prompt: token id {bad[0]} is outside the vocabulary [0, {vocab_size})", field="prompt"
        )
    return list(prompt)


def check(ids: list[int], params: SamplingParams, limits: Limits, tokenizer=None) -> None:
    """Raise if the request could never run: empty, longer than the context or the KV pool, n too big,
    a logit_bias token outside the vocabulary, or a structured-output constraint that does not compile
    for `tokenizer` (the engine's Tokenizer; compiled once and cached, engine/structured/compiler.py)."""
    if params.structured is not None:
        _check_structured(params, limits, tokenizer)
    if not ids:
        raise InvalidRequestError("prompt: must not be empty", field="prompt")
    if params.logit_bias is not None:
        bad = [t for t in params.logit_bias if t >= limits.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"logit_bias: token id {bad[0]} is outside the vocabulary [0, {limits.vocab_size})",
                field="logit_bias",
            )
    if len(ids) + params.max_tokens > limits.max_model_len:
        raise PromptTooLongError(
            f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
            f"length {limits.max_model_len}: shorten the prompt or lower max_tokens",
            field="max_tokens",
        )
    need = -(-(len(ids) + params.max_tokens) // limits.block_size)
    if need > limits.num_blocks:
        raise PromptTooLongError(
            f"the request needs {need} KV blocks but the pool has {limits.num_blocks}: "
            "lower max_tokens or give the engine more KV memory",
            field="max_tokens",
        )
    if params.n > limits.max_num_seqs:
        raise InvalidRequestError(
            f"n: {params.n} samples exceed max_num_seqs ({limits.max_num_seqs})", field="n"
        )


def _check_structured(params: SamplingParams, limits: Limits, tokenizer) -> None:
    from engine.structured import (
        compiler as structured,  # llguidance is loaded only once a request asks for a grammar
    )

    so = params.structured
    name = getattr(so, "field", "structured_outputs")
    if params.tool is not None or params.budget_forcing is not None:
        raise InvalidRequestError(
            f"{name}: structured output cannot be combined with tool calls or budget forcing "
            "(their forced tokens would bypass the grammar); drop one of them",
            field=name,
        )
    if tokenizer is None:
        structured.canonical(so)  # the spec's shape only; the engine compiles it when it adds the request
        return
    structured.check(so, tokenizer, limits.vocab_size)
