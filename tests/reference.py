"""A naive reference generator: recompute the whole sequence for every token, no KV cache at all."""

from __future__ import annotations

import contextlib
from unittest import mock

import torch

from engine.models.attention_context import AttentionMetadata, attention_context
from engine.models.loader import load_model
from kernels import torch_ops


class NaiveGenerator:
    """kv_dtype: round every key and value as a KV cache of that dtype stores them (e.g. fp8) before
    attention reads them, which is what an engine with such a cache computes; None keeps them exact."""

    def __init__(self, model_dir, dtype=torch.float64, kv_dtype: torch.dtype | None = None):
        self.model, self.config = load_model(str(model_dir), dtype=dtype, device="cpu")
        self.kv_dtype = kv_dtype
        self._memo: dict[tuple[int, ...], int] = {}

    def _rounded_kv(self):
        """Patch the cache-free attention twin so it reads k and v through the cache dtype."""
        if self.kv_dtype is None:
            return contextlib.nullcontext()
        exact = torch_ops.attention

        def attention(q, k, v, *args, **kwargs):
            k, v = (torch_ops.to_cache_dtype(t, self.kv_dtype).to(t.dtype) for t in (k, v))
            return exact(q, k, v, *args, **kwargs)

        return mock.patch.object(torch_ops, "attention", attention)

    @torch.inference_mode()
    def next_logits(self, ids: list[int]) -> torch.Tensor:
        meta = AttentionMetadata.for_full_sequences([len(ids)])
        with attention_context(meta), self._rounded_kv():
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
