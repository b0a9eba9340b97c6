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

--take-every K1,K2,..: deferred text instead (the replica's mode, engine/core_client.py): each step's
record is stashed (`LiveRequest.stash`, the reader thread's work) and each request takes its text every
K steps (`LiveRequest.take`, on the event loop when its stream sends), request i at the steps where
(step + i) % K == 0; the time per token counts both. K = 1 is a take every step. A stream sends an item
every open streams / stream_items_per_s seconds, so at 256 streams, 2,000 items a second and 90 steps a
second K is about 12; at 64 streams about 3. Runs on this tree only.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from benchmarks.baseline_tree import make_trees
from benchmarks.host_ab import alternate, parser, run_source, table, write

VOCAB = 128_256
WARMUP = 20


def token_times(tokenizer_dir: str, streams: int, steps: int, text: bool, every: int = 0) -> list[float]:
    """Seconds per token, one step of `streams` requests at a time: LiveRequest.absorb every step, or
    (every = K > 0, deferred text) stash every step plus take every K steps."""
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
        for i, (request, token) in enumerate(zip(live, ids)):
            sample = [(0, [token], [], None, None, None, False)]
            if not every:
                request.absorb(sample, False, 0, None, 0.0, None)
                continue
            request.stash(sample, False, 0, None, 1.0)
            if (step + i) % every == 0:
                request.take(None)
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
    ap.add_argument("--take-every", default="", help="deferred text: K1,K2,.. steps between takes")
    args = ap.parse_args(argv)
    if args.take_every:
        return deferred_main(args, argv)
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


def deferred_main(args, argv: list[str] | None) -> None:
    """--take-every: per-step absorb (K "absorb") against deferred text at each K, this tree only."""
    streams = [int(n) for n in args.streams.split(",")]
    every = [int(k) for k in args.take_every.split(",")]
    root = Path(__file__).resolve().parents[1]
    runs: dict[str, dict[str, list[float]]] = {
        k: {str(n): [] for n in streams} for k in ["absorb", *map(str, every)]
    }
    with tempfile.TemporaryDirectory() as tmp:
        tok = make_tokenizer(Path(tmp))
        for _ in range(args.reps):
            for n in streams:
                for k in [0, *every]:
                    call = (tok, n, args.steps, args.text, k)
                    runs[str(k or "absorb")][str(n)].append(
                        run_source(root, token_times, call, f"WARMUP = {WARMUP}")
                    )
    best = {k: {n: min(v) for n, v in by.items()} for k, by in runs.items()}
    facts = {"streams": streams, "reps": args.reps, "take_every": every, "runs": runs, "us": best}
    trees = make_trees(None)
    write(
        args.out,
        "replica_host",
        argv,
        trees,
        facts,
        lambda r: deferred_table(r, streams, ["absorb", *map(str, every)]),
    )


def deferred_table(report: dict, streams: list[int], modes: list[str]) -> str:
    """Microseconds per token by open streams (rows) and mode (columns): absorb, or take every K."""
    env = report["env"]
    head = ["absorb every step", *(f"take every {k}" for k in modes[1:])]
    lines = [
        "# Engine replica: text work per token, per-step absorb against deferred text",
        "",
        f"`{report['command']}`; Python {env['versions']['python']}, {env['hardware']['cpu']}; "
        f"best of {report['reps']} runs, median of each; microseconds per token",
        "",
        "| open streams | " + " | ".join(head) + " |",
        "|---|" + "---|" * len(modes),
    ]
    for n in streams:
        lines.append(f"| {n} | " + " | ".join(f"{report['us'][m][str(n)]:.2f}" for m in modes) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
