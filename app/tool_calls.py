"""Tool calls in generated text: per-family parsers, and the streaming hold-back (issue 28).

Parsers (the server's `tool_call_parser`, chosen by model family when "auto": app/builder.py):
  * llama3_json: JSON objects `{"name": ..., "parameters": {...}}` (or "arguments"), optionally after
    `<|python_tag|>` or in a ``` fence, several separated by `;` or newlines, or a JSON array of them;
  * qwen3: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks;
  * gemma_json: like llama3_json, also inside a ``` fence (Gemma has no native tool format);
  * required: what tool_choice required / named forces (app/structured.tool_call_schema): one JSON array.
Only calls of the request's functions count; anything else is text. A `<tool_call>` block that does not
parse makes the whole answer plain content.

Streaming (`ToolCallStream`): text is sent as content until a call could start (a marker, a `{`, `[` or
``` at the start of a line, or a partial marker at the end); from there it is held back. When the
answer ends (or, for `required`, when the JSON array completes), the held text is parsed: the calls go
out whole and the rest as content. Invariant: the content sent while streaming is always a prefix of the
final content, so streamed and non-streamed answers agree; a whitespace-only prefix is never sent.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

PARSERS = ("llama3_json", "qwen3", "gemma_json")
_DECODER = json.JSONDecoder()
_LINE_START = re.compile(r"(?m)^[ \t]*([{\[`])")
_PYTHON_TAG = "<|python_tag|>"
_QWEN_OPEN, _QWEN_CLOSE = "<tool_call>", "</tool_call>"
_QWEN_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of an object, as OpenAI sends it
    id: str = field(default_factory=new_call_id)

    def as_dict(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class Parsed:
    content: str  # the text outside the calls (all of it when there are none)
    calls: list[ToolCall]


def _call(value: object, names: tuple[str, ...]) -> ToolCall | None:
    """A call object {"name", "parameters" | "arguments"} of an allowed function, else None."""
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    args = value.get("parameters", value.get("arguments"))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(value["name"], json.dumps(args, ensure_ascii=False))


def _calls(value: object, names: tuple[str, ...]) -> list[ToolCall] | None:
    """One call object or a non-empty array of them; None when anything in it is not a call."""
    items = value if isinstance(value, list) and value else [value]
    calls = [_call(v, names) for v in items]
    return None if any(c is None for c in calls) else calls


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class JsonCalls:
    """llama3_json and gemma_json: runs of JSON calls starting at the start of a line or a marker."""

    def __init__(self, names: tuple[str, ...], marker: str | None):
        self.names, self.marker = names, marker

    def hold_from(self, text: str, start: int) -> tuple[int, bool]:
        """(first index >= start where a call could begin, whether that is certain to stay a candidate)."""
        line = text.rfind("\n", 0, start) + 1  # `^` matches only at real line starts, so scan whole lines
        found = [m.start(1) for m in _LINE_START.finditer(text, line) if m.start(1) >= start]
        if self.marker:
            at = text.find(self.marker, start)
            found += [at] if at >= 0 else []
        if found:
            return min(found), True
        keep = _partial_suffix(text, self.marker) if self.marker else 0
        return max(start, len(text) - keep), False

    def parse(self, text: str) -> Parsed:
        starts = sorted({m.start(1) for m in _LINE_START.finditer(text)} | set(self._markers(text)))
        calls: list[ToolCall] = []
        pieces, done = [], 0  # text outside the runs; end of the last run
        for pos in starts:
            if pos < done:
                continue
            run = self._run(text, pos)
            if run is not None:
                pieces.append(text[done:pos])
                done = run[0]
                calls += run[1]
        return _assemble(text, pieces, done, calls)

    def _markers(self, text: str) -> list[int]:
        return [m.start() for m in re.finditer(re.escape(self.marker), text)] if self.marker else []

    def _run(self, text: str, i: int) -> tuple[int, list[ToolCall]] | None:
        """(end, calls) of the calls starting at i, separated by whitespace or ';'; None if none."""
        calls: list[ToolCall] = []
        end = i
        while True:
            j = _skip(text, end, " \t\r\n;" if calls else " \t\r\n")
            fenced = text.startswith("```", j)
            if fenced:
                j = text.find("\n", j) + 1 or len(text)
            if self.marker and text.startswith(self.marker, j):
                j += len(self.marker)
            j = _skip(text, j, " \t\r\n")
            try:
                value, j = _DECODER.raw_decode(text, j)
            except ValueError:
                break
            got = _calls(value, self.names)
            if got is None:
                break
            if fenced:
                j = _skip(text, j, " \t\r\n")
                j = j + 3 if text.startswith("```", j) else j
            calls, end = calls + got, j
        return (end, calls) if calls else None


def _skip(text: str, i: int, chars: str) -> int:
    while i < len(text) and text[i] in chars:
        i += 1
    return i


def _assemble(text: str, pieces: list[str], done: int, calls: list[ToolCall]) -> Parsed:
    """Content = the text before the first call as is, plus the non-blank text between and after."""
    if not calls:
        return Parsed(text, [])
    rest = [p for p in [*pieces[1:], text[done:]] if p.strip()]
    return Parsed(pieces[0] + "".join(rest), calls)


class QwenCalls:
    """qwen3: `<tool_call>` JSON `</tool_call>` blocks (the last one may be unclosed at the end)."""

    def __init__(self, names: tuple[str, ...]):
        self.names = names

    def hold_from(self, text: str, start: int) -> tuple[int, bool]:
        at = text.find(_QWEN_OPEN, start)
        if at >= 0:
            return at, True
        return max(start, len(text) - _partial_suffix(text, _QWEN_OPEN)), False

    def parse(self, text: str) -> Parsed:
        calls: list[ToolCall] = []
        pieces, done = [], 0
        for m in _QWEN_BLOCK.finditer(text):
            try:
                got = _calls(json.loads(m.group(1)), self.names)
            except ValueError:
                got = None
            if got is None:
                return Parsed(text, [])  # a block that is not a call: the answer is plain text
            pieces.append(text[done : m.start()])
            done, calls = m.end(), calls + got
        return _assemble(text, pieces, done, calls)


class RequiredCalls:
    """tool_choice required / named: the whole answer is one JSON array of calls (grammar-forced)."""

    def __init__(self, names: tuple[str, ...]):
        self.names = names

    def hold_from(self, text: str, start: int) -> tuple[int, bool]:
        return start, True  # everything is held until the array completes

    def complete(self, text: str) -> list[ToolCall] | None:
        """The calls once the array is whole (cheap check first: it must end with ']')."""
        stripped = text.strip()
        if not (stripped.startswith("[") and stripped.endswith("]")):
            return None
        try:
            value = json.loads(stripped)
        except ValueError:
            return None
        return _calls(value, self.names) if isinstance(value, list) else None

    def parse(self, text: str) -> Parsed:
        calls = self.complete(text)
        return Parsed("", calls) if calls else Parsed(text, [])


def make_parser(kind: str, names: tuple[str, ...]):
    """A parser by name: one of PARSERS, or "required"."""
    if kind == "required":
        return RequiredCalls(names)
    if kind == "qwen3":
        return QwenCalls(names)
    if kind in ("llama3_json", "gemma_json"):
        return JsonCalls(names, _PYTHON_TAG if kind == "llama3_json" else None)
    raise ValueError(f"unknown tool-call parser {kind!r}; one of {PARSERS} or 'required'")


def finish(parsed: Parsed, parallel: bool) -> tuple[str | None, list[ToolCall]]:
    """(message content, calls) as a response carries them: content null when blank beside calls;
    without parallel calls, only the first call is kept."""
    calls = parsed.calls if parallel else parsed.calls[:1]
    if calls and not parsed.content.strip():
        return None, calls
    return parsed.content, calls


class ToolCallStream:
    """One choice's content on its way out while streaming (see the module docstring)."""

    def __init__(self, parser, parallel: bool):
        self.parser, self.parallel = parser, parallel
        self.text = ""
        self.sent = 0  # text[:sent] went out as content; invariant: a prefix of the final content
        self.locked = False  # a certain candidate was found at `sent`: hold everything from there
        self.called = False  # calls went out (finish_reason becomes tool_calls)
        self.over = False  # required mode: the array completed; later text is plain content

    def feed(self, piece: str, finished: bool) -> tuple[str, list[ToolCall]]:
        """(content to send now, calls to send now) for the next piece of content."""
        self.text += piece
        if self.over:
            return self._send(len(self.text)), []
        if isinstance(self.parser, RequiredCalls):
            calls = self.parser.complete(self.text)
            if calls:
                self.over, self.called, self.sent = True, True, len(self.text)
                return "", calls if self.parallel else calls[:1]
        if finished:
            return self._finish()
        if not self.locked:
            hold, self.locked = self.parser.hold_from(self.text, self.sent)
            if self.text[:hold].strip():  # never a whitespace-only prefix (it may turn out to be all)
                return self._send(hold), []
        return "", []

    def _send(self, upto: int) -> str:
        out, self.sent = self.text[self.sent : upto], upto
        return out

    def _finish(self) -> tuple[str, list[ToolCall]]:
        content, calls = finish(self.parser.parse(self.text), self.parallel)
        self.called = bool(calls)
        rest = (content or "")[self.sent :]
        self.sent = len(self.text)
        return rest, calls


@dataclass(frozen=True)
class ToolParsing:
    """What a response looks for in each choice: `kind` (a parser name or "required"), the functions
    that may be called, and whether several calls are allowed."""

    kind: str
    names: tuple[str, ...]
    parallel: bool

    def stream(self) -> ToolCallStream:
        return ToolCallStream(make_parser(self.kind, self.names), self.parallel)


# config.json model_type -> the parser `tool_call_parser: auto` picks
PARSER_BY_MODEL_TYPE = {
    "llama": "llama3_json",
    "qwen3": "qwen3",
    "qwen2": "qwen3",
    "gemma3": "gemma_json",
    "gemma3_text": "gemma_json",
}


def resolve_parser(setting: str, model_type: str | None) -> str:
    """The server's parser: the setting, or with "auto" the family's ("none" for an unknown family)."""
    if setting == "auto":
        return PARSER_BY_MODEL_TYPE.get(model_type or "", "none")
    if setting not in (*PARSERS, "none"):
        raise ValueError(f"tool_call_parser: must be auto, none or one of {PARSERS}, got {setting!r}")
    return setting
