"""The overwrite probe's statistics (Fig. 2 / Table 6) against torch.quantile and a hand-written sorted-value
quantile, pooled over layers and per layer."""
from __future__ import annotations

import math

import pytest
import torch

from eval.overwrite import OVERWRITE, QUANTILES, summarize


def _sorted_quantile(x: torch.Tensor, q: float) -> float:
    """The linearly interpolated ``q`` quantile of ``x`` (position ``q (n - 1)`` in the sorted values)."""
    s = x.flatten().double().sort().values
    pos = q * (s.numel() - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, s.numel() - 1)
    return float(s[lo] + (pos - lo) * (s[hi] - s[lo]))


def _betas() -> dict[int, torch.Tensor]:
    """Two layers of ``[n, T, H]`` write strengths in ``[0, 1)`` with different shapes and distributions, a share of
    them at or above the overwrite threshold."""
    gen = torch.Generator().manual_seed(0)
    a = torch.rand(3, 37, 2, generator=gen) ** 2
    b = 0.5 + 0.499 * torch.rand(3, 37, 4, generator=gen)
    return {0: a.float(), 3: b.float()}


def test_quantiles_means_and_overwrite_share_pooled_and_per_layer() -> None:
    betas = _betas()
    summary = summarize(betas)
    pooled = torch.cat([b.flatten() for b in betas.values()]).double()
    groups = {"pooled": pooled, **{str(i): b.double() for i, b in betas.items()}}
    assert sorted(summary["layers"]) == ["0", "3"]
    for name, x in groups.items():
        stats = summary["pooled"] if name == "pooled" else summary["layers"][name]
        ref = torch.quantile(x.flatten(), torch.tensor(QUANTILES, dtype=torch.float64))
        for q, want in zip(QUANTILES, ref.tolist()):
            got = stats[f"q{int(q * 100)}"]
            assert got == pytest.approx(want, abs=1e-12, rel=0), (name, q)
            assert got == pytest.approx(_sorted_quantile(x, q), abs=1e-12, rel=0), (name, q)
        assert stats["mean"] == pytest.approx(float(x.mean()), abs=1e-12, rel=0)
        share = float((x >= OVERWRITE).sum()) / x.numel()
        assert stats["overwrite_share"] == pytest.approx(share, abs=1e-12, rel=0)
        assert 0 < share < 1, "the threshold splits the sample: the share is informative"
    for i, b in betas.items():
        assert summary["layers"][str(i)]["head_means"] == pytest.approx(b.double().mean((0, 1)).tolist(), abs=1e-12)
    # the pooled quantiles mix the layers: they differ from either layer's alone
    assert summary["pooled"]["q50"] != pytest.approx(summary["layers"]["0"]["q50"], abs=1e-3)
    assert summary["pooled"]["q50"] != pytest.approx(summary["layers"]["3"]["q50"], abs=1e-3)
