"""nanochat-compatible generation API on top of the same engine core.

    eng = Engine(LLMEngine(...))
    for token_column, token_masks in eng.generate(tokens, num_samples=4, max_tokens=64, seed=42): ...
    results, masks = eng.generate_batch(tokens, num_samples=4, max_tokens=64)

generate() yields one column per step: the next token of every sample row, with mask 1 for sampled
tokens and 0 for forced ones (calculator output). Rows that produce several forced tokens in one engine
step hand them out one column at a time, as nanochat does. The calculator is always on here.
A row that has finished repeats its terminal token with mask 0 until every row is done.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams, ToolConfig


class Engine:
    def __init__(self, engine: LLMEngine, tool: ToolConfig | None = None):
        self.engine = engine
        self.tool = tool or ToolConfig()
        tok = engine.tokenizer
        ends = [tok.token_id(t) for t in ("<|assistant_end|>", "<|eot_id|>", "<|im_end|>", "<end_of_turn>")]
        self.terminals = {t for t in ends if t is not None} | set(tok.eos_token_ids)
        if tok.bos_token_id is not None:
            self.terminals.add(tok.bos_token_id)

    def generate(
        self,
        tokens: list[int],
        num_samples: int = 1,
        max_tokens: int | None = None,
        temperature: float = 1.0,
        top_k: int | None = None,
        seed: int = 42,
    ) -> Iterator[tuple[list[int], list[int]]]:
        max_tokens = max_tokens or max(1, self.engine.max_model_len - len(tokens))
        params = SamplingParams(
            n=num_samples,
            max_tokens=max_tokens,
            temperature=temperature,
            top_k=top_k or 0,
            seed=seed,
            tool=self.tool,
            stop_token_ids=sorted(self.terminals),
        )
        rid = self.engine.add_request(list(tokens), params)
        queues = [deque() for _ in range(num_samples)]
        done = [False] * num_samples
        last = [self.engine.tokenizer.bos_token_id or 0] * num_samples
        try:
            while not all(done) or any(queues):
                while not all(queues[i] or done[i] for i in range(num_samples)):
                    self._step(rid, queues, done)
                if not any(queues):
                    return
                column, masks = [], []
                for i, q in enumerate(queues):
                    token, mask = q.popleft() if q else (last[i], 0)
                    last[i] = token
                    column.append(token)
                    masks.append(mask)
                yield column, masks
        finally:
            if rid in self.engine.state.requests:
                self.engine.abort(rid)

    def _step(self, rid: str, queues: list[deque], done: list[bool]) -> None:
        for out in self.engine.step():
            if out.request_id != rid:
                continue
            for d in out.outputs:
                queues[d.index].extend(zip(d.token_ids, d.token_masks))
                done[d.index] = done[d.index] or d.finish_reason is not None

    def generate_batch(
        self, tokens: list[int], num_samples: int = 1, **kwargs
    ) -> tuple[list[list[int]], list[list[int]]]:
        """Whole sequences (prompt + generated, terminal tokens excluded) and their masks."""
        results = [list(tokens) for _ in range(num_samples)]
        masks = [[0] * len(tokens) for _ in range(num_samples)]
        completed = [False] * num_samples
        for column, column_masks in self.generate(tokens, num_samples, **kwargs):
            for i, (token, mask) in enumerate(zip(column, column_masks)):
                if completed[i]:
                    continue
                if token in self.terminals:
                    completed[i] = True
                else:
                    results[i].append(token)
                    masks[i].append(mask)
            if all(completed):
                break
        return results, masks
