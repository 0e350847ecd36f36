"""The KDN layers' initial values (docs/math.md §5), read from the parameters and, where the layer passes them on,
from what reaches the gain recurrence: prior precision 1, isotropic initial process noise ``softplus(0)``, the
retention gates' initial distribution (KDA's and the sigmoid option's alike), learned ``mu = d_k``."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from kdn_inputs import rel_err
from layer_reference import recurrence_inputs, retention

import kdn

D, H, K = 24, 3, 8
LAYERS = {"diag": kdn.DiagonalKDN, "iso": kdn.IsotropicKDN}
# KDA's initial retention: g = -A dt with A ~ U(1, 16), dt ~ logUniform(1e-3, 1e-1), dt clamped at 1e-4
DECAY_RANGE = (1e-3, 16 * 0.1)


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_initial_prior_noise_and_mu(kind: str) -> None:
    torch.manual_seed(0)
    layer = LAYERS[kind](D, H, K, mu="learned").double()
    x = torch.randn(2, 9, D, dtype=torch.float64)
    got = recurrence_inputs(layer, x)
    precision = 0.1 + F.softplus(layer.prior_theta)
    assert rel_err(precision, torch.ones(H)) <= 1e-6, "initial prior precision 1"
    assert rel_err(got["u0"], torch.ones_like(got["u0"])) <= 1e-6, "initial uncertainty 1"
    omega = got["omega"]
    assert rel_err(omega, torch.full_like(omega, math.log(2.0))) <= 1e-12, "initial noise softplus(0), isotropic"
    assert got["r"].min() > 0.01
    assert rel_err(layer.mu(), torch.full((H,), float(K))) <= 1e-6


@pytest.mark.parametrize("alpha", ["kda", "sigmoid"])
def test_initial_retention_follows_kdas_distribution(alpha: str) -> None:
    """Both gate options start at ``alpha_0 = exp(-A dt)``: with a zero gate input the per-channel decay ``-log alpha``
    lies in KDA's range, spread over it (not its complement ``-log(1 - alpha_0)``, a flipped bias)."""
    torch.manual_seed(1)
    layer = kdn.DiagonalKDN(D, 8, K, alpha_param=alpha).double()
    front = layer.front
    if alpha == "kda":
        decay = front.A_log.exp()[:, None] * F.softplus(front.dt_bias.view(8, K))
    else:
        decay = -F.logsigmoid(front.gate_bias)
    lo, hi = DECAY_RANGE
    assert decay.min() >= lo * (1 - 1e-6) and decay.max() <= hi * (1 + 1e-6), (decay.min(), decay.max())
    # log-uniform dt: the median decay sits near sqrt(1e-3 * 1e-1) * E[A], far below the range's top
    assert 1e-3 < decay.median() < 0.3
    # the layer hands the recurrence this gate at its initial values
    x = torch.randn(1, 5, D, dtype=torch.float64)
    assert rel_err(recurrence_inputs(layer, x)["g"], retention(front, x)) <= 1e-12


def test_the_sigmoid_gates_bias_gives_each_head_its_own_A() -> None:
    """``alpha_param="sigmoid"`` starts at ``alpha_0 = exp(-A_h dt_c)``, ``A_h`` per head and ``dt_c`` per channel,
    as KDA's gate: from the same seed both gates draw the same ``A`` and ``dt``, so KDA's parameters give them back,
    and each channel's decay ``-log alpha_0`` over its ``dt`` is its head's ``A``: one value for all channels of a
    head, differing across heads as ``A`` does (``A`` repeated head after head along the channels would give a head
    the values of several)."""
    from kdn.modules import kda_retention, sigmoid_retention

    heads, width = 4, 8
    gates = {}
    for alpha, build in (("kda", kda_retention), ("sigmoid", sigmoid_retention)):
        torch.manual_seed(3)
        gates[alpha] = build(heads, heads * width)
    A = gates["kda"]["A_log"].detach().double().exp()  # [H]
    dt = F.softplus(gates["kda"]["dt_bias"].detach().double())  # [H*K]
    assert len(set(A.tolist())) == heads and A.max() - A.min() > 1
    per_channel = (-F.logsigmoid(gates["sigmoid"]["gate_bias"].detach().double()) / dt).view(heads, width)
    torch.testing.assert_close(per_channel, A[:, None].expand(heads, width), rtol=1e-3, atol=0)
