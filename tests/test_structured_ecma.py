"""Regex classes mean what they mean in ECMAScript (engine/structured/ecma_regex.py).

The reference is Python's `re` with re.ASCII, where `\\d` is [0-9] and `\\w` is [A-Za-z0-9_], as in
ECMAScript: the compiled constraint must accept a string exactly when that regex fully matches it,
for strings mixing ASCII with Arabic-Indic, Mongolian and Devanagari digits and non-Latin letters.
Then the engine at temperature 1 (200 samples per constraint) may only write ASCII where a class asks
for digits or word characters: in a `regex` constraint, in a JSON-schema `pattern` and in a Lark
terminal. Features llguidance cannot compile are refused naming the feature and the field.
"""

from __future__ import annotations

import json
import random
import re

import pytest

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from engine.structured.compiler import compiler_for
from engine.structured.ecma_regex import ecma_classes
from tests.structured_helpers import make_engine, run, so

pytest.importorskip("llguidance")
pytestmark = pytest.mark.engine

IPV4 = r"((25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(25[0-5]|2[0-4]\d|1?\d?\d)"
REGEXES = [r"\d+", r"\w{3,8}", r"[a\D]+", r"[\w-]+", r"[^\d\s]+", r"\W+", r"x\d\w", IPV4]
# ASCII and its look-alikes: Arabic-Indic, Mongolian and Devanagari digits, Greek, Cyrillic, accents
# (no Unicode spaces: re.ASCII's \s is ASCII, ECMAScript's is not; test_whitespace_stays_unicode)
ALPHABET = list("0123459az_Z-. ") + list("٣٤᠔५αбé")


@pytest.fixture(scope="module")
def compiler(tiny_model_dir):
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(str(tiny_model_dir))
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    return tok, compiler_for(tok, vocab)


def accepts(tok, matcher, text: str) -> bool:
    m = matcher.deep_copy()
    ids = tok.hf.encode(text, add_special_tokens=False)
    return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()


@pytest.mark.parametrize("regex", REGEXES)
def test_classes_accept_what_ascii_re_accepts(compiler, regex: str) -> None:
    tok, comp = compiler
    matcher = comp.prototype(so("regex", regex))
    rng = random.Random(regex)
    strings = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 9))) for _ in range(150)]
    strings += ["192.168.0.1", "١٩٢.١٦٨.٠.١", "x5y", "x٥y", "abc", "αβγ"]
    wrong = [s for s in strings if accepts(tok, matcher, s) != bool(re.fullmatch(regex, s, re.ASCII))]
    assert not wrong, f"{regex}: {len(wrong)} strings judged unlike re.ASCII, e.g. {wrong[:5]}"


def test_shorthand_before_a_dash_in_a_class_stays_a_class(compiler) -> None:
    """ECMAScript reads [\\w-z] as \\w, '-', 'z' (a class escape ends no range)."""
    tok, comp = compiler
    matcher = comp.prototype(so("regex", r"[\w-z]+"))
    assert ecma_classes(r"[\w-z]") == "[[0-9A-Za-z_]-z]"
    assert all(accepts(tok, matcher, s) for s in ["a-z", "_9-", "zz"])
    assert not any(accepts(tok, matcher, s) for s in ["^", "é", "٣"])


REFUSED = [(r"\bword\b", r"\b"), (r"a(?=b)", "look-ahead"), (r"(?<!a)b", "negative look-behind"),
           (r"(a)\1", "back-reference")]  # fmt: skip


def test_whitespace_stays_unicode(compiler) -> None:
    r"""ECMAScript's \s includes Unicode spaces (no-break space, em space), unlike re.ASCII's."""
    tok, comp = compiler
    matcher = comp.prototype(so("regex", r"a\sb"))
    assert all(accepts(tok, matcher, f"a{space}b") for space in " \t\u00a0\u2003")
    assert not accepts(tok, matcher, "a_b")


@pytest.mark.parametrize("regex,feature", REFUSED)
def test_unsupported_features_are_refused_by_name(compiler, regex: str, feature: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        compiler[1].prototype(so("regex", regex))
    assert err.value.field == "response_format" and feature in str(err.value)


def _ascii_only(outputs: list[dict], expect) -> list[str]:
    texts = [text for samples in outputs for _, text, _ in samples.values()]
    assert len(texts) == 200
    return [t for t in texts if not t.isascii() or not expect(t)]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return make_engine(tiny_model_dir)


@pytest.mark.parametrize("kind,spec,expect", [
    ("regex", IPV4, lambda t: re.fullmatch(IPV4, t, re.ASCII) is not None),
    ("regex", r"\w{3,8}", lambda t: re.fullmatch(r"\w{3,8}", t, re.ASCII) is not None),
    ("json", {"type": "object", "properties": {"ip": {"type": "string", "pattern": "^" + IPV4 + "$"}},
              "required": ["ip"], "additionalProperties": False},
     lambda t: re.fullmatch(IPV4, json.loads(t)["ip"], re.ASCII) is not None),
    ("grammar", 'start: WORD "." NUM\nWORD: /\\w{3,8}/\nNUM: /\\d{1,4}/',
     lambda t: re.fullmatch(r"\w{3,8}\.\d{1,4}", t, re.ASCII) is not None),
], ids=["ipv4", "word", "schema-pattern", "lark"])  # fmt: skip
def test_samples_at_temperature_1_are_ascii(engine, kind: str, spec, expect) -> None:
    params = [SamplingParams(n=10, max_tokens=60, temperature=1.0, seed=s, structured=so(kind, spec))
              for s in range(20)]  # fmt: skip
    outputs = run(engine, [("Write it:", p) for p in params])
    bad = _ascii_only(outputs, expect)
    assert not bad, f"{len(bad)} of 200 samples break the ASCII class, e.g. {bad[:3]}"
