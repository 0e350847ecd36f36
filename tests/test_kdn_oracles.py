"""The paper's closed-form oracles (docs/math.md §7)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from kdn_inputs import make_inputs, rel_err

import kdn

f64 = torch.float64


def test_one_hot_keys_diagonal_mu1_equals_exact_kalman() -> None:
    B, T, H, K, V = 2, 40, 3, 6, 4
    x = make_inputs(B, T, H, K, V, seed=3)
    gen = torch.Generator().manual_seed(5)
    axis = torch.randint(0, K, (B, T, H), generator=gen)
    scale = (torch.rand(B, T, H, generator=gen, dtype=f64) * 3 + 0.2) * torch.where(
        torch.rand(B, T, H, generator=gen) < 0.5, -1.0, 1.0).to(f64)
    k = F.one_hot(axis, K).to(f64) * scale[..., None]
    args = dict(q=x["q"], k=k, v=x["v"], g=x["g"], omega=x["omega"], r=x["r"])
    o_diag, (S_d, p_d) = kdn.diagonal_kdn(**args, mu=1.0, output_final_state=True)
    o_ex, (S_e, P_e) = kdn.exact_kalman_memory(**args, output_final_state=True)
    assert rel_err(o_diag, o_ex) < 1e-12
    assert rel_err(S_d, S_e) < 1e-12
    assert rel_err(torch.diag_embed(p_d), P_e) < 1e-12  # the posterior stays diagonal
    # with generic keys the projection is only an approximation: the oracle must be able to fail
    args["k"] = x["k"]
    o_diag, _ = kdn.diagonal_kdn(**args, mu=1.0)
    o_ex, _ = kdn.exact_kalman_memory(**args)
    assert rel_err(o_diag, o_ex) > 1e-3


@pytest.mark.parametrize("variance,gain", [(9.0, 0.9), (0.1, 0.1 / 1.1)])
def test_one_dimensional_gain(variance: float, gain: float) -> None:
    one = torch.ones(1, 1, 1, 1, dtype=f64)
    # alpha = 1, omega = 0: the predicted variance is the prior p0
    kappa, _ = kdn.diagonal_kdn_gain(one, 0 * one, 0 * one, one[..., 0], mu=1.0,
                                     initial_state=torch.full((1, 1, 1), variance, dtype=f64))
    assert kappa.item() == pytest.approx(gain, rel=1e-12)
    beta, _ = kdn.isotropic_kdn_gain(one, 0 * one, 0 * one[..., 0], one[..., 0], mu=1.0,
                                     initial_state=torch.full((1, 1), variance, dtype=f64))
    assert beta.item() == pytest.approx(gain, rel=1e-12)


def test_repeated_observations_give_one_over_n_plus_one() -> None:
    T = 20
    one = torch.ones(1, T, 1, 1, dtype=f64)
    kappa, p = kdn.diagonal_kdn_gain(one, 0 * one, 0 * one, one[..., 0], mu=1.0, output_final_state=True)
    n = torch.arange(1, T + 1, dtype=f64)
    # gain at token n uses p_{n-1} = 1/n: kappa = (1/n) / (1 + 1/n) = 1/(n+1)
    torch.testing.assert_close(kappa.flatten(), 1 / (n + 1), rtol=1e-12, atol=0)
    assert p.item() == pytest.approx(1 / (T + 1), rel=1e-12)
    beta, b = kdn.isotropic_kdn_gain(one, 0 * one, 0 * one[..., 0], one[..., 0], mu=1.0, output_final_state=True)
    torch.testing.assert_close(beta.flatten(), 1 / (n + 1), rtol=1e-12, atol=0)


@pytest.mark.parametrize("mu,expected", [(1.0, 128 / 129), (128.0, 0.5)])
def test_uniform_energy_directional_variance(mu: float, expected: float) -> None:
    m = K = 128
    k = torch.full((1, 1, 1, K), 1 / math.sqrt(m), dtype=f64)
    zeros_g = torch.zeros_like(k)
    r = torch.ones(1, 1, 1, dtype=f64)
    v = torch.randn(1, 1, 1, 3, dtype=f64)
    # exact: P^ = I  ->  k^T P k = r p / (r + p) = 0.5
    _, (_, P) = kdn.exact_kalman_memory(k, k, v, zeros_g, zeros_g, r, output_final_state=True)
    assert torch.einsum("i,ij,j->", k.flatten(), P[0, 0], k.flatten()).item() == pytest.approx(0.5, rel=1e-12)
    # projected: m r p / (m r + mu p)
    _, p = kdn.diagonal_kdn_gain(k, zeros_g, zeros_g, r, mu=mu, output_final_state=True)
    assert (k.flatten() ** 2 * p.flatten()).sum().item() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("isotropic", [False, True])
def test_effective_write_strength_in_unit_interval_and_variance_positive(isotropic: bool) -> None:
    x = make_inputs(3, 200, 4, 16, 8, isotropic=isotropic, g_min=-6, seed=11)
    x["k"] = x["k"] * 5  # large keys push the gain towards 1
    if isotropic:
        beta, b = kdn.isotropic_kdn_gain(x["k"], x["g"], x["omega"], x["r"], output_final_state=True)
        beta_eff = beta * (x["k"] ** 2).sum(-1)
        unc = b
    else:
        kappa, p = kdn.diagonal_kdn_gain(x["k"], x["g"], x["omega"], x["r"], output_final_state=True)
        beta_eff = (kappa * x["k"]).sum(-1)
        unc = p
    assert beta_eff.min() >= 0 and beta_eff.max() < 1
    assert beta_eff.max() > 0.9  # the bound is tight, not vacuous
    assert (unc > 0).all()


@pytest.mark.parametrize("isotropic", [False, True])
def test_mu_leaves_the_current_write_unchanged(isotropic: bool) -> None:
    x = make_inputs(2, 12, 2, 8, 4, isotropic=isotropic, seed=7)
    fn = kdn.isotropic_kdn if isotropic else kdn.diagonal_kdn
    o1, _ = fn(**x, mu=1.0)
    o2, _ = fn(**x, mu=512.0)
    torch.testing.assert_close(o1[:, 0], o2[:, 0], rtol=1e-13, atol=1e-13)  # token 0: same write
    assert rel_err(o1[:, 1:], o2[:, 1:]) > 1e-3  # later tokens see the changed uncertainty
