"""Structured output: checking a StructuredOutput, compiling it with llguidance, caching the result.

A constraint (SamplingParams.structured) is compiled once per tokenizer into a fresh llguidance
matcher, the *prototype*; every constrained sequence starts from a deep copy of it (microseconds).
Prototypes are kept in an LRU keyed by (kind, canonical spec), so a schema that many requests share
is compiled once per process (once in the server's replica, which validates, and once in the engine
core, which generates).

Every failure is an InvalidRequestError that names the API field the constraint came from: an unknown
kind, a malformed spec, an invalid regex, a JSON-schema feature llguidance does not implement, a Lark
grammar that does not compile, or a grammar that exceeds the compile limits below. A constraint is
never dropped silently.

Compile limits: a spec longer than MAX_SPEC_CHARS is refused unread. llguidance's fuel (`limits()`)
bounds the work: building the lexer may spend INITIAL_LEXER_FUEL units (llguidance's count of regex
analysis work, so the bound holds whatever the host's speed) and the grammar may hold MAX_GRAMMAR_SIZE
symbols; past either, the compile stops with an error that says so. Each compile also runs on its own
thread with a large stack and is abandoned after COMPILE_TIMEOUT_S of wall time (`_in_compile_thread`).
Mask computation per step is bounded by fuel as well (STEP_LEXER_FUEL, STEP_MAX_ITEMS).

No torch here: the replica imports this module without the model.
"""

from __future__ import annotations

import copy
import json
import threading
from collections import OrderedDict

from engine.errors import InvalidRequestError
from engine.sampling_params import StructuredOutput
from engine.structured.ecma_regex import ecma_classes, lark_regexes, schema_patterns

KINDS = ("json", "json_object", "regex", "choice", "grammar")
CACHE_SIZE = 256  # prototypes kept per tokenizer
MAX_SPEC_CHARS = 100_000  # a larger spec is refused before it is parsed
COMPILE_TIMEOUT_S = 10.0  # wall-clock bound on one compile (besides the fuel below)
COMPILE_STACK_MB = 256  # stack of the compile thread (reserved address space; used only by deep grammars)
INITIAL_LEXER_FUEL = 2_000_000
MAX_GRAMMAR_SIZE = 200_000
STEP_LEXER_FUEL = 200_000
STEP_MAX_ITEMS = 50_000
# JSON is generated in json.dumps' layout ({"a": 1, "b": [2, 3]}): no free whitespace, which a model
# could otherwise repeat without end; a schema's own "x-guidance" options override this
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _fail(so: StructuredOutput, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"{so.field}: {message}", field=so.field)


def canonical(so: StructuredOutput) -> str:
    """The cache key's spec part: equal constraints give equal strings (whatever the JSON spacing).
    Raises InvalidRequestError when the spec has the wrong shape for its kind."""
    if not isinstance(so, StructuredOutput):
        raise InvalidRequestError(
            "structured_outputs: must be a StructuredOutput", field="structured_outputs"
        )
    if so.kind not in KINDS:
        raise _fail(so, f"unknown kind {so.kind!r}; use one of {', '.join(KINDS)}")
    spec = so.spec
    if so.kind == "json":
        text = _schema_text(so)
    elif so.kind == "json_object":
        if spec is not None:
            raise _fail(so, "kind 'json_object' takes no spec (it allows any JSON object)")
        text = ""
    elif so.kind == "choice":
        if not isinstance(spec, (list, tuple)) or not spec or not all(isinstance(c, str) for c in spec):
            raise _fail(so, "choice needs a non-empty list of strings")
        if any(c == "" for c in spec):
            raise _fail(so, "choice strings must not be empty")
        text = json.dumps(list(spec))
    else:  # regex, grammar
        if not isinstance(spec, str) or not spec.strip():
            raise _fail(so, f"{so.kind} needs a non-empty string")
        text = spec
    if len(text) > MAX_SPEC_CHARS:
        raise _fail(so, f"the {so.kind} is longer than {MAX_SPEC_CHARS} characters")
    return text


def _schema_text(so: StructuredOutput) -> str:
    """A JSON schema (dict or JSON text) as compact JSON text; key order kept: it is the order in
    which properties are generated."""
    spec = so.spec
    if isinstance(spec, str):
        if len(spec) > MAX_SPEC_CHARS:
            raise _fail(so, f"the schema is longer than {MAX_SPEC_CHARS} characters")
        try:
            spec = json.loads(spec)
        except ValueError as exc:
            raise _fail(so, f"the schema is not valid JSON ({exc}); send a JSON object") from None
    if not isinstance(spec, (dict, bool)):
        raise _fail(so, "the JSON schema must be an object (a dict or its JSON text)")
    try:
        return json.dumps(spec, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:  # a set, a NaN, a cycle: not JSON
        raise _fail(so, f"the schema is not JSON data ({exc})") from None


def grammar_text(kind: str, spec: str) -> str:
    """llguidance's grammar for (kind, canonical spec), its regexes read as ECMAScript reads them
    (engine/structured/ecma_regex.py); ValueError for a regex feature llguidance cannot compile."""
    import llguidance

    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(schema_patterns(spec), defaults=JSON_LAYOUT)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_LAYOUT)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(ecma_classes(spec))
    if kind == "choice":
        return llguidance.grammar_from("choice", spec)
    return llguidance.LLMatcher.grammar_from_lark(lark_regexes(spec))


def limits():
    import llguidance

    return llguidance.LLParserLimits(
        initial_lexer_fuel=INITIAL_LEXER_FUEL,
        max_grammar_size=MAX_GRAMMAR_SIZE,
        step_lexer_fuel=STEP_LEXER_FUEL,
        step_max_items=STEP_MAX_ITEMS,
        verbose_errors=False,
    )


