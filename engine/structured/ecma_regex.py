"""Regular expressions as ECMAScript reads them, rewritten for llguidance's Rust syntax.

llguidance parses regexes as Rust's regex crate does, where `\\d` and `\\w` are Unicode classes: `\\d`
accepts Arabic-Indic or Mongolian digits, `\\w` any letter of any script. ECMAScript, JSON Schema's
`pattern`, and the grammar backends of other servers read `\\d` as `[0-9]` and `\\w` as
`[A-Za-z0-9_]`, and a client that asks for an IPv4 address means ASCII digits. So every regex the API
accepts (the `regex` constraint, JSON-schema `pattern` and `patternProperties`, tool schemas, the
`/.../` terminals of Lark grammars) has `\\d \\D \\w \\W` replaced by their ASCII classes before it is
compiled. `\\s` keeps Unicode whitespace, as in ECMAScript. Inside a bracket class a shorthand becomes
a nested class (`[a\\D]` -> `[a[^0-9]]`), which Rust's syntax unions; so `[\\w-z]` keeps its literal
`-` rather than turning into a range.

Features llguidance cannot compile are refused here with their name: word boundaries (`\\b`, `\\B`),
look-around (`(?=`, `(?!`, `(?<=`, `(?<!`) and back-references (`\\1`, `\\k<name>`).
"""

from __future__ import annotations

import json

ASCII = {"d": "0-9", "w": "0-9A-Za-z_"}
UNSUPPORTED_GROUPS = {"(?=": "look-ahead (?=", "(?!": "negative look-ahead (?!",
                      "(?<=": "look-behind (?<=", "(?<!": "negative look-behind (?<!"}  # fmt: skip


def ecma_classes(regex: str) -> str:
    """`regex` with ECMAScript's ASCII `\\d \\D \\w \\W`; ValueError naming an unsupported feature."""
    out: list[str] = []
    depth, i = 0, 0  # depth: nesting of bracket classes (Rust allows classes within classes)
    while i < len(regex):
        c = regex[i]
        if c == "\\" and i + 1 < len(regex):
            out.append(_escape(regex[i + 1], inside=depth > 0))
            i += 2
            continue
        if c == "[":
            depth += 1
            opened = regex[i : i + 2] if regex[i + 1 : i + 2] == "^" else c
            out.append(opened)
            i += len(opened)
            if regex[i : i + 1] == "]":  # a `]` first in a class is a literal
                out.append("]")
                i += 1
            continue
        if c == "]" and depth:
            depth -= 1
        elif c == "(" and not depth:
            _check_group(regex, i)
        out.append(c)
        i += 1
    return "".join(out)


def _escape(ch: str, inside: bool) -> str:
    """The text for the escape `\\ch`, inside a bracket class or not."""
    if ch.lower() in ASCII:  # inside a class too a nested class: `[\w-z]` stays \w, `-`, `z`
        return f"[{'^' if ch.isupper() else ''}{ASCII[ch.lower()]}]"
    if ch in "bB" and not inside:
        raise ValueError(f"the word boundary \\{ch} is not supported; match the characters instead")
    if ch.isdigit() and ch != "0" or ch == "k":
        raise ValueError(f"back-references (\\{ch}...) are not supported")
    return "\\" + ch


def _check_group(regex: str, i: int) -> None:
    for opener, name in UNSUPPORTED_GROUPS.items():
        if regex.startswith(opener, i):
            raise ValueError(f"{name} is not supported (no look-around); rewrite it without")


def schema_patterns(schema_json: str) -> str:
    """A JSON schema's text with every `pattern` string and `patternProperties` key rewritten."""
    schema = json.loads(schema_json)
    return json.dumps(_walk(schema), separators=(",", ":"), allow_nan=False)


def _walk(node):
    if isinstance(node, list):
        return [_walk(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "pattern" and isinstance(value, str):
            out[key] = ecma_classes(value)
        elif key == "patternProperties" and isinstance(value, dict):
            out[key] = {ecma_classes(k): _walk(v) for k, v in value.items()}
        else:
            out[key] = _walk(value)
    return out


def lark_regexes(grammar: str) -> str:
    """A Lark grammar with the body of every `/.../` terminal rewritten; strings and `//` comments
    are copied as they are."""
    out, i = [], 0
    while i < len(grammar):
        c = grammar[i]
        if c == '"':
            end = _string_end(grammar, i)
            out.append(grammar[i:end])
            i = end
        elif grammar.startswith("//", i):
            end = grammar.find("\n", i)
            end = len(grammar) if end < 0 else end
            out.append(grammar[i:end])
            i = end
        elif c == "/":
            end = _string_end(grammar, i, quote="/")
            out.append("/" + ecma_classes(grammar[i + 1 : end - 1]) + "/")
            i = end
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _string_end(text: str, start: int, quote: str = '"') -> int:
    """The index after the quote that closes the literal opened at `start` (escapes skipped)."""
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == quote:
            return i + 1
        i += 1
    raise ValueError(f"unterminated {quote}...{quote} literal at character {start}")
