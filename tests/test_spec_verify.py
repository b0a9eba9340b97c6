"""Speculative verification is lossless: greedy rows and single rows equal a naive per-row recompute,
and over many vectorised trials the emitted tokens follow the target distribution exactly.

The statistical tests use a chi-square goodness-of-fit test at false-alarm rate 1e-4 each (the p-value
comes from the regularised incomplete gamma function), cells with expected count < 5 pooled; acceptance
means must lie within 5 standard errors of the analytic value (false alarm about 6e-7). Seeds are fixed,
so every run draws the same numbers and the outcome is deterministic."""

from __future__ import annotations

import pytest
import torch

from engine.spec.verify import PAD, draw_uniforms, verify
from tests.stats import chi_square_p

pytestmark = pytest.mark.engine
V, K = 5, 2
ALPHA = 1e-4


def dirichlet(g: torch.Generator, *shape: int) -> torch.Tensor:
    w = -torch.log(torch.rand(*shape, V, generator=g, dtype=torch.float64))
    return w / w.sum(-1, keepdim=True)


def naive_row(p, x, n, q, greedy, u) -> list[int]:
    """The textbook rule for one row, position by position, with inverse-CDF draws from u[k]."""
    p, u = p.double(), u.double()
    for i in range(n):
        xi = int(x[i])
        if greedy:
            if xi != int(p[i].argmax()):
                return [int(x[j]) for j in range(i)] + [int(p[i].argmax())]
            continue
        qi = torch.zeros(p.shape[-1], dtype=torch.float64) if q is None else q[i].double()
        if q is None:
            qi[xi] = 1.0
        if not u[i] * qi[xi] < p[i, xi]:
            res = (p[i] - qi).clamp(min=0)
            return [int(x[j]) for j in range(i)] + [draw(res, u[-1])]
    last = int(p[n].argmax()) if greedy else draw(p[n], u[-1])
    return [int(x[j]) for j in range(n)] + [last]


def draw(w: torch.Tensor, u: torch.Tensor) -> int:
    cum = 0.0
    for tok, wt in enumerate((w / w.sum()).tolist()):
        cum += wt
        if u < cum:
            return tok
    return max(t for t in range(len(w)) if w[t] > 0)


@pytest.mark.parametrize("one_hot", [False, True])
def test_rows_equal_naive_recompute(one_hot):
    g = torch.Generator().manual_seed(1)
    rows, k, vocab = 64, 4, 7
    p = torch.softmax(3 * torch.randn(rows, k + 1, vocab, generator=g), -1)
    q = None if one_hot else torch.softmax(3 * torch.randn(rows, k, vocab, generator=g), -1)
    # proposals that often agree with the target's argmax, so greedy rows accept various prefixes
    agree = torch.rand(rows, k, generator=g) < 0.7
    x = torch.where(agree, p[:, :k].argmax(-1), torch.randint(0, vocab, (rows, k), generator=g))
    n = torch.randint(0, k + 1, (rows,), generator=g)
    x = torch.where(torch.arange(k)[None] < n[:, None], x, 12345)  # padding is ignored, even out of range
    greedy = torch.rand(rows, generator=g) < 0.5
    u = draw_uniforms(rows, k, g)
    out = verify(p, x, n, q, greedy, u)
    for r in range(rows):
        want = naive_row(p[r], x[r], int(n[r]), None if q is None else q[r], bool(greedy[r]), u[r])
        a = int(out.num_accepted[r])
        assert out.tokens[r, : a + 1].tolist() == want, r
        assert (out.tokens[r, a + 1 :] == PAD).all()
    assert out.num_accepted[greedy].sum() > 0 and out.num_accepted[~greedy].sum() > 0


def make_tables(g: torch.Generator):
    """Target P0, P1[x0], P2[x0, x1] and draft Q0, Q1[x0]; some zeros, as top-k or a peaked draft gives."""
    p0, p1, p2 = dirichlet(g), dirichlet(g, V), dirichlet(g, V, V)
    q0, q1 = dirichlet(g), dirichlet(g, V)
    p0[3] = 0
    p1[:, 4] = 0
    q0[0] = 0
    return [t / t.sum(-1, keepdim=True) for t in (p0, p1, p2, q0, q1)]


def run_trials(one_hot: bool, trials: int = 200_000):
    g = torch.Generator().manual_seed(7)
    p0, p1, p2, q0, q1 = make_tables(g)
    x0 = torch.multinomial(q0, trials, replacement=True, generator=g)
    x1 = torch.multinomial(q1[x0], 1, generator=g)[:, 0]
    n = torch.randint(0, K + 1, (trials,), generator=g)
    target = torch.stack([p0.expand(trials, V), p1[x0], p2[x0, x1]], 1).float()
    draft = None if one_hot else torch.stack([q0.expand(trials, V), q1[x0]], 1).float()
    greedy = torch.zeros(trials, dtype=torch.bool)
    out = verify(target, torch.stack([x0, x1], 1), n, draft, greedy, draw_uniforms(trials, K, g))
    return (p0, p1, p2, q0, q1), (x0, n), out, g


def complete(tables, out, g) -> torch.Tensor:
    """The three-token prefix: emitted tokens, then the target's own draws, as the next steps would."""
    p0, p1, p2 = tables[:3]
    t = out.tokens.clone()
    missing = t[:, 1] == PAD
    t[missing, 1] = torch.multinomial(p1[t[missing, 0]], 1, generator=g)[:, 0]
    missing = t[:, 2] == PAD
    t[missing, 2] = torch.multinomial(p2[t[missing, 0], t[missing, 1]], 1, generator=g)[:, 0]
    return t


@pytest.mark.parametrize("one_hot", [False, True])
def test_emitted_tokens_follow_the_target(one_hot):
    tables, _, out, g = run_trials(one_hot)
    p0, p1, p2 = tables[:3]
    trials = out.tokens.shape[0]
    first = torch.bincount(out.tokens[:, 0], minlength=V)
    assert first[p0 == 0].sum() == 0
    assert chi_square_p(first, trials * p0) > ALPHA
    t = complete(tables, out, g)
    joint = torch.bincount(t[:, 0] * V * V + t[:, 1] * V + t[:, 2], minlength=V**3).reshape(V, V, V)
    expected = trials * p0[:, None, None] * p1[:, :, None] * p2
    assert joint[expected == 0].sum() == 0
    assert chi_square_p(joint, expected) > ALPHA


@pytest.mark.parametrize("one_hot", [False, True])
def test_acceptance_matches_analytic_rate(one_hot):
    (p0, p1, _, q0, q1), (_, n), out, _ = run_trials(one_hot)
    # probability of accepting a proposed x: min(1, p/q) for a draft distribution, p(x) for one-hot
    acc0 = p0 if one_hot else torch.minimum(torch.ones(V, dtype=torch.float64), p0 / q0)
    acc1 = p1 if one_hot else torch.minimum(torch.ones(V, V, dtype=torch.float64), p1 / q1)
    acc0 = torch.nan_to_num(acc0)  # q0 = 0: never proposed, weight 0 below
    expect = {0: 0.0, 1: float((q0 * acc0).sum()), 2: float((q0 * acc0 * (1 + (q1 * acc1).sum(-1))).sum())}
    if not one_hot:
        assert expect[1] == pytest.approx(float(torch.minimum(p0, q0).sum()))
    for m in range(K + 1):
        got = out.num_accepted[n == m].double()
        tol = 5 * got.std() / got.numel() ** 0.5 + 1e-12
        assert abs(float(got.mean()) - expect[m]) <= tol, (m, float(got.mean()), expect[m])
