"""A naive reference generator: recompute the whole sequence for every token, no KV cache at all."""

from __future__ import annotations

import torch

from engine.attention_context import AttentionMetadata, attention_context
from engine.loader import load_model


class NaiveGenerator:
    def __init__(self, model_dir, dtype=torch.float64):
        self.model, self.config = load_model(str(model_dir), dtype=dtype, device="cpu")
        self._memo: dict[tuple[int, ...], int] = {}

    @torch.inference_mode()
    def next_logits(self, ids: list[int]) -> torch.Tensor:
        meta = AttentionMetadata.for_full_sequences([len(ids)])
        with attention_context(meta):
            hidden = self.model(torch.tensor(ids), torch.arange(len(ids)))
        return self.model.compute_logits(hidden[-1:])[0]

    def greedy(self, prompt: list[int], max_tokens: int, stop_ids: set[int] = frozenset()) -> list[int]:
        ids, out = list(prompt), []
        for _ in range(max_tokens):
            key = tuple(ids)
            if key not in self._memo:
                self._memo[key] = int(self.next_logits(ids).argmax())
            token = self._memo[key]
            out.append(token)
            ids.append(token)
            if token in stop_ids:
                break
        return out
