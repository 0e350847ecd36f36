"""The KDN and delta-rule layers against independent compositions of their own parameters (tests/layer_reference.py),
every parameter random first: each option of the Table 4/5 ablations by value, the effective write strength from the
gains the recurrence used, and float64 gradients of the whole layer."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
from kdn_inputs import rel_err
from layer_reference import delta_layer, kdn_layer, randomize, recurrence_inputs

import kdn
from models.layers.delta import DELTA_MIXERS

warnings.filterwarnings("ignore", message=".*Triton is not supported.*")

D, H, K = 24, 2, 8
B, T = 2, 20
LAYERS = {"diag": kdn.DiagonalKDN, "iso": kdn.IsotropicKDN}
MUS = ("1", "sqrt", "dk", "4dk", "learned")
NOISES = ("learned", "fixed_r", "fixed_r_omega")
ALPHAS = ("kda", "sigmoid")


def _kdn(kind: str, seed: int = 0, **kw: object) -> torch.nn.Module:
    layer = LAYERS[kind](D, H, K, layer_idx=0, **kw).double()
    randomize(layer, seed)
    return layer


def _x(seed: int, batch: int = B, length: int = T, width: int = D) -> torch.Tensor:
    return torch.randn(batch, length, width, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _run_capturing_readout(layer: torch.nn.Module, x: torch.Tensor, **kw: object) -> tuple[tuple, torch.Tensor]:
    """The layer's outputs and the memory read-out entering its output norm (``front.o_norm``'s first input)."""
    seen: list[torch.Tensor] = []
    hook = layer.front.o_norm.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    try:
        with torch.no_grad():
            outs = layer(x, **kw)
    finally:
        hook.remove()
    assert len(seen) == 1
    return outs, seen[0]


# every (mu, noise) pair, the gate alternating so that each mu and each noise option meets both gates
OPTIONS = [(mu, noise, ALPHAS[(i + j) % 2]) for i, mu in enumerate(MUS) for j, noise in enumerate(NOISES)]


@pytest.mark.parametrize(("mu", "noise", "alpha"), OPTIONS)
@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_kdn_layer_equals_independent_composition(kind: str, mu: str, noise: str, alpha: str) -> None:
    """Output, memory read-out and ``beta_eff`` equal the hand composition at <= 1e-10 in float64."""
    layer = _kdn(kind, seed=len(mu) + 7 * len(noise), mu=mu, noise=noise, alpha_param=alpha)
    x = _x(1)
    ref = kdn_layer(layer, x)
    (out, beta_none, _), o = _run_capturing_readout(layer, x)
    assert beta_none is None
    assert rel_err(o, ref["o"]) <= 1e-10, "memory read-out"
    assert rel_err(out, ref["out"]) <= 1e-10, "layer output"
    with torch.no_grad():
        out_b, beta_eff, _ = layer(x, output_beta_eff=True)
    assert rel_err(out_b, ref["out"]) <= 1e-10, "layer output with beta_eff"
    expected = (ref["k"] * ref["kappa"]).sum(-1)
    assert rel_err(beta_eff, expected) <= 1e-10, "beta_eff"


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_beta_eff_is_the_write_strength_of_the_gains_used(kind: str) -> None:
    """``beta_eff = sum_k k kappa`` with ``kappa`` from the public gain functions on the recurrence's own inputs
    (the composed ``k, g, omega, r, mu, p0``); each gain also equals the recurrence's write vector."""
    layer = _kdn(kind, seed=3, mu="learned")
    x = _x(2)
    ref = kdn_layer(layer, x)
    with torch.no_grad():
        _, beta_eff, _ = layer(x, output_beta_eff=True)
    args = (ref["k"], ref["g"], ref["omega"], ref["r"])
    if kind == "iso":
        beta, _ = kdn.isotropic_kdn_gain(*args, mu=ref["mu"], initial_state=ref["p0"])
        kappa = beta[..., None] * ref["k"]
    else:
        kappa, _ = kdn.diagonal_kdn_gain(*args, mu=ref["mu"], initial_state=ref["p0"])
    assert rel_err(kappa, ref["kappa"]) <= 1e-12
    assert rel_err(beta_eff, (ref["k"] * kappa).sum(-1)) <= 1e-10
    assert 0 <= beta_eff.min() and beta_eff.max() < 1


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_kdn_layer_equals_public_functional_api(kind: str) -> None:
    """The layer equals ``kdn.diagonal_kdn`` / ``kdn.isotropic_kdn`` run on the composed inputs and the learned
    prior, then the hand-written output block."""
    layer = _kdn(kind, seed=5, mu="sqrt")
    x = _x(3)
    ref = kdn_layer(layer, x)
    fn = kdn.isotropic_kdn if kind == "iso" else kdn.diagonal_kdn
    o, _ = fn(ref["q"], ref["k"], ref["v"], ref["g"], ref["omega"], ref["r"], mu=ref["mu"],
              initial_state=(None, ref["p0"].contiguous()))
    assert rel_err(o, ref["o"]) <= 1e-12
    _, o_layer = _run_capturing_readout(layer, x)
    assert rel_err(o_layer, o) <= 1e-10


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_mu_options_by_value(kind: str) -> None:
    expected = {"1": 1.0, "sqrt": math.sqrt(K), "dk": float(K), "4dk": 4.0 * K}
    for choice, value in expected.items():
        mu = _kdn(kind, mu=choice).mu()
        assert isinstance(mu, float) and mu == value, (choice, mu)
    assert _kdn(kind, mu=2.5).mu() == 2.5
    layer = _kdn(kind, seed=4, mu="learned")
    assert not torch.allclose(layer.log_mu, torch.full((H,), math.log(K), dtype=torch.float64))
    assert rel_err(layer.mu(), layer.log_mu.exp()) <= 1e-15
    fresh = LAYERS[kind](D, H, K, mu="learned")  # learned mu starts at d_k
    assert rel_err(fresh.mu(), torch.full((H,), float(K))) <= 1e-6


