"""The text of one sample as its tokens arrive: incremental detokenization, stop strings, held-back text.

The offline engine runs this in its own process (engine/output/processor.py). The server runs it in
the engine replica's process instead (engine/core_client.py), so that this per-token work never
delays the engine core's next step; a stop string found there is sent back to the core as `stop_sample`.

`push(ids)` feeds new tokens; `take(final)` returns the text ready to emit. While a stop string could
still begin in the tail of the text, that tail is held back; once a stop string is found, the text is
cut there (keeping the stop string only with include_stop_str_in_output) and later tokens are ignored.
"""

from __future__ import annotations

from engine.output.detokenizer import IncrementalDetokenizer


class TextStream:
    """Text of one sample; `text[:emitted]` has been handed out."""

    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str], include_stop: bool = False):
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.stop = stop
        self.include_stop = include_stop
        self.longest_stop = max(map(len, stop)) if stop else 0
        self.text = ""
        self.emitted = 0
        self.stopped = False  # a stop string ended the text

    def push(self, token_ids: list[int]) -> int | None:
        """Detokenize new tokens. When one of them completes a stop string, returns how many of them
        were taken (up to and including that one); the rest, and any later tokens, are ignored."""
        if self.stopped:
            return 0
        if not self.stop and len(token_ids) > 1:  # no stop string to place: the ids' text at once
            self.text += self.detok.push_many(token_ids)
            return None
        for taken, token in enumerate(token_ids, 1):
            self.text += self.detok.push(token)
            if self.stop and self._cut_stop_string():
                return taken
        return None

    def finish(self) -> None:
        """The sample ended without a stop string: add what the detokenizer still holds back."""
        if not self.stopped:
            self.text += self.detok.flush()

    def take(self, final: bool) -> str:
        """Text ready to emit: everything when final, else all but what could start a stop string."""
        hold = 0 if final or self.stopped or not self.stop else self.longest_stop - 1
        end = max(self.emitted, len(self.text) - hold)
        delta, self.emitted = self.text[self.emitted : end], end
        return delta

    def _cut_stop_string(self) -> bool:
        window = self.text[max(0, self.emitted - self.longest_stop) :]
        offset = len(self.text) - len(window)
        hits = [(window.find(s), s) for s in self.stop if s in window]
        if not hits:
            return False
        pos, s = min(hits)
        self.text = self.text[: offset + pos + (len(s) if self.include_stop else 0)]
        self.stopped = True
        return True
