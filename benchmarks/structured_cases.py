"""Constraints shared by the structured-output tests (tests/test_structured_engine.py) and the benchmark
(benchmarks/structured_bench.py): JSON schemas, regexes, choices and Lark grammars that a random model
can finish at temperature 1 (strings have maxLength, arrays maxItems, objects no extra properties)."""

from __future__ import annotations


def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
    }


_INT = {"type": "integer", "minimum": 0, "maximum": 999}
_POINT = _obj(
    {
        "x": {"type": "integer", "minimum": -9, "maximum": 9},
        "y": {"type": "integer", "minimum": -9, "maximum": 9},
    }
)

SCHEMAS: list[dict] = [
    _obj(
        {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 120}}
    ),
    _obj(
        {
            "user": _obj(
                {"id": _INT, "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}
            )
        }
    ),
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 4},
    {"type": "string", "enum": ["red", "green", "blue"]},
    _obj({"version": {"const": 2}, "kind": {"const": "fixed"}}),
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 10}, {"type": "string", "maxLength": 5}]},
    {"$defs": {"pt": _POINT}, **_obj({"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}})},
    {"type": "number", "minimum": -1.5, "maximum": 2.5},
    {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
    {"type": "object", "properties": {}, "additionalProperties": False},
    {"type": "boolean"},
    _obj({"a": {"type": "boolean"}, "b": {"type": "null"}, "c": {"enum": [1, 2]}}, required=["b"]),
    {
        "type": "array",
        "items": _obj({"k": {"enum": ["a", "b"]}, "v": {"type": "integer", "minimum": 0, "maximum": 5}}),
        "maxItems": 3,
    },
    _obj({"day": {"type": "string", "format": "date"}}),
    {
        "oneOf": [
            _obj({"kind": {"const": "a"}, "n": {"type": "integer", "minimum": 0, "maximum": 3}}),
            _obj({"kind": {"const": "b"}, "s": {"type": "string", "maxLength": 4}}),
        ]
    },
    {
        "type": "array",
        "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["x", "y"]}],
        "items": False,
    },
    {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 100},
    {"type": "string", "minLength": 3, "maxLength": 6},
    {"type": ["integer", "null"], "minimum": 0, "maximum": 50},
    _obj({"a": _obj({"b": _obj({"c": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}})})}),
    {"enum": [1, "two", None, True]},
    _obj(
        {
            "items": {
                "type": "array",
                "items": {"type": "string", "maxLength": 4},
                "minItems": 2,
                "maxItems": 3,
            },
            "total": {"type": "number", "minimum": 0, "maximum": 100},
        }
    ),
    # the JSON-text form of a schema
    '{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], '
    '"additionalProperties": false}',
]

REGEXES: list[str] = [
    r"[0-9]{3}-[0-9]{4}",
    r"(cat|dog|bird)s?",
    r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)",
    r"-?[0-9]{1,4}(\.[0-9]{1,2})?",
    r"[01]{1,16}",
    r"[A-Z][a-z]{1,8} [A-Z][a-z]{1,8}",
    r"#[0-9a-f]{6}",
    r"(yes|no|maybe)",
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}",
    r"[a-z]{1,8}( [a-z]{1,8}){0,3}",
    r"\(([0-9]{1,2},){0,3}[0-9]{1,2}\)",
    r"(ab|cd){2,4}e?",
]

CHOICES: list[list[str]] = [
    ["apple", "banana", "cherry pie"],
    ["positive", "negative", "neutral"],
    ["A", "B", "C", "D"],
]

# (Lark grammar, a regex of the same language for checking)
GRAMMARS: list[tuple[str, str]] = [
    ('start: NUM " " OP " " NUM\nNUM: /[0-9]{1,3}/\nOP: "+" | "-" | "*"\n', r"[0-9]{1,3} [+*-] [0-9]{1,3}"),
    (
        'start: "(" pair ")"\npair: WORD "=" NUM\nWORD: /[a-z]{1,5}/\nNUM: /[0-9]{1,2}/\n',
        r"\([a-z]{1,5}=[0-9]{1,2}\)",
    ),
]
