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

A Hugging Face fast tokenizer (`tokenizer.rust`, a tokenizers.Tokenizer) runs this same scheme in Rust:
tokenizers' DecodeStream keeps the window and decodes it, several times cheaper per token than two
decode calls from Python. The offsets here follow its windows. flush(), the MAX_PENDING cut and a
window whose text ends inside a character (which DecodeStream would restart differently) take the
Python path, and the stream restarts at the next boundary; tests check both paths give the same deltas.
"""

from __future__ import annotations

from typing import Protocol

from tokenizers.decoders import DecodeStream

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
        self._rust = getattr(tokenizer, "rust", None)  # the fast path; None: two decodes per push here
        self._stream: DecodeStream | None = None
        self._start_stream()

    def _start_stream(self) -> None:
        """At a window boundary: stream in Rust from here when the tokenizer allows it and the window's
        text is whole (DecodeStream restarts a window that ends inside a character otherwise than this
        class does); else the two-decode path, which tries again at its next emit."""
        window = self._ids[self._prefix_offset :]
        whole = self._rust is not None and not self._decode(window).endswith(REPLACEMENT_CHAR)
        self._stream = DecodeStream(ids=window, skip_special_tokens=self._skip) if whole else None

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def _pending_text(self) -> str:
        """Text of the not-yet-emitted tokens, decoded in the context of the last emitted window."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        return full_text[len(prefix_text) :]

    def _emit(self, delta: str, end: int | None = None) -> str:
        """Emit `delta`, the text of ids up to `end` (all of them by default)."""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids) if end is None else end
        if delta:
            self._parts.append(delta)
            self._text_cache = None
        return delta

    def _emit_here(self, delta: str) -> str:
        """Emit text decoded by this class (not by the stream), then stream from the new boundary."""
        self._emit(delta)
        if self._rust is not None:
            self._start_stream()
        return delta

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        forced = len(self._ids) - self._read_offset > MAX_PENDING
        if self._stream is not None:
            delta = self._stream.step(self._rust, self._ids[-1])
            if delta is not None:  # the test below, made in Rust: new text, no partial character
                return self._emit(delta)
            return self._emit_here(self._pending_text()) if forced else ""
        delta = self._pending_text()
        if forced:  # invalid bytes or a long run of skipped specials: stop holding back
            return self._emit_here(delta)
        if not delta or delta.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new yet (a skipped special token), or a character still missing bytes
        return self._emit_here(delta)

    def push_many(self, token_ids: list[int]) -> str:
        """Several ids at once, for a caller that needs no text between them (no stop strings): decodes
        of the window here instead of a stream step per id. When the text ends inside a character, the
        text before that character's tokens (at most 3) is emitted and they wait for the next push, as
        in `push`; the Rust stream restarts at the next single push."""
        self._ids += map(int, token_ids)
        self._stream = None  # its window is behind: `push` decodes here, then restarts it at the boundary
        end, start = len(self._ids), self._read_offset
        prefix_text = self._decode(self._ids[self._prefix_offset : start])
        for cut in range(end, max(start, end - 4), -1):  # drop up to 3 trailing ids: a 4-byte character's
            delta = self._decode(self._ids[self._prefix_offset : cut])[len(prefix_text) :]
            if delta and not delta.endswith(REPLACEMENT_CHAR):
                return self._emit(delta, cut)
        if end - start - len(token_ids) > MAX_PENDING:  # held back too long: invalid bytes, as in `push`
            return self._emit(self._pending_text())
        return ""

    def flush(self) -> str:
        """Emit whatever is held back (at the end of generation); later pushes continue from here."""
        if self._read_offset == len(self._ids):
            return ""
        return self._emit_here(self._pending_text())

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of the returned deltas)."""
        if self._text_cache is None:
            self._text_cache = "".join(self._parts)
        return self._text_cache
