"""Workload shapes for the Locust load test (a helper module: Locust skips files starting with '_').

W1 single:        prompt 256 tokens, generation 256.
W2 mixed:         prompt uniform in [32, 1024], generation uniform in [64, 256].
W3 shared prefix: one long system prompt (1024 tokens) shared by all users, user turns of 16-64
                  tokens, generation 64: exercises the prefix cache.
W4 multi-turn:    each user holds a conversation of 8-12 turns: an opening message of 512-1024 tokens,
                  then each turn resends the whole history (every message and answer so far) plus a new
                  user message of 64-128 tokens; answers of 64-128 tokens. A session's KV outgrows the
                  GPU pool once enough users talk at once: exercises the host KV tier (issue 50).
                  With token-id prompts an answer is resent as the ids the server returned (vLLM's
                  return_token_ids), so its KV is reused as a chat client's re-tokenized text mostly
                  is; from a server that returns none, as stand-in ids of its length. Text prompts
                  resend the answer's text.
Think time (every shape, off by default): a user pauses between the end of one answer and its next
request, drawn from an exponential distribution of a given mean, as people read and type between
turns. With it a multi-turn load keeps many sessions live while few are running at once.
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
    turns: tuple[int, int] = (1, 1)  # turns per conversation (W4); `prompt` is then the opening message
    turn_prompt: tuple[int, int] = (0, 0)  # the new user message of each later turn (W4)

    @property
    def multi_turn(self) -> bool:
        return self.turns[1] > 1


SHAPES = {
    "W1": Shape("W1", (256, 256), (256, 256)),
    "W2": Shape("W2", (32, 1024), (64, 256)),
    "W3": Shape("W3", (16, 64), (64, 64), shared_prefix=1024),
    "W4": Shape("W4", (512, 1024), (64, 128), turns=(8, 12), turn_prompt=(64, 128)),
}


@dataclass
class Request:
    workload: str
    prefix: list[int] | str | None  # W3's shared system prompt
    prompt: list[int] | str  # the user part
    max_tokens: int


def think_seconds(rng: random.Random, mean: float) -> float:
    """One pause between a user's requests: exponential with this mean (0: none, a closed loop)."""
    if mean < 0:
        raise ValueError(f"--think-time: {mean} is negative; give a mean in seconds, or 0 for none")
    return rng.expovariate(1.0 / mean) if mean > 0 else 0.0


def parse_mix(spec: str) -> list[tuple[str, float]]:
    """'W2' or 'W1:1,W2:3' -> [(name, weight)]; names are checked against SHAPES."""
    mix = []
    for part in spec.split(","):
        name, _, weight = part.strip().partition(":")
        name = name.upper()
        if name not in SHAPES:
            raise ValueError(
                f"--workload: unknown workload {name!r}; use W1, W2, W3, W4 or a mix like W1:1,W2:3"
            )
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

    def length(self, prompt: list[int] | str) -> int:
        """Tokens of a prompt made here (text: estimated from its words)."""
        return round(len(prompt.split()) * self.tokens_per_word) if isinstance(prompt, str) else len(prompt)

    def join(self, first: list[int] | str, second: list[int] | str) -> list[int] | str:
        return f"{first}\n{second}" if isinstance(first, str) else first + second

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


class Conversation:
    """One user's multi-turn session (a Shape with turns, W4): `next` draws the next turn's request,
    whose prompt is the whole history plus a new user message; `answered` appends the answer (text,
    or token ids) to the history. A session ends after its turns, or sooner when the next turn would
    not fit the context; the next request then opens a new one."""

    def __init__(self, shape: Shape, maker: PromptMaker):
        self.shape, self.maker = shape, maker
        self.history: list[int] | str | None = None  # the last prompt, then with its answer
        self.turns_left = 0
        self.turn = 0  # the turn number of the last request drawn (1 = the opening one)

    def next(self, rng: random.Random, prompt_scale: float, gen_scale: float, max_context: int) -> Request:
        gen = max(1, round(rng.randint(*self.shape.gen) * gen_scale))
        budget = int(max_context * 0.8) - gen  # a margin for templates and text-length estimates
        if self.turns_left > 0 and self.history is not None:
            message = self.maker.make(rng, max(1, round(rng.randint(*self.shape.turn_prompt) * prompt_scale)))
            if self.maker.length(self.history) + self.maker.length(message) <= budget:
                self.turns_left -= 1
                self.turn += 1
                self.history = self.maker.join(self.history, message)
                return Request(self.shape.name, None, self.history, gen)
        self.turns_left = rng.randint(*self.shape.turns) - 1
        self.turn = 1
        opening = max(1, min(round(rng.randint(*self.shape.prompt) * prompt_scale), budget))
        self.history = self.maker.make(rng, opening)
        return Request(self.shape.name, None, self.history, gen)

    def answered(self, answer: list[int] | str) -> None:
        """The answer to the last request, as text (text prompts) or ids (stand-ins of its length)."""
        if self.history is not None:
            self.history = self.maker.join(self.history, answer)
