"""Lossless verification of one step's speculative proposals, vectorised over rows and positions.

Row r proposed num_draft[r] <= k tokens x_0.. (draft_tokens padded to k; padding is ignored). The
target scored k + 1 positions: target_probs[r, i] is the target's distribution for the token after
x_0..x_{i-1}, already processed (temperature, top-k / top-p, penalties: the caller applies them).

- Greedy rows accept the longest prefix with x_i == argmax p_i (ties broken as torch.argmax does),
  then emit argmax p_a at the first disagreement a (or a = num_draft[r] when all agree).
- Sampled rows accept x_i with probability min(1, p_i(x_i) / q_i(x_i)) (the test is u_i * q < p, which
  also holds for q = 0); at the first rejection a they draw from normalize(max(p_a - q_a, 0)), and when
  all num_draft[r] are accepted they draw the bonus from p_a with a = num_draft[r]. draft_probs None
  means one-hot q (n-gram proposals): accept with probability p_i(x_i), on rejection draw from p_i with
  x_i removed. The emitted tokens then follow the target's distribution exactly, whatever q is.

Randomness is the caller's: uniforms [rows, k + 1] in [0, 1), column i < k for the accept test of x_i,
column k for the one draw a row makes (inverse CDF), so a step is reproducible from its uniforms
(`draw_uniforms` makes them from a torch.Generator). Greedy rows ignore them.

Output padding: tokens [rows, k + 1] int64 holds the num_accepted[r] accepted proposals then the
corrected / bonus token, and PAD (-1) after that; num_accepted + 1 tokens are emitted per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAD = -1


@dataclass
class VerifyResult:
    num_accepted: torch.Tensor  # [rows] int64: proposals accepted (0..num_draft[r])
    tokens: torch.Tensor  # [rows, k + 1] int64: accepted proposals, then one more token, then PAD


def draw_uniforms(
    rows: int, k: int, generator: torch.Generator | None = None, device: str = "cpu"
) -> torch.Tensor:
    """[rows, k + 1] fp32 uniforms in [0, 1) for `verify`."""
    return torch.rand(rows, k + 1, generator=generator, device=device)


def _sample_inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One draw per row from weights [rows, V] >= 0 (unnormalised) with uniforms u [rows] in [0, 1)."""
    cum = weights.double().cumsum(-1)  # fp64: the running sum must not skip a small token by rounding
    total = cum[:, -1:].contiguous()
    picked = torch.searchsorted(cum, u.double()[:, None] * total, right=True)
    # u * total can round up to total; the first index reaching total is the last token with mass
    last_with_mass = torch.searchsorted(cum, total, right=False)
    return torch.minimum(picked, last_with_mass)[:, 0]


def _last_token(
    target_probs: torch.Tensor,
    x: torch.Tensor,
    num_accepted: torch.Tensor,
    num_draft: torch.Tensor,
    draft_probs: torch.Tensor | None,
    u: torch.Tensor,
) -> torch.Tensor:
    """The sampled token after the accepted prefix: from max(p_a - q_a, 0) where x_a was rejected, from
    p_a where every proposal was accepted (a = num_accepted)."""
    ridx = torch.arange(x.shape[0], device=x.device)
    p_a = target_probs[ridx, num_accepted].float()
    rejected = num_accepted < num_draft
    a_clamped = num_accepted.clamp(max=x.shape[1] - 1)  # a = k only when all accepted: q unused then
    if draft_probs is None:
        q_a = torch.zeros_like(p_a).scatter_(1, x[ridx, a_clamped][:, None], 1.0)
    else:
        q_a = draft_probs[ridx, a_clamped].float()
    residual = (p_a - q_a * rejected[:, None]).clamp(min=0)
    # a rejection with no residual mass can only come from rounding (p == q); then p itself is exact
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_a)
    return _sample_inverse_cdf(residual, u)


def verify(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_draft: torch.Tensor,
    draft_probs: torch.Tensor | None,
    greedy: torch.Tensor,
    uniforms: torch.Tensor,
) -> VerifyResult:
    """target_probs [rows, k + 1, V], draft_tokens [rows, k] int64, num_draft [rows] int64 in [0, k],
    draft_probs [rows, k, V] or None (one-hot), greedy [rows] bool, uniforms [rows, k + 1]."""
    rows, k = draft_tokens.shape
    device = draft_tokens.device
    valid = torch.arange(k, device=device)[None, :] < num_draft[:, None]
    x = torch.where(valid, draft_tokens, 0)  # padding may hold anything, even out-of-range ids
    p_x = target_probs[:, :k].gather(2, x[:, :, None])[:, :, 0]
    q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs.gather(2, x[:, :, None])[:, :, 0]
    argmax = target_probs.argmax(-1)  # [rows, k + 1]
    ok = torch.where(greedy[:, None], x == argmax[:, :k], uniforms[:, :k] * q_x < p_x) & valid
    num_accepted = ok.long().cumprod(1).sum(1)

    last = _last_token(target_probs, x, num_accepted, num_draft, draft_probs, uniforms[:, k])
    last = torch.where(greedy, argmax[torch.arange(rows, device=device), num_accepted], last)

    cols = torch.arange(k + 1, device=device)[None, :]
    tokens = torch.cat([x, x.new_zeros(rows, 1)], 1)
    tokens = torch.where(cols == num_accepted[:, None], last[:, None], tokens)
    tokens = torch.where(cols <= num_accepted[:, None], tokens, PAD)
    return VerifyResult(num_accepted=num_accepted, tokens=tokens)
