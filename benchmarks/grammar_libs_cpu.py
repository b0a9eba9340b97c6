"""llguidance against xgrammar on the CPU: grammar compile time and per-step bitmask fill at batch 64.

Each library runs in its own interpreter (xgrammar lives only in a throwaway venv), so the script has
three commands:

    python -m benchmarks.grammar_libs_cpu tokenizers DIR        # tiny's tokenizer, two 128k ones
    python -m benchmarks.grammar_libs_cpu run --lib llguidance --tokenizers DIR --out a.json
    /tmp/xg-venv/bin/python -m benchmarks.grammar_libs_cpu run --lib xgrammar --tokenizers DIR --out b.json

Tokenizers: `tiny` (models/tiny-llama, 2,048 ids), `llama128k-filler` (scripts/make_tokenizer at
128,256 ids: about 620 BPE tokens, the rest unreachable filler tokens, so it flatters any mask), and
`bpe128k` (a byte-level BPE trained here toward 128,000 tokens on the Python sources of the running
interpreter (standard library and site-packages), plus 256 specials as Llama 3: a realistic token
trie; its printed size is what the corpus gave). Compile: each schema in `COMPILE_SCHEMAS` with
caching off, until the first mask is filled (what a new request waits for), and the compile alone.
Fill: for each constraint of `FILL`, 64 matchers, each advanced by a random allowed non-EOS token per
step (seeded); the time of the batched fill alone per step, over `--steps` steps.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.structured_cases import SCHEMAS

WORKLOAD = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
            "n": {"type": "integer", "minimum": 0, "maximum": 100000},
        },
        "required": ["name", "tags", "n"],
        "additionalProperties": False,
    },
    "maxItems": 1000,
}
COMPILE_SCHEMAS = [SCHEMAS[0], SCHEMAS[1], SCHEMAS[6], SCHEMAS[12], SCHEMAS[14], WORKLOAD]
# fill workloads: the objects above, and the constraints of benchmarks/structured_bench.py (counted
# repetitions, maxLength and {4096}, are what makes a mask expensive; unbounded strings are cheap)
FILL = {
    "objects": WORKLOAD,
    "strings24": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 100000},
    "free-strings": {"type": "array", "items": {"type": "string"}, "minItems": 100000},
    "regex4096": "[a-z ]{4096}",
}
THREADS = 2  # both libraries get the machine's two cores


def make_tokenizers(out: Path) -> None:
    """Write the three tokenizer directories (tokenizer.json + tokenizer_config.json)."""
    import shutil
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from scripts.make_tokenizer import write_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    root = Path(__file__).resolve().parents[1]
    if (root / "models" / "tiny-llama").is_dir():  # `make model`; absent on a bare GPU host
        shutil.copytree(root / "models" / "tiny-llama", out / "tiny", dirs_exist_ok=True)
    (out / "llama128k-filler").mkdir(exist_ok=True)
    write_tokenizer("llama", 128256, out / "llama128k-filler", "", 8192)
    paths = sysconfig.get_paths()
    files = sorted(str(p) for key in ("stdlib", "purelib") for p in Path(paths[key]).rglob("*.py"))[:20000]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"] + [
        f"<|reserved_{i}|>" for i in range(253)
    ]
    trainer = trainers.BpeTrainer(
        vocab_size=128000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator((Path(f).read_text(errors="ignore") for f in files), trainer)
    tok.add_special_tokens(specials)
    (out / "bpe128k").mkdir(exist_ok=True)
    tok.save(str(out / "bpe128k" / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": specials[0],
        "eos_token": specials[1],
    }
    (out / "bpe128k" / "tokenizer_config.json").write_text(json.dumps(config))
    print(f"bpe128k: {tok.get_vocab_size()} ids from {len(files)} files")


class Lib:
    """One library behind four calls: compile, new matcher, batched fill, consume."""

    def __init__(self, name: str, hf, vocab: int):
        self.name, self.vocab = name, vocab
        if name == "llguidance":
            import llguidance
            import llguidance.hf

            self.ll = llguidance
            self.tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
            self.executor = llguidance.LLExecutor(THREADS)
            self.eos = set(self.tok.eos_tokens)
        else:
            import xgrammar

            self.xg = xgrammar
            self.tok = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
            self.compiler = xgrammar.GrammarCompiler(self.tok, max_threads=THREADS, cache_enabled=False)
            self.batch = xgrammar.BatchGrammarMatcher(THREADS)
            self.eos = set(self.tok.stop_token_ids)

    def compile(self, schema: dict | str):
        """A JSON schema, or a regex given as a string."""
        if self.name == "llguidance":
            layout = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
            if isinstance(schema, str):
                grammar = self.ll.LLMatcher.grammar_from_regex(schema)
            else:
                grammar = self.ll.LLMatcher.grammar_from_json_schema(schema, defaults=layout)
            matcher = self.ll.LLMatcher(self.tok, grammar, log_level=0)
            assert not matcher.is_error(), matcher.get_error()
            return matcher
        if isinstance(schema, str):
            return self.compiler.compile_regex(schema)
        return self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(", ", ": ")
        )

    def matcher(self, compiled):
        return compiled.deep_copy() if self.name == "llguidance" else self.xg.GrammarMatcher(compiled)

    def fill(self, matchers: list, bitmask: np.ndarray) -> None:
        if self.name == "llguidance":
            pairs = [(m, i) for i, m in enumerate(matchers)]
            self.executor.unsafe_compute_mask_ptr(
                pairs, bitmask.ctypes.data, bitmask.shape[1] * 4, bitmask.shape[0]
            )
        else:
            import torch

            self.batch.batch_fill_next_token_bitmask(matchers, torch.from_numpy(bitmask))

    def consume(self, matcher, token: int) -> None:
        ok = matcher.consume_token(token) if self.name == "llguidance" else matcher.accept_token(token)
        assert ok, f"{self.name} refused an allowed token {token}"

    def done(self, matcher) -> bool:
        return matcher.is_stopped() if self.name == "llguidance" else matcher.is_terminated()


def allowed(row: np.ndarray, vocab: int) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab])


def fill_times(lib: Lib, spec, vocab: int, steps: int, batch: int) -> dict:
    """Per-step batched fill of `batch` matchers advanced by random allowed non-EOS tokens (seeded)."""
    compiled = lib.compile(spec)
    matchers = [lib.matcher(compiled) for _ in range(batch)]
    bitmask = np.zeros((batch, (vocab + 31) // 32), dtype=np.int32)
    rng, fills = random.Random(0), []
    for _ in range(steps):
        t0 = time.perf_counter()
        lib.fill(matchers, bitmask)
        fills.append((time.perf_counter() - t0) * 1e3)
        for i, m in enumerate(matchers):
            ids = [t for t in allowed(bitmask[i], vocab).tolist() if t not in lib.eos]
            if lib.done(m) or not ids:
                matchers[i] = lib.matcher(compiled)
                continue
            lib.consume(m, rng.choice(ids))
    return {"median": statistics.median(fills), "mean": statistics.mean(fills), "max": max(fills)}


def bench_tokenizer(lib_name: str, directory: Path, steps: int, batch: int) -> dict:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    t0 = time.perf_counter()
    lib = Lib(lib_name, hf, len(hf))
    result = {"vocab": len(hf), "tokenizer_setup_ms": (time.perf_counter() - t0) * 1e3, "compile": []}
    words = (len(hf) + 31) // 32
    one = np.zeros((1, words), dtype=np.int32)
    for schema in COMPILE_SCHEMAS:
        t0 = time.perf_counter()
        compiled = lib.compile(schema)
        t1 = time.perf_counter()
        lib.fill([lib.matcher(compiled)], one)
        t2 = time.perf_counter()
        result["compile"].append({"compile_ms": (t1 - t0) * 1e3, "to_first_mask_ms": (t2 - t0) * 1e3})
    result["fill_ms"] = {name: fill_times(lib, spec, len(hf), steps, batch) for name, spec in FILL.items()}
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("tokenizers")
    mk.add_argument("out", type=Path)
    run = sub.add_parser("run")
    run.add_argument("--lib", choices=["llguidance", "xgrammar"], required=True)
    run.add_argument("--tokenizers", type=Path, required=True)
    run.add_argument("--names", default="tiny,llama128k-filler,bpe128k")
    run.add_argument("--steps", type=int, default=40)
    run.add_argument("--batch", type=int, default=64)
    run.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.cmd == "tokenizers":
        return make_tokenizers(args.out)
    from importlib.metadata import version

    report = {
        "lib": args.lib,
        "version": version(args.lib),
        "python": sys.version.split()[0],
        "threads": THREADS,
    }
    for name in args.names.split(","):
        report[name] = bench_tokenizer(args.lib, args.tokenizers / name, args.steps, args.batch)
        print(name, json.dumps(report[name]), flush=True)
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
