"""Workload shapes for the Locust load test (a helper module: Locust skips files starting with '_').

W1 single:        prompt 256 tokens, generation 256.
W2 mixed:         prompt uniform in [32, 1024], generation uniform in [64, 256].
W3 shared prefix: one long system prompt (1024 tokens) shared by all users, user turns of 16-64
                  tokens, generation 64: exercises the prefix cache.
Lengths are in tokens. Token-id prompts are exact; text prompts use a words-per-token ratio measured
against the server's own tokenizer at start-up (see locustfile.calibrate_text).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

WORDS = (
    "the of and to in is was for on that with as by at from his her it an were are which this be or "
    "have had not but one all their they more there been has when who will would into its some than "
    "them out up other about time only new what these two may first any river stone light market "
    "garden window morning simple number people water table paper music story winter summer"
).split()


@dataclass(frozen=True)
class Shape:
    name: str
    prompt: tuple[int, int]  # inclusive token range
    gen: tuple[int, int]
    shared_prefix: int = 0  # tokens of the common system prompt (W3)


SHAPES = {
    "W1": Shape("W1", (256, 256), (256, 256)),
    "W2": Shape("W2", (32, 1024), (64, 256)),
    "W3": Shape("W3", (16, 64), (64, 64), shared_prefix=1024),
}


@dataclass
class Request:
    workload: str
    prefix: list[int] | str | None  # W3's shared system prompt
    prompt: list[int] | str  # the user part
    max_tokens: int


def parse_mix(spec: str) -> list[tuple[str, float]]:
    """'W2' or 'W1:1,W2:3' -> [(name, weight)]; names are checked against SHAPES."""
    mix = []
    for part in spec.split(","):
        name, _, weight = part.strip().partition(":")
        name = name.upper()
        if name not in SHAPES:
            raise ValueError(f"--workload: unknown workload {name!r}; use W1, W2, W3 or a mix like W1:1,W2:3")
        mix.append((name, float(weight or 1.0)))
    return mix


class PromptMaker:
    """Builds prompts of a target token length, as token ids or as text."""

    def __init__(self, vocab_size: int, tokens_per_word: float, as_text: bool):
        self.vocab_size, self.tokens_per_word, self.as_text = vocab_size, tokens_per_word, as_text

    def make(self, rng: random.Random, tokens: int) -> list[int] | str:
        if self.as_text:
            words = max(1, round(tokens / self.tokens_per_word))
            return " ".join(rng.choice(WORDS) for _ in range(words))
        # skip the lowest ids, where tokenizers keep BOS/EOS/PAD
        return [rng.randrange(8, self.vocab_size) for _ in range(tokens)]

    def shared(self, tokens: int) -> list[int] | str:
        # a fixed seed: the W3 system prompt is identical in every user and every worker process
        return self.make(random.Random(12345), tokens)


def sample(
    rng: random.Random,
    shape: Shape,
    maker: PromptMaker,
    prompt_scale: float,
    gen_scale: float,
    max_context: int,
) -> Request:
    """Draw one request; lengths scaled, then clipped so prompt + generation fit in the context."""
    prompt_len = max(1, round(rng.randint(*shape.prompt) * prompt_scale))
    gen = max(1, round(rng.randint(*shape.gen) * gen_scale))
    prefix_len = round(shape.shared_prefix * prompt_scale)
    # Leave a margin for chat templates and text-length estimates.
    budget = int(max_context * 0.8) - gen - prefix_len
    prompt_len = max(1, min(prompt_len, budget))
    prefix = maker.shared(prefix_len) if prefix_len else None
    return Request(shape.name, prefix, maker.make(rng, prompt_len), gen)
