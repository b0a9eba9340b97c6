"""A deterministic byte-level BPE tokenizer of any vocabulary size, for generated checkpoints.

A small BPE is trained on the embedded corpus below; the ids that training does not fill become
unreachable filler tokens, so that len(tokenizer) equals the model's vocab_size exactly. The family's
special tokens (plus nanochat's tool tokens and <think>/</think>) are added tokens at fixed ids.
Layout of ids, per family:
  llama:  [BPE | filler | specials from vocab_size-256 on (as Llama 3) | filler]
  qwen3:  [BPE | filler | specials in the last ids]
  gemma3: [specials from id 0 (<pad>=0, <eos>=1, <bos>=2, as Gemma) | BPE | filler]
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

MAX_BPE_TOKENS = 1536  # cap on trained tokens (256 bytes + merges); the corpus yields about 620
TOOL_TOKENS = ["<|python_start|>", "<|python_end|>", "<|output_start|>", "<|output_end|>"]
THINK_TOKENS = ["<think>", "</think>"]  # not "special": they survive skip_special_tokens, as in Qwen3

CORPUS = """\
The lighthouse keeper wrote in his log every evening, long after the last ship had passed the point.
He noted the wind, the height of the waves, and the colour of the sky just before the lamp was lit.
Most nights there was little to say: a fishing boat coming home late, a gull asleep on the railing,
rain that started at nine and stopped at ten. Yet he never skipped a day, because a record is only
useful when it is complete, and because the habit of writing kept his mind steady through the winter.
In the spring a young engineer arrived to replace the old clockwork with an electric motor. She
measured the tower, counted the steps, and asked how many hours the lamp burned in a year. The keeper
answered without looking at his books: about four thousand three hundred hours, give or take a storm.
She laughed and wrote the number down, then checked it against his log and found that he was right.
A river starts as a thin line of water between stones, high in the hills where the snow melts slowly.
It gathers small streams as it descends, grows wider and louder, and cuts a valley over thousands of
years. Towns are built where it can be crossed, mills where it falls, and ports where it meets the sea.
People who live beside a river learn its moods. They know which months bring floods and which bring
the low water that shows old roots and forgotten coins. Children learn to swim in the calm bends, and
farmers learn to read the colour of the current, brown after rain and clear after a dry week.
Computers follow instructions one step at a time, but they take those steps very quickly. A program
is a list of such instructions, written so that a person can read it and a machine can run it. Good
programs are short where they can be and careful where they must be. They check their inputs, name
their parts clearly, and explain the reasons behind any choice that would surprise a reader. When a
program fails, the best error message says what went wrong, where it happened, and how to fix it.
A language model reads text as a sequence of tokens and learns to predict the next one. To serve such
a model, a server keeps a cache of keys and values for every token it has seen, so that each new token
costs only a little work. Many requests share the same machine, and a scheduler decides which of them
run together in each step. Short answers finish early and make room for new questions, while long
answers keep their place until they are done or until the memory runs out.
Bread is made from flour, water, salt and yeast. The dough is mixed, left to rise, folded, shaped and
baked in a hot oven. The crust turns brown and the kitchen fills with a warm smell. Every baker has a
favourite method, and every method works if it is followed with patience and a little attention.
The weather report for tomorrow: cloudy in the morning, with light rain moving in from the west after
noon. Temperatures between 12 and 17 degrees. Winds from the south-west at 15 to 20 km/h. On Sunday the
sky clears and the afternoon should be bright and dry, a good day for a walk along the coast.
Question: what is the sum of 17 and 25? Answer: the sum of 17 and 25 is 42.
Question: how many days are there in a leap year? Answer: there are 366 days in a leap year.
Question: which is larger, 0.5 or 0.25? Answer: 0.5 is larger than 0.25, because it is twice as much.
Question: what comes after Monday? Answer: Tuesday comes after Monday, and Wednesday comes after that.
"Are you coming with us?" she asked. "Not today," he said, "but I'll meet you there tomorrow."
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 20 25 50 64 100 128 256 512 1000 1024 2048 4096 65536 1000000
Dates and times: 2024-05-01, 12:30, 07:45:10, 1999/12/31, 3.14159, 2.71828, -40, +7, 1e-5, 50%.
Punctuation: . , ; : ! ? ' " ( ) [ ] { } < > / \\ | - _ + = * & ^ % $ # @ ~ ` ... -- ==
def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i * 2))
if x > 0 and y < 10: result = {"name": "value", "count": 3, "items": [1, 2, 3]}
"""


@dataclass(frozen=True)
class FamilyTokens:
    specials: list[str]  # in id order, starting at the family's base id
    bos: str
    eos: str  # the tokenizer's eos_token: the chat end-of-turn token, or the text end token
    eos_ids: list[str]  # every token that ends generation (config / generation_config eos_token_id)
    pad: str | None
    add_bos: bool  # encode(add_special_tokens=True) prepends bos
    tokenizer_bos: bool = True  # Qwen names bos_token_id in config.json but no bos_token in its tokenizer


FAMILY_TOKENS = {
    "llama": FamilyTokens(
        ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        eos_ids=["<|end_of_text|>", "<|eot_id|>"],
        pad=None,
        add_bos=True,
    ),
    "qwen3": FamilyTokens(
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        bos="<|endoftext|>",
        eos="<|im_end|>",
        eos_ids=["<|im_end|>", "<|endoftext|>"],
        pad="<|endoftext|>",
        add_bos=False,
        tokenizer_bos=False,
    ),
    "gemma3": FamilyTokens(
        ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"],
        bos="<bos>",
        eos="<eos>",
        eos_ids=["<eos>", "<end_of_turn>"],
        pad="<pad>",
        add_bos=True,
    ),
}


def all_specials(family: str) -> list[str]:
    return FAMILY_TOKENS[family].specials + TOOL_TOKENS + THINK_TOKENS


def _train_bpe(max_tokens: int) -> tuple[list[str], list[tuple[str, str]]]:
    """Train on CORPUS; returns the tokens in trained-id order and the merges in rank order."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=max_tokens,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return tokens, merges


