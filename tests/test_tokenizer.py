"""engine.tokenizer and engine.output.detokenizer on generated checkpoints: round trips, special ids, errors,
and streamed deltas that always add up to one full decode."""

from __future__ import annotations

import json
import random

import pytest

from engine.output.detokenizer import MAX_PENDING, IncrementalDetokenizer
from engine.tokenizer import Tokenizer
from scripts.make_model import make_model

TEXTS = [
    "The lighthouse keeper wrote in his log every evening.",
    "Emoji: 🦀🚀👩‍💻 and flags 🇫🇷, then CJK: 日本語のテキスト, 中文字符, 한국어.",
    "Mixed: café naïve résumé — “quotes” ½ ∑ x² ≤ 10 µs … done.\n\ttabs and  double  spaces",
    "def f(x):\n    return {'a': [1, 2, 3]}  # code",
]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    return {name: make_model(name, root / name) for name in ["tiny", "tiny-qwen3", "tiny-gemma3"]}


@pytest.fixture(scope="module")
def llama(dirs):
    return Tokenizer.from_dir(dirs["tiny"])


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen3", "tiny-gemma3"])
def test_round_trip_and_special_tokens(dirs, name):
    tok = Tokenizer.from_dir(dirs[name])
    config = json.loads((dirs[name] / "config.json").read_text())
    assert tok.vocab_size == len(tok) == config["vocab_size"]
    for text in TEXTS:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    eos = config["eos_token_id"]
    assert tok.eos_token_ids == set(eos if isinstance(eos, list) else [eos])
    think = tok.token_id("<think>")
    assert think is not None and tok.convert_ids_to_tokens([think]) == ["<think>"]
    assert tok.token_id("no-such-token-anywhere") is None
    with_specials = tok.encode("hi", add_special_tokens=True)
    plain = tok.encode("hi", add_special_tokens=False)
    if name == "tiny-qwen3":  # Qwen adds no bos
        assert tok.bos_token_id is None and with_specials == plain
    else:
        assert with_specials == [tok.bos_token_id, *plain]


def test_skip_special_tokens(llama):
    ids = llama.encode_chat([{"role": "user", "content": "Hi"}])
    assert llama.decode(ids).startswith("<|begin_of_text|><|start_header_id|>user")
    assert llama.decode(ids, skip_special_tokens=True) == "user\n\nHiassistant\n\n"


def test_encode_chat_has_exactly_one_bos(llama):
    ids = llama.encode_chat([{"role": "user", "content": "Hello"}])
    assert ids[0] == llama.bos_token_id and ids.count(llama.bos_token_id) == 1
    assert llama.decode(ids) == llama.render_chat([{"role": "user", "content": "Hello"}])


def test_eos_ids_include_generation_config(dirs, tmp_path):
    import shutil

    copy = shutil.copytree(dirs["tiny"], tmp_path / "copy")
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 8]}))
    assert {7, 8} <= Tokenizer.from_dir(copy).eos_token_ids


def test_errors_name_directory_and_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenizer.from_dir(tmp_path / "missing")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}.*tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas


@pytest.mark.parametrize("skip", [False, True])
def test_random_streams_add_up_to_full_decode(llama, skip):
    rng = random.Random(1234)
    byte_tokens = list(range(256))  # the BPE alphabet: single bytes, where characters split
    for _ in range(30):
        ids = [
            rng.choice(byte_tokens) if rng.random() < 0.5 else rng.randrange(llama.vocab_size)
            for _ in range(60)
        ]
        deltas = _stream(IncrementalDetokenizer(llama, skip_special_tokens=skip), ids)
        assert "".join(deltas) == llama.decode(ids, skip_special_tokens=skip)


def test_encoded_unicode_never_emits_replacement_char(llama):
    for text in TEXTS:
        ids = llama.encode(text, add_special_tokens=False)
        assert len(ids) > len(text.encode()) // 4  # byte-level pieces: characters do split across tokens
        deltas = _stream(IncrementalDetokenizer(llama), ids)
        assert "".join(deltas) == text
        assert not any("\ufffd" in d for d in deltas)


def test_split_character_is_held_back_until_complete(llama):
    ids = llama.encode("🦀", add_special_tokens=False)
    assert len(ids) == 4  # four UTF-8 bytes, no merge covers them
    detok = IncrementalDetokenizer(llama)
    assert [detok.push(i) for i in ids] == ["", "", "", "🦀"]


def test_prompt_context_is_not_emitted(llama):
    prompt = llama.encode("Question: what comes after Monday? Answer:", add_special_tokens=True)
    gen = llama.encode(" Tuesday 🦀 comes", add_special_tokens=False)
    deltas = _stream(IncrementalDetokenizer(llama, prompt_ids=prompt), gen)
    assert "".join(deltas) == " Tuesday 🦀 comes"