class GrammarCompiler:
    """Compiles constraints for one tokenizer and keeps the last CACHE_SIZE prototypes (thread-safe)."""

    def __init__(self, tokenizer, vocab_size: int, cache_size: int = CACHE_SIZE):
        import llguidance

        self.tokenizer_spec = tokenizer_spec(tokenizer, vocab_size)
        self.ll_tokenizer = llguidance.LLTokenizer(
            self.tokenizer_spec[0], n_vocab=vocab_size, eos_token=self.tokenizer_spec[2]
        )
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._limits = limits()
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0  # cache misses, for tests and benchmarks

    @staticmethod
    def key(so: StructuredOutput) -> tuple[str, str]:
        """The cache key of `so`: (kind, canonical spec), from which grammar_text builds its grammar."""
        return so.kind, canonical(so)

    def prototype(self, so: StructuredOutput):
        """The compiled, untouched matcher of `so` (never advance it: deep_copy it)."""
        key = self.key(so)
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                return found
        matcher = self._compile(so, *key)
        with self._lock:
            self._cache[key] = matcher
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return matcher

    def _compile(self, so: StructuredOutput, kind: str, spec: str):
        import llguidance

        try:
            grammar = grammar_text(kind, spec)
        except ValueError as exc:
            raise _fail(so, f"cannot read the {kind}: {exc}") from None
        self.compiles += 1
        matcher = _in_compile_thread(
            lambda: llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=self._limits),
            lambda: _fail(so, f"the {kind} took longer than {COMPILE_TIMEOUT_S:g} s to compile; simplify it"),
        )
        if matcher.is_error():
            raise _fail(so, _explain(kind, matcher.get_error()))
        return matcher


def tokenizer_spec(tokenizer, vocab_size: int) -> tuple[str, int, list[int] | None]:
    """What builds llguidance's tokenizer, here and in the matcher process: (the fast tokenizer's
    JSON text without padding or truncation, the vocabulary size, every EOS id the engine stops at:
    where the grammar accepts, any of them ends the sequence), as llguidance.hf.from_tokenizer reads it."""
    backend = getattr(tokenizer.hf, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("structured output needs a fast (Rust) tokenizer; this one is slow")
    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str(), vocab_size, sorted(tokenizer.eos_token_ids) or None


_stack_lock = threading.Lock()


def _in_compile_thread(build, on_timeout):
    """Run `build()` on a fresh thread with a COMPILE_STACK_MB stack and wait COMPILE_TIMEOUT_S for it.

    llguidance recurses over nested grammar rules: a long chain of Lark rules overflows a thread's
    default stack and kills the process (SIGSEGV), so compiles never run on the caller's thread. A
    compile that overruns the timeout is abandoned (it finishes in the background; its result is
    dropped) and the request is refused."""
    box: list = []

    def work() -> None:
        try:
            box.append((True, build()))
        except BaseException as exc:  # handed to the caller's thread
            box.append((False, exc))

    with _stack_lock:  # stack_size is process-wide for threads started after it: restore it at once
        previous = threading.stack_size(COMPILE_STACK_MB << 20)
        try:
            thread = threading.Thread(target=work, name="grammar-compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join(COMPILE_TIMEOUT_S)
    if not box:
        raise on_timeout()
    ok, value = box[0]
    if not ok:
        raise value
    return value


def _explain(kind: str, error: str) -> str:
    """A compile error as a request error: what is wrong and how to fix it."""
    first = error.strip().splitlines()[0] if error.strip() else "unknown error"
    if "fuel" in error.lower() or "too large" in error.lower() or "limit" in error.lower():
        return f"the {kind} is too complex to compile within the engine's limits ({first}); simplify it"
    hints = {
        "json": "use only the JSON-schema features llguidance implements (see its json_schema docs)",
        "json_object": "",
        "regex": "fix the regular expression (ECMAScript classes, no look-around or back-references)",
        "choice": "",
        "grammar": "fix the Lark grammar (llguidance's Lark syntax, with a `start` rule)",
    }
    hint = hints.get(kind, "")
    return f"invalid {kind}: {first}" + (f"; {hint}" if hint else "")


_compilers_lock = threading.Lock()


def compiler_for(tokenizer, vocab_size: int) -> GrammarCompiler:
    """The tokenizer's compiler, made on first use (building llguidance's token trie grows with the
    vocabulary, too slow to repeat per request) and kept on the tokenizer object."""
    with _compilers_lock:
        compiler = getattr(tokenizer, "_grammar_compiler", None)
        if compiler is None or compiler.vocab_size != vocab_size:
            compiler = GrammarCompiler(tokenizer, vocab_size)
            tokenizer._grammar_compiler = compiler
        return compiler


def warm_up(tokenizer, vocab_size: int) -> threading.Thread:
    """Build the tokenizer's compiler on a background thread now, so that the first structured request
    does not stall the step loop (or the replica's event loop) for the token trie. Without llguidance
    installed this does nothing: structured requests then fail, unconstrained ones never notice."""

    def build() -> None:
        try:
            compiler_for(tokenizer, vocab_size)
        except ImportError:
            pass

    thread = threading.Thread(target=build, name="grammar-warm-up", daemon=True)
    thread.start()
    return thread


def check(so: StructuredOutput, tokenizer, vocab_size: int) -> None:
    """Raise InvalidRequestError unless `so` compiles for this tokenizer (the compile is cached)."""
    compiler_for(tokenizer, vocab_size).prototype(so)
