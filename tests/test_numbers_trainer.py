"""The non-finite guard before a checkpoint covers the optimiser state, not only the weights: a NaN or Inf in an
AdamW moment (which the next update would write into the weights) is flagged, and the diagnosis names the state."""
from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator

from train import diagnose_weights, non_finite_flag, weights_finite


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small model after two AdamW steps on random data: finite weights and moments."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    for _ in range(2):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("key", ["exp_avg", "exp_avg_sq"])
def test_a_non_finite_optimiser_moment_is_flagged_before_a_save(key: str, bad: float) -> None:
    model, opt = _trained()
    assert float(non_finite_flag(model, opt)) == 0.0
    state = opt.state[model[2].weight]
    state[key][1, 2] = bad
    assert all(bool(p.isfinite().all()) for p in model.parameters())  # the weights themselves are finite
    assert float(non_finite_flag(model)) == 0.0
    assert float(non_finite_flag(model, opt)) == 1.0
    assert not weights_finite(Accelerator(cpu=True), model, opt)
    assert "in: the optimiser state" in diagnose_weights(model, 7, 1e-3, None)