def _special_base(family: str, vocab_size: int, n_bpe: int) -> int:
    n = len(all_specials(family))
    if family == "gemma3":
        return 0
    base = vocab_size - 256 if family == "llama" else vocab_size - n
    return max(base, n_bpe)  # tiny vocabularies: specials directly after the BPE tokens


def build_vocab(family: str, vocab_size: int) -> tuple[list[str], list[tuple[str, str]], int]:
    """The id -> token list (length vocab_size), BPE merges, and the id of the first special token."""
    specials = all_specials(family)
    bpe, merges = _train_bpe(min(MAX_BPE_TOKENS, vocab_size - len(specials)))
    base = _special_base(family, vocab_size, len(bpe))
    if base + len(specials) > vocab_size or (family == "gemma3" and len(specials) + len(bpe) > vocab_size):
        raise ValueError(
            f"vocab_size {vocab_size} is too small for {len(bpe)} BPE and {len(specials)} special tokens"
        )
    ids: list[str | None] = [None] * vocab_size
    ids[base : base + len(specials)] = specials
    start = len(specials) if family == "gemma3" else 0
    ids[start : start + len(bpe)] = bpe
    # Filler tokens: plain ASCII (each char is its own byte-level symbol), reached by no merge.
    return [t if t is not None else f"<filler_{i}>" for i, t in enumerate(ids)], merges, base


def build_tokenizer(family: str, vocab_size: int) -> Tokenizer:
    tokens, merges, base = build_vocab(family, vocab_size)
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    ft = FAMILY_TOKENS[family]
    # Added tokens keep the ids they already have in the vocabulary (added in id order).
    tok.add_special_tokens(ft.specials + TOOL_TOKENS)
    tok.add_tokens(THINK_TOKENS)
    if ft.add_bos:
        bos_id = vocab[ft.bos]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{ft.bos} $A", pair=f"{ft.bos} $A {ft.bos} $B", special_tokens=[(ft.bos, bos_id)]
        )
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    return tok


def tokenizer_config(family: str, chat_template: str, max_len: int) -> dict:
    ft = FAMILY_TOKENS[family]
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": ft.bos if ft.tokenizer_bos else None,
        "eos_token": ft.eos,
        "pad_token": ft.pad,
        "unk_token": "<unk>" if family == "gemma3" else None,
        "add_bos_token": ft.add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,  # keeps streamed deltas equal to one full decode
        "model_max_length": max_len,
        "chat_template": chat_template,
    }


def write_tokenizer(family: str, vocab_size: int, out_dir: Path, chat_template: str, max_len: int) -> dict:
    """Write tokenizer.json + tokenizer_config.json; return the ids config.json needs."""
    tok = build_tokenizer(family, vocab_size)
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = tokenizer_config(family, chat_template, max_len)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    ft = FAMILY_TOKENS[family]
    return {
        "bos_id": tok.token_to_id(ft.bos),
        "eos_ids": [tok.token_to_id(t) for t in ft.eos_ids],
        "pad_id": tok.token_to_id(ft.pad) if ft.pad else None,
    }