@pytest.mark.parametrize("noise", NOISES)
@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_noise_switches_deliver_their_values(kind: str, noise: str) -> None:
    """What reaches the gain recurrence (captured at the layer's ``beta_eff``): exactly ``r = 1`` under the fixed-r
    switches, exactly ``omega = 1`` under ``fixed_r_omega``, the learned values otherwise, and the prior
    ``p0 = 1 / (0.1 + softplus(theta))``."""
    layer = _kdn(kind, seed=6, noise=noise)
    x = _x(4)
    ref = kdn_layer(layer, x)
    got = recurrence_inputs(layer, x)
    omega, r, prior = got["omega"], got["r"], got["u0"]
    assert r.shape == (B, T, H) and omega.shape == ((B, T, H) if kind == "iso" else (B, T, H, K))
    if noise == "learned":
        assert rel_err(r, ref["r"]) <= 1e-12 and r.min() > 0.01
    else:
        assert torch.equal(r, torch.ones_like(r))
    if noise == "fixed_r_omega":
        assert torch.equal(omega, torch.ones_like(omega))
    else:
        assert rel_err(omega, ref["omega"]) <= 1e-12
    assert rel_err(prior, ref["p0"]) <= 1e-12


@pytest.mark.parametrize("name", sorted(DELTA_MIXERS))
def test_delta_layer_equals_fla_naive_composition(name: str) -> None:
    """Each delta-rule baseline, random parameters, equals its hand composition with fla's naive recurrence (which
    computes in FP32: hence the tolerance)."""
    torch.manual_seed(0)
    layer = DELTA_MIXERS[name](D, H, K, layer_idx=0).double()
    randomize(layer, seed=11)
    x = _x(5)
    ref = delta_layer(name, layer, x)
    (out, _, _), o = _run_capturing_readout(layer, x)
    assert rel_err(o, ref["o"]) <= 1e-5, "memory read-out"
    assert rel_err(out, ref["out"]) <= 1e-5, "layer output"


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_gradcheck_full_layer(kind: str) -> None:
    """float64 gradients of a tiny whole layer, every parameter and the input, against finite differences."""
    d, h, kk = 6, 2, 4
    layer = LAYERS[kind](d, h, kk, mu="learned", conv_size=3).double()
    randomize(layer, seed=8)
    names = [n for n, _ in layer.named_parameters()]
    params = [p.detach().clone().requires_grad_() for p in layer.parameters()]
    x = _x(6, batch=1, length=6, width=d).requires_grad_()

    def f(x: torch.Tensor, *ps: torch.Tensor) -> torch.Tensor:
        out, _, _ = torch.func.functional_call(layer, dict(zip(names, ps)), (x,))
        return out

    assert torch.autograd.gradcheck(f, (x, *params), eps=1e-6, atol=1e-6, rtol=1e-4, fast_mode=True)


@pytest.mark.gpu
@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("noise", ["learned", "fixed_r_omega"])
@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_cuda_layer_equals_independent_composition(kind: str, noise: str, alpha: str) -> None:
    """The CUDA route (fused front-end kernels, the gate and omega's softplus inside the Diagonal kernels, the
    Triton memory) under bf16 autocast, random FP32 parameters, against the float64 hand composition of the same
    parameters: output, memory read-out and ``beta_eff``. The tolerances are bf16's through a whole layer."""
    d, h, kk, t = 256, 4, 64, 200
    layer = LAYERS[kind](d, h, kk, layer_idx=0, mu="learned", noise=noise, alpha_param=alpha)
    randomize(layer, seed=12)
    x = _x(7, batch=2, length=t, width=d).float()
    ref = kdn_layer(layer.double(), x.double())
    layer = layer.float().cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        (out, _, _), o = _run_capturing_readout(layer, x.cuda())
        with torch.no_grad():
            _, beta_eff, _ = layer(x.cuda(), output_beta_eff=True)
    assert rel_err(o.cpu(), ref["o"]) <= 2e-2, "memory read-out"
    assert rel_err(out.cpu(), ref["out"]) <= 2e-2, "layer output"
    assert rel_err(beta_eff.cpu(), (ref["k"] * ref["kappa"]).sum(-1)) <= 2e-2, "beta_eff"
