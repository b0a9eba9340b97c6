"""The k passes of the gated-LoRA MTP sampler head over a draft vocabulary, with fc1 taken apart.

The head (engine/spec/mtp_head.py) computes, per pass i, u = fc1(cat([h_i, embed(p)])) with h_i the
hidden state of mask m_i and p the token before the draft: the bonus token in pass 1, the previous
draft after that. fc1 is linear, so u = W_h h_i + W_e embed(p) with W_h and W_e fc1's two column
halves. Both terms are known sooner than the pass that needs them:
  * W_h h_i for all k masks is one product over k rows, before the first pass;
  * the draft of pass i - 1 is a token of the draft vocabulary, so W_e embed(p) for passes 2..k is a
    row of a table [N, H] computed once at load time (`table`, in the model dtype: N x H elements).
Pass 1 still multiplies W_e by the bonus token's embedding (the bonus may lie outside the draft
vocabulary). A pass then reads fc2 and the draft vocabulary's rows, not fc1: per step, k - 1 reads of
fc1 fewer and two launches fewer per pass. The sum of two rounded halves differs from the one product
in the last bits, so a draft may differ from the plain passes' on a near tie; drafts are proposals,
verification keeps the output exact.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.spec.mtp_head import FP8Weight, head_linear
from kernels import ops

TABLE_CHUNK = 4096  # draft tokens per product while building the table (bounds the temporary embeddings)


class _Half:
    """One column half of fc1, float or float8 (the head's quantize_fp8 row scales hold for both)."""

    def __init__(self, weight: torch.Tensor, fp8: FP8Weight | None, cols: slice):
        self.weight = weight[:, cols].contiguous() if fp8 is None else None
        self.fp8 = None if fp8 is None else (fp8[0][:, cols].contiguous(), fp8[1])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return head_linear(x, self.weight, self.fp8)


class DraftChain:
    """The k passes for a head with a bound draft vocabulary (MtpHead.bind_logits_weight; quantize_fp8
    first if wanted). `embed` is the target model's (any family scale applies)."""

    def __init__(self, head, embed: Callable[[torch.Tensor], torch.Tensor]):
        if head.draft_weight is None:
            raise ValueError("DraftChain: the head has no bound draft vocabulary")
        self.head, self.embed = head, embed
        weight = head.sampler.fc1.weight
        hidden = weight.shape[0]
        fp8 = head.fp8.get("fc1")
        self.w_h = _Half(weight, fp8, slice(0, hidden))
        self.w_e = _Half(weight, fp8, slice(hidden, 2 * hidden))
        self.table = self._table(head.draft_token_ids, weight.dtype)

    @torch.no_grad()
    def _table(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """W_e embed(t) [N, H] for every token t of the draft vocabulary, in its order."""
        chunks = ids.split(TABLE_CHUNK)
        return torch.cat([self.w_e(self.embed(chunk).to(dtype)) for chunk in chunks])

    def run(self, masks: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
        """The drafts [R, k] (token ids) from the mask rows' hidden states masks [R, k, H] (final norm
        applied) and the bonus tokens [R]."""
        head = self.head
        rows, k, hidden = masks.shape
        base = self.w_h(masks.reshape(rows * k, hidden)).view(rows, k, hidden)
        act = ops.add_silu(base[:, 0], self.w_e(self.embed(bonus).to(masks.dtype)))
        picks = []
        for i in range(k):
            if i:
                act = ops.add_silu(base[:, i], self.table, picks[-1])
            down = head._linear(act, "fc2", head.sampler.fc2.weight)
            state = ops.add_rms_norm(down, masks[:, i], head.sampler.norm.weight, head.eps)[0]
            picks.append(ops.argmax(head._linear(state, "draft", head.draft_weight)))
        return head.draft_token_ids[torch.stack(picks, dim=1)]
