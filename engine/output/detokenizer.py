"""Incremental detokenization: turn a stream of token ids into text deltas, one push at a time.

Decoding each new token alone is wrong (a multi-byte character can span several byte-level tokens,
and some tokenizers drop a leading space at the start of a decode), and re-decoding everything is
quadratic. Instead two offsets into the id list bound a small window:

    ids:  ... | prefix_offset ........ read_offset ........ len(ids)
                 (already emitted text,    (new tokens, not yet
                  decoded again as context)  emitted)

Each push decodes ids[prefix_offset:read_offset] and ids[prefix_offset:]; the new text is the second
minus the first. It is emitted only when it does not end in U+FFFD (an incomplete UTF-8 character
decodes to U+FFFD until its last byte arrives). Because an emitted window always ends on a complete
character, decoding can restart at its boundary without changing the text: the concatenated deltas
(plus flush()) equal one decode of all the ids.
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT = 6  # prompt tokens kept as left context for the first generated tokens
# A UTF-8 character is at most 4 bytes, so more pending tokens than this that still end in U+FFFD are
# invalid bytes (or a run of skipped special tokens): emit them rather than let the window, and so each
# decode, grow without bound. The price, only in such garbage streams: a character whose first bytes were
# emitted this way shows as U+FFFD even if its remaining bytes arrive later.
MAX_PENDING = 16


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...


class IncrementalDetokenizer:
    """Push generated ids one at a time; each push returns the text it completes (possibly "")."""

    def __init__(
        self, tokenizer: _Decoder, prompt_ids: list[int] | None = None, skip_special_tokens: bool = False
    ):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        # Only the tail of the prompt is needed as context; its text is never emitted.
        self._ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT:]) if prompt_ids else []
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._parts: list[str] = []
        self._text_cache: str | None = ""

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def _pending_text(self) -> str:
        """Text of the not-yet-emitted tokens, decoded in the context of the last emitted window."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        return full_text[len(prefix_text) :]

    def _emit(self, delta: str) -> str:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        if delta:
            self._parts.append(delta)
            self._text_cache = None
        return delta

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        delta = self._pending_text()
        if len(self._ids) - self._read_offset > MAX_PENDING:
            return self._emit(delta)  # invalid bytes or a long run of skipped specials: stop holding back
        if not delta or delta.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new yet (a skipped special token), or a character still missing bytes
        return self._emit(delta)

    def flush(self) -> str:
        """Emit whatever is held back (at the end of generation); later pushes continue from here."""
        if self._read_offset == len(self._ids):
            return ""
        return self._emit(self._pending_text())

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of the returned deltas)."""
        if self._text_cache is None:
            self._text_cache = "".join(self._parts)
        return self._text_cache