class _StripLeadingSpace:
    """Sentencepiece-like decoder: a decode drops the leading space of its first piece."""

    pieces = [" the", " river", " meets", " sea", ".", " a"]

    def __init__(self):
        self.longest = 0

    def decode(self, ids, skip_special_tokens=False):
        self.longest = max(self.longest, len(ids))
        text = "".join(self.pieces[i] for i in ids)
        return text[1:] if text.startswith(" ") else text


def test_leading_space_survives_window_restarts():
    fake = _StripLeadingSpace()
    prompt, gen = [0, 1], [2, 0, 3, 4] * 10
    expected = fake.decode(prompt + gen)[len(fake.decode(prompt)) :]
    fake.longest = 0
    deltas = _stream(IncrementalDetokenizer(fake, prompt_ids=prompt), gen)
    assert "".join(deltas) == expected
    assert fake.longest <= 8  # decodes stay within a small window, whatever the stream length


def test_invalid_bytes_do_not_grow_the_window(llama):
    calls = []

    class Spy:
        def decode(self, ids, skip_special_tokens=False):
            calls.append(len(ids))
            return llama.decode(ids, skip_special_tokens)

    lone_continuation = llama.encode("é", add_special_tokens=False)[-1]  # a byte that starts no character
    detok = IncrementalDetokenizer(Spy())
    for _ in range(200):
        detok.push(lone_continuation)
    assert max(calls) <= 2 * (MAX_PENDING + 1)
    assert detok.text + detok.flush() == llama.decode([lone_continuation] * 200)


class _PythonPath:
    """The tokenizer without its Rust stream (no `rust`): IncrementalDetokenizer's two-decode path."""

    def __init__(self, tokenizer: Tokenizer):
        self.decode = tokenizer.decode


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen3", "tiny-gemma3"])
@pytest.mark.parametrize("skip", [False, True])
def test_rust_stream_gives_the_python_paths_deltas(dirs, name, skip):
    """tokenizers' DecodeStream (the fast path) against the two-decode path, push by push, on random
    streams heavy in single bytes and special tokens, after a prompt, with flushes mid-stream; both add
    up to one decode of the ids."""
    tok = Tokenizer.from_dir(dirs[name])
    assert tok.rust is not None
    rng = random.Random(f"{name}-{skip}")
    specials = sorted(tok.all_special_ids)
    streamed = pushes = 0
    for _ in range(20):
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(0, 9))]
        fast = IncrementalDetokenizer(tok, prompt_ids=prompt, skip_special_tokens=skip)
        slow = IncrementalDetokenizer(_PythonPath(tok), prompt_ids=prompt, skip_special_tokens=skip)
        assert fast._rust is not None and slow._rust is None
        ids = []
        for _ in range(80):
            r = rng.random()
            token = (
                rng.randrange(256)
                if r < 0.5
                else rng.choice(specials)
                if r < 0.6
                else rng.randrange(tok.vocab_size)
            )
            ids.append(token)
            streamed += fast._stream is not None
            pushes += 1
            assert fast.push(token) == slow.push(token)
            if rng.random() < 0.03:
                assert fast.flush() == slow.flush()
        assert fast.flush() == slow.flush()
        assert fast.text == slow.text
    assert streamed > pushes // 2  # most pushes took the Rust stream (the rest: after partial characters)


def test_rust_stream_cuts_runs_of_invalid_bytes(llama):
    """A run of bytes that never completes a character is emitted every MAX_PENDING + 1 tokens on the
    fast path too (its stream then restarts), and the text still equals one decode."""
    lone_continuation = llama.encode("é", add_special_tokens=False)[-1]
    detok = IncrementalDetokenizer(llama)
    deltas = [detok.push(lone_continuation) for _ in range(200)]
    assert [i for i, d in enumerate(deltas) if d] == list(range(MAX_PENDING, 200, MAX_PENDING + 1))
    assert detok.text + detok.flush() == llama.decode([lone_continuation] * 200)


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen3", "tiny-gemma3"])
def test_push_many_mixed_with_push_gives_the_text(dirs, name):
    """Deferred text pushes runs of ids at once, between single pushes: on encoded text whose characters
    split across tokens and across runs, the deltas add up to the text, with no replacement character,
    after a prompt and across flushes, as the per-token path's do."""
    tok = Tokenizer.from_dir(dirs[name])
    rng = random.Random(name)
    for text in TEXTS * 4:
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(0, 9))]
        ids = tok.encode(text, add_special_tokens=False)
        detok, deltas, i = IncrementalDetokenizer(tok, prompt_ids=prompt), [], 0
        while i < len(ids):
            run = ids[i : i + rng.randint(1, 14)]
            i += len(run)
            deltas.append(detok.push_many(run) if len(run) > 1 else detok.push(run[0]))
        deltas.append(detok.flush())
        assert "".join(deltas) == text == detok.text
        assert not any("\ufffd" in d for d in deltas)
