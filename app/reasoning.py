"""Reasoning output of thinking models: `<think>...</think>` at the start of the output is split off.

One `ThinkSplitter` per chat choice, fed the choice's text item by item (streaming or not), returns
(reasoning, content) for each piece. The rules, as vLLM's think parsers apply them:
  * the output starts with `<think>` (after whitespace), or the prompt left the model inside an open
    `<think>` (the template wrote it: `starts_in_think`): the text up to `</think>` is reasoning, the
    rest is content; the two tags themselves are in neither;
  * no `</think>` ever comes: everything is reasoning;
  * the output does not start with `<think>`: everything is content.
A tag may arrive split over two items, so a piece that could be the start of the awaited tag is held
back (a few characters) until the next piece or `finish` decides it. Work is per item, never per token.
"""

from __future__ import annotations

from app.chat import THINK_CLOSE, THINK_OPEN

_START, _THINK, _CONTENT = 0, 1, 2


def _partial_tag_at_end(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (0 when none)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ThinkSplitter:
    def __init__(self, starts_in_think: bool = False):
        self._state = _THINK if starts_in_think else _START
        self._held = ""  # text not yet assigned: a possible partial tag (or leading whitespace)

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) decided by this piece; what is still undecided waits for the next."""
        text = self._held + text
        self._held = ""
        reasoning = ""
        if self._state == _START:
            stripped = text.lstrip()
            if stripped.startswith(THINK_OPEN):
                self._state, text = _THINK, stripped[len(THINK_OPEN) :]
            elif THINK_OPEN.startswith(stripped):  # empty, whitespace only, or a partial "<think>"
                self._held = text
                return "", ""
            else:
                self._state = _CONTENT
        if self._state == _THINK:
            end = text.find(THINK_CLOSE)
            if end < 0:
                keep = _partial_tag_at_end(text, THINK_CLOSE)
                self._held = text[len(text) - keep :] if keep else ""
                return text[: len(text) - keep], ""
            reasoning, text = text[:end], text[end + len(THINK_CLOSE) :]
            self._state = _CONTENT
        return reasoning, text

    def finish(self) -> tuple[str, str]:
        """The held text, once the choice is finished: a partial tag is plain text after all."""
        held, self._held = self._held, ""
        return (held, "") if self._state == _THINK else ("", held)
