"""Host time of the engine replica's reader thread per token: LiveRequest.absorb for N open streams.

    python -m benchmarks.replica_host --streams 64,256 --baseline-tree /tmp/base \
        --out benchmarks/reports/replica_host_cpu

In the server, the engine replica's reader thread turns each step's token ids into text and outputs
(engine/core/live_request.py: incremental detokenization, stop strings, RequestOutput), holding the GIL
that the replica's event loop needs to take new requests in. This measures that work alone, the way
a decode step brings it: N requests with 500-token prompts each get one token per step, through
`LiveRequest.absorb`. Tokens are random ids of a 128,256-id vocabulary (what a random-weight model
samples) or, with --text, the ids of English text. The tokenizer is the byte-level BPE that
`scripts.make_model` writes for the Llama 3 shapes, made here once. Microseconds per token, median over
--steps steps after 20 warm-up steps, best of --reps runs; with --baseline-tree the same on that tree's
code, alternating, in subprocesses. JSON plus markdown.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from benchmarks.baseline_tree import make_trees
from benchmarks.host_ab import alternate, parser, run_source, table, write

VOCAB = 128_256
WARMUP = 20


def token_times(tokenizer_dir: str, streams: int, steps: int, text: bool) -> list[float]:
    """Seconds per token of LiveRequest.absorb, one step of `streams` requests at a time."""
    import random
    import time

    from engine.core.live_request import LiveRequest
    from engine.sampling_params import SamplingParams
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tokenizer_dir)
    rng = random.Random(0)
    words = tok.encode("The river keeper wrote in his log every evening, long after the last ship. " * 200)
    params = SamplingParams(max_tokens=10**6)
    live = [
        LiveRequest(str(i), [rng.randrange(tok.vocab_size) for _ in range(500)], params, 0.0, tok)
        for i in range(streams)
    ]
    times = []
    for step in range(WARMUP + steps):
        ids = [
            words[(step + i) % len(words)] if text else rng.randrange(tok.vocab_size) for i in range(streams)
        ]
        t0 = time.perf_counter()
        for request, token in zip(live, ids):
            request.absorb([(0, [token], [], None, None, None, False)], False, 0, None, 0.0, None)
        times.append((time.perf_counter() - t0) / streams)
    return times[WARMUP:]


def make_tokenizer(out_dir: Path) -> str:
    """The Llama 3 family's generated tokenizer at the 8B / 1B vocabulary size."""
    from scripts.make_model import TEMPLATE_DIR
    from scripts.make_tokenizer import write_tokenizer

    write_tokenizer("llama", VOCAB, out_dir, (TEMPLATE_DIR / "llama.jinja").read_text(), 8192)
    return str(out_dir)


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__, "streams", 100, 3, "benchmarks/reports/replica_host_cpu")
    ap.add_argument("--text", action="store_true", help="English text's ids instead of random ids")
    args = ap.parse_args(argv)
    trees = make_trees(args.baseline_tree)
    streams = [int(n) for n in args.streams.split(",")]
    tokens = "English text's ids" if args.text else f"random ids of {VOCAB:,}"
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_dir = make_tokenizer(Path(tmp))

        def measure(root: Path, n: int) -> float:
            return run_source(
                root, token_times, (tokenizer_dir, n, args.steps, args.text), f"WARMUP = {WARMUP}"
            )

        runs = alternate(trees, streams, args.reps, measure)
    facts = {"streams": streams, "reps": args.reps, "tokens": tokens, **runs}
    title = f"Engine replica: reader-thread host time per token (LiveRequest.absorb), microseconds; {tokens}"
    write(args.out, "replica_host", argv, trees, facts, lambda r: table(r, title, "open streams", streams, 2))


if __name__ == "__main__":
    main()
