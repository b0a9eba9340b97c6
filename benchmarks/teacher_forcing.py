"""Teacher forcing through decode steps: the greedy token at each position of fixed sequences, computed by
the kernels a decode step of the given batch size runs.

`prompt_logprobs` scores every position in one prefill, whose kernels treat each row alike whatever the
batch. A decode step does not: one row takes the GEMV, 64 rows a cuBLAS GEMM, each with its own order of
summation. Here each sequence starts from its first `start` tokens and decodes greedily; after every
step its greedy token is recorded and the sequence's own next token is appended in its place, so every
batch size sees the same inputs. Benchmark-side only: it wraps the engine's TokenSink.receive and turns
off scheduling ahead (whose next input comes from the device, not from the host) for the call.
"""

from __future__ import annotations

from collections.abc import Sequence


def decode_top1(llm, sequences: Sequence[list[int]], start: int, batch: int) -> list[list[int]]:
    """Per sequence, the greedy token after each of its positions start..len-2, from decode steps of
    `batch` sequences at a time (the greedy token after the prompt, from the prefill, is left out)."""
    from engine import SamplingParams

    follow = {tuple(s[:start]): s[start:] for s in sequences}  # a request is known by its prompt
    if len(follow) != len(sequences) or min(map(len, sequences)) < start + 2:
        raise ValueError(f"sequences must differ in their first {start} tokens and be over {start + 1} long")
    eng = llm.engine
    seen: dict[tuple[int, ...], list[int]] = {key: [] for key in follow}
    receive, ahead = eng.sink.receive, eng._schedule_ahead

    def forced(out, pending):
        got = receive(out, pending)
        if got is None:
            return got
        ids = list(got.result.token_ids)
        for i, seq in enumerate(got.samplers):
            key = tuple(seq.request.prompt_ids)
            seen[key].append(ids[i])
            ids[i] = follow[key][len(seen[key]) - 1]
        got.result.token_ids = ids
        return got

    eng.sink.receive, eng._schedule_ahead = forced, lambda prev: None
    try:
        for i in range(0, len(sequences), batch):
            group = [s[:start] for s in sequences[i : i + batch]]
            params = [SamplingParams(max_tokens=len(s) - start, temperature=0.0, ignore_eos=True)
                      for s in sequences[i : i + batch]]  # fmt: skip
            llm.generate(group, params, use_tqdm=False)
    finally:
        eng.sink.receive, eng._schedule_ahead = receive, ahead
    return [seen[tuple(s[:start])][1:] for s in sequences]
