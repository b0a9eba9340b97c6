"""Statistical helpers shared by the tests that compare sampled frequencies with a distribution."""

from __future__ import annotations

import torch


def chi_square_p(observed, expected) -> float:
    """p-value of Pearson's statistic over matching cells (lists or tensors of any shape); cells with
    expected count < 5 are pooled into one. The p-value is the regularised upper incomplete gamma."""
    obs = torch.as_tensor(observed, dtype=torch.float64).flatten()
    exp = torch.as_tensor(expected, dtype=torch.float64).flatten()
    small = exp < 5
    obs = torch.cat([obs[~small], obs[small].sum()[None]])
    exp = torch.cat([exp[~small], exp[small].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    df = torch.tensor(float(keep.sum() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))
