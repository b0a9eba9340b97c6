"""Helpers for tests/test_hardening.py: hand-written bad requests, request bodies from the server's
OpenAPI schema (hypothesis), and a file watch that sees every open() of a path by any process on this
machine (Linux inotify).
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
from pathlib import Path

from hypothesis import strategies as st

# ---------------------------------------------------------------- hand-written bad requests


def bad_cases(model: str, max_len: int) -> list[tuple[str, object, int, str | None]]:
    """(path, body (dict or raw bytes), status, param) — each must be refused with that status."""
    c, ch = "/v1/completions", "/v1/chat/completions"
    base = {"model": model, "prompt": "hi", "max_tokens": 2}
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    raw = json.dumps(base)[:-1]  # '{"model": ..., "max_tokens": 2' : append fields as raw JSON text
    cases = [
        (c, {**base, "prompt": 5}, 422, "prompt"),
        (c, {**base, "temperature": "hot"}, 422, "temperature"),
        (c, {**base, "n": 1.5}, 422, "n"),
        (c, {**base, "stream": [1]}, 422, "stream"),
        (c, {**base, "stop": 7}, 422, "stop"),
        (ch, {**chat, "messages": "hi"}, 422, "messages"),
        (ch, {**chat, "messages": []}, 422, "messages"),
        (ch, {**chat, "messages": [{"role": "wizard", "content": "x"}]}, 422, "messages"),
        (c, {**base, "max_tokens": -1}, 422, "max_tokens"),
        (c, {**base, "max_tokens": 10**9}, 400, "max_tokens"),
        (c, {**base, "max_tokens": 10**30}, 400, "max_tokens"),
        (c, {**base, "n": 0}, 422, "n"),
        (c, {**base, "n": 1000}, 422, "n"),
        (c, {**base, "top_p": 0}, 422, "top_p"),
        (c, {**base, "top_p": 1.5}, 422, "top_p"),
        (c, {**base, "seed": -1}, 422, "seed"),
        (c, {**base, "logprobs": 1000}, 422, "logprobs"),
        (c, {**base, "prompt": [7] * max_len}, 400, "prompt"),  # the prompt alone fills the context
        (c, {**base, "prompt": [7] * 1400}, 400, "prompt"),  # fits the model's context, not this KV pool
        (c, {**base, "prompt": [5, 2048]}, 422, "prompt"),  # vocab_size is 2048
        (c, {**base, "prompt": [-1]}, 422, "prompt"),
        (c, {**base, "prompt": [[3], [10**12]]}, 422, "prompt"),
        (c, {**base, "prompt": []}, 422, "prompt"),
        (c, {**base, "stop": ["a"] * 17}, 422, "stop"),
        (c, {**base, "stop": "x" * 300}, 422, "stop"),
        (c, {**base, "frobnicate": 1}, 422, "frobnicate"),
        (c, {**base, "stream_options": {"include_usage": True, "extra": 1}}, 422, "stream_options"),
        (c, {**base, "prompt": json.loads("[" * 200 + "]" * 200)}, 422, "prompt"),
        (c, [], 422, None),
    ]
    for field in ("temperature", "top_p", "presence_penalty"):
        for literal in ("NaN", "Infinity", "-Infinity"):  # not JSON, but Python's json reads them
            cases.append((c, f'{raw}, "{field}": {literal}}}'.encode(), 422, field))
    cases += [
        (c, b'{"model": "' + model.encode() + b'", "prompt": "h\xff\xfei"}', 400, None),  # bad UTF-8
        (c, b"[" * 100_000, 400, None),  # nested deeper than any parser's recursion limit
        (c, f'{raw}, "seed": {"9" * 5000}}}'.encode(), 400, None),  # an integer of 5000 digits
        (c, b"", 422, None),
    ]
    return cases


# ---------------------------------------------------------------- fuzzing from the OpenAPI schema

# Numbers a validator has to think about; the small ranges keep valid requests cheap (short outputs).
_INTS = st.one_of(st.integers(-3, 24), st.sampled_from([-(2**63), 2**31, 2**63, 10**30]))
_FLOATS = st.one_of(
    st.floats(-3, 3, allow_nan=False), st.sampled_from([0.0, -0.0, 1e-300, 1.0000001, 1e308, -1e308])
)
_ANY_JSON = st.recursive(
    st.none() | st.booleans() | _INTS | _FLOATS | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)


def body_strategy(schema: dict, name: str, model: str) -> st.SearchStrategy:
    """Request bodies for the component schema `name`: mostly well-typed by the schema, with values
    at and beyond the edges, some fields of the wrong type and some unknown fields."""
    defs = schema["components"]["schemas"]
    well_typed = _from_schema(defs[name], defs, top_model=model)
    wrong_types = st.dictionaries(
        st.sampled_from(sorted(defs[name]["properties"]) + ["unknown_field"]), _ANY_JSON, max_size=3
    )
    return st.one_of(
        well_typed,
        st.tuples(well_typed, wrong_types).map(lambda pair: {**pair[0], **pair[1]}),
    )


def _from_schema(s: dict, defs: dict, top_model: str | None = None) -> st.SearchStrategy:
    if "$ref" in s:
        return _from_schema(defs[s["$ref"].rsplit("/", 1)[1]], defs)
    if "anyOf" in s:
        return st.one_of([_from_schema(x, defs) for x in s["anyOf"]])
    if "const" in s:
        return st.just(s["const"])
    if "enum" in s:
        return st.sampled_from(s["enum"])
    kind = s.get("type")
    if kind == "object":
        props = {k: _from_schema(v, defs) for k, v in s.get("properties", {}).items()}
        if top_model is not None:  # mostly the served model, so requests get past the model check
            props["model"] = st.one_of(st.just(top_model), st.just(top_model), st.text(max_size=12))
        required = {k: v for k, v in props.items() if k in s.get("required", [])}
        optional = {k: v for k, v in props.items() if k not in required}
        return st.fixed_dictionaries(required, optional=optional)
    if kind == "array":
        return st.lists(_from_schema(s.get("items", {}), defs), max_size=4)
    simple = {
        "string": st.text(max_size=16),
        "integer": _INTS,
        "number": _FLOATS,
        "boolean": st.booleans(),
        "null": st.none(),
    }
    return simple.get(kind, _ANY_JSON)


# ---------------------------------------------------------------- inotify

_IN_ACCESS, _IN_OPEN = 0x001, 0x020
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (then `len` bytes of name)


class OpenWatch:
    """Records opens and reads of a directory and the files in it, by any process (inotify)."""

    def __init__(self, path: Path):
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        if self._libc.inotify_add_watch(self.fd, str(path).encode(), _IN_OPEN | _IN_ACCESS) < 0:
            raise OSError(ctypes.get_errno(), f"inotify_add_watch({path}) failed")

    def events(self) -> list[tuple[int, str]]:
        """(mask, name) of the events since the last call; name is '' for the directory itself."""
        out = []
        while True:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                return out
            pos = 0
            while pos < len(data):
                _, mask, _, size = _EVENT.unpack_from(data, pos)
                name = data[pos + _EVENT.size : pos + _EVENT.size + size].rstrip(b"\0").decode()
                out.append((mask, name))
                pos += _EVENT.size + size

    def close(self) -> None:
        os.close(self.fd)
