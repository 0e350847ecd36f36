"""Chunked PyTorch path against the token-by-token reference; states, packing, gradients, numerics."""
from __future__ import annotations

import pytest
import torch
from kdn_inputs import make_inputs, make_state, rel_err

import kdn
from kdn.ops import naive
from kdn.ops import torch_chunk as kchunk
from kdn.ops import torch_gain as kgain

f64 = torch.float64


def _reference(isotropic: bool, x: dict, mu: torch.Tensor, state: tuple) -> tuple:
    fn = naive.isotropic_kdn_recurrent if isotropic else naive.diagonal_kdn_recurrent
    return fn(x["q"], x["k"], x["v"], x["g"], x["omega"], x["r"], mu, state)


def _api(isotropic: bool):
    return kdn.isotropic_kdn if isotropic else kdn.diagonal_kdn


@pytest.mark.parametrize("pairwise", [False, True], ids=["factorised", "pairwise"])
@pytest.mark.parametrize("isotropic", [False, True])
@pytest.mark.parametrize("T", [1, 63, 64, 65, 300])
def test_chunked_equals_recurrent(isotropic: bool, T: int, pairwise: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if pairwise:  # force the pairwise decay ratios that strong forgetting takes
        monkeypatch.setattr(kchunk, "SAFE_SPAN", {})
    B, H, K, V = 2, 3, 8, 5
    x = make_inputs(B, T, H, K, V, isotropic=isotropic, seed=T)
    mu = torch.tensor([1.0, 4.0, 32.0], dtype=f64)
    state = make_state(B, H, K, V, isotropic=isotropic)
    o, (S, p) = _api(isotropic)(**x, mu=mu, initial_state=state, output_final_state=True)
    o_ref, (S_ref, p_ref) = _reference(isotropic, x, mu, state)
    assert rel_err(o, o_ref) < 1e-12
    assert rel_err(S, S_ref) < 1e-12
    assert rel_err(p, p_ref) < 1e-12


@pytest.mark.parametrize("isotropic", [False, True])
def test_continuation_from_carried_state(isotropic: bool) -> None:
    B, T, H, K, V = 2, 150, 2, 8, 4
    x = make_inputs(B, T, H, K, V, isotropic=isotropic, seed=21)
    fn = _api(isotropic)
    o_full, st_full = fn(**x, output_final_state=True)
    outs, st = [], None
    for a, b in [(0, 37), (37, 38), (38, 130), (130, 150)]:
        o, st = fn(**{n: t[:, a:b] for n, t in x.items()}, initial_state=st, output_final_state=True)
        outs.append(o)
    assert rel_err(torch.cat(outs, 1), o_full) < 1e-12
    assert rel_err(st[0], st_full[0]) < 1e-12 and rel_err(st[1], st_full[1]) < 1e-12


@pytest.mark.parametrize("isotropic", [False, True])
def test_omega_softplus_takes_omega_before_its_softplus(isotropic: bool) -> None:
    """``omega_softplus=True`` with ``omega`` before its softplus (both signs, packed too) equals passing the
    softplus, values and the gradient reaching ``omega``'s input; such ``omega`` is not checked for sign."""
    H, K, V = 2, 8, 4
    x = make_inputs(1, 90, H, K, V, isotropic=isotropic, seed=5)
    raw = torch.randn(x["omega"].shape, dtype=f64, generator=torch.Generator().manual_seed(1)) * 3
    cu = torch.tensor([0, 31, 90])
    for kw in ({}, {"cu_seqlens": cu}):
        grads = []
        for fused in (True, False):
            w = raw.clone().requires_grad_()
            o, (S, p) = _api(isotropic)(**(x | {"omega": w if fused else torch.nn.functional.softplus(w)}),
                                        omega_softplus=fused, output_final_state=True, **kw)
            (o.sum() + S.sum() + p.sum()).backward()
            grads.append((o.detach(), S.detach(), p.detach(), w.grad))
        for a, b in zip(*grads):
            assert rel_err(a, b) < 1e-12


@pytest.mark.parametrize("isotropic", [False, True])
def test_varlen_equals_separate_sequences(isotropic: bool) -> None:
    H, K, V = 2, 8, 4
    lengths = [5, 70, 1, 33]
    seqs = [make_inputs(1, n, H, K, V, isotropic=isotropic, seed=100 + i) for i, n in enumerate(lengths)]
    packed = {n: torch.cat([s[n] for s in seqs], 1) for n in seqs[0]}
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    state = make_state(len(lengths), H, K, V, isotropic=isotropic)
    fn = _api(isotropic)
    o, (S, p) = fn(**packed, initial_state=state, output_final_state=True, cu_seqlens=cu)
    for i, s in enumerate(seqs):
        o_i, (S_i, p_i) = fn(**s, initial_state=(state[0][i:i + 1], state[1][i:i + 1]), output_final_state=True)
        assert rel_err(o[:, cu[i]:cu[i + 1]], o_i) < 1e-12
        assert rel_err(S[i], S_i[0]) < 1e-12 and rel_err(p[i], p_i[0]) < 1e-12


@pytest.mark.parametrize("isotropic", [False, True])
def test_gradcheck_public_api_every_input(isotropic: bool) -> None:
    B, T, H, K, V = 1, 5, 2, 3, 2
    x = make_inputs(B, T, H, K, V, isotropic=isotropic, seed=2, requires_grad=True)
    S0, p0 = (t.requires_grad_() for t in make_state(B, H, K, V, isotropic=isotropic))
    mu = torch.tensor([1.5, 3.0], dtype=f64, requires_grad=True)
    fn = _api(isotropic)

    def f(q, k, v, g, omega, r, S0, p0, mu):  # noqa: ANN001, ANN202
        o, (S, p) = fn(q, k, v, g, omega, r, mu=mu, initial_state=(S0, p0), output_final_state=True)
        return o, S, p

    assert torch.autograd.gradcheck(f, (*x.values(), S0, p0, mu), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("isotropic", [False, True])
def test_gradcheck_across_chunk_boundaries(isotropic: bool) -> None:
    """Small chunks so that the carries between chunks are differentiated too."""
    B, T, H, K, V = 1, 11, 1, 3, 2
    x = make_inputs(B, T, H, K, V, isotropic=isotropic, seed=4, requires_grad=True)
    S0, p0 = (t.requires_grad_() for t in make_state(B, H, K, V, isotropic=isotropic))
    mu = torch.tensor([2.0], dtype=f64)

    def f(q, k, v, g, omega, r, S0, p0):  # noqa: ANN001, ANN202
        if isotropic:
            a, n = torch.exp(2 * g).mean(-1), (k * k).sum(-1)
            b_prev, b_T = kgain.mobius_prev(a, omega, mu * n / K, r, p0, chunk=4)
            b_hat = a * b_prev + omega
            kappa = (b_hat / (r + b_hat * n))[..., None] * k
        else:
            a = torch.exp(2 * g)
            p_prev, b_T = kgain.mobius_prev(a, omega, mu[:, None] * k * k, r[..., None], p0, chunk=4)
            p_hat = a * p_prev + omega
            kappa = p_hat * k / (r + (p_hat * k * k).sum(-1))[..., None]
        o, S = kchunk.memory_chunk(q, k, kappa, v, g, S0, chunk=4)
        return o, S, b_T

    assert torch.autograd.gradcheck(f, (*x.values(), S0, p0), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("isotropic", [False, True])
@pytest.mark.parametrize("regime", ["strong_forgetting", "no_forgetting", "collapsing_uncertainty"])
def test_long_sequence_stays_finite_and_exact(isotropic: bool, regime: str) -> None:
    """FP32 over 4096 tokens against the float64 recurrence from a random initial state. With process noise the
    uncertainty does not collapse, so every token keeps writing; without noise and forgetting it shrinks as 1/t.
    The last 256 tokens are compared on their own, so that an error confined to late tokens is not diluted."""
    B, T, H, K, V = 1, 4096, 2, 8, 4
    x = make_inputs(B, T, H, K, V, isotropic=isotropic, seed=9, g_min=-12.0)
    if regime != "strong_forgetting":
        x["g"] = torch.zeros_like(x["g"])
    if regime == "collapsing_uncertainty":
        x["omega"] = torch.zeros_like(x["omega"])
    assert (x["omega"].min() > 0) == (regime != "collapsing_uncertainty")
    mu = torch.full((H,), float(K), dtype=f64)
    state = make_state(B, H, K, V, isotropic=isotropic, seed=10)
    o_ref, (S_ref, p_ref) = _reference(isotropic, x, mu, state)
    x32 = {n: t.float() for n, t in x.items()}
    o, (S, p) = _api(isotropic)(**x32, initial_state=tuple(s.float() for s in state), output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(S).all() and torch.isfinite(p).all()
    assert rel_err(o, o_ref) < 1e-5
    assert rel_err(o[:, -256:], o_ref[:, -256:]) < 1e-5
    assert rel_err(S, S_ref) < 1e-5
    assert rel_err(p, p_ref) < 1e-5


@pytest.mark.parametrize("isotropic", [False, True])
def test_bf16_inputs_close_to_float64(isotropic: bool) -> None:
    x = make_inputs(2, 200, 2, 16, 16, isotropic=isotropic, seed=13)
    fn = _api(isotropic)
    o_ref, _ = fn(**x)
    o_bf, _ = fn(**{n: t.bfloat16() for n, t in x.items()})
    assert o_bf.dtype == torch.bfloat16
    assert rel_err(o_bf, o_ref) < 1e-2


def test_isotropic_memory_is_kda_with_the_kdn_gain() -> None:
    """Isotropic KDN = fla's KDA recurrence with beta = the KDN gain (the delta-rule reduction)."""
    from fla.ops.kda.naive import naive_recurrent_kda

    x = make_inputs(2, 80, 3, 8, 6, isotropic=True, seed=17, dtype=torch.float32)
    S0 = torch.randn(2, 3, 8, 6)
    beta, _ = kdn.isotropic_kdn_gain(x["k"], x["g"], x["omega"], x["r"])
    o, (S, _) = kdn.isotropic_kdn(**x, initial_state=(S0, torch.ones(2, 3)), output_final_state=True)
    o_kda, S_kda = naive_recurrent_kda(x["q"], x["k"], x["v"], x["g"], beta, scale=1.0, initial_state=S0,
                                       output_final_state=True)
    assert rel_err(o, o_kda) < 1e-5 and rel_err(S, S_kda) < 1e-5


@pytest.mark.parametrize("rule", ["deltanet", "gated_deltanet", "kda"])
def test_fixed_gain_memory_reduces_to_delta_rules(rule: str) -> None:
    """``kappa = beta k`` with ``D = I``, ``alpha I``, ``diag(alpha)``: DeltaNet, Gated DeltaNet, KDA."""
    from fla.ops.kda.naive import naive_recurrent_kda

    B, T, H, K, V = 2, 70, 2, 8, 4
    x = make_inputs(B, T, H, K, V, seed=23, dtype=torch.float32)
    g = {"deltanet": torch.zeros_like(x["g"]), "gated_deltanet": x["g"][..., :1].expand_as(x["g"]),
         "kda": x["g"]}[rule].contiguous()
    beta = torch.rand(B, T, H)
    S0 = torch.randn(B, H, K, V)
    o, S = kchunk.memory_chunk(x["q"], x["k"], beta[..., None] * x["k"], x["v"], g, S0)
    o_ref, S_ref = naive_recurrent_kda(x["q"], x["k"], x["v"], g, beta, scale=1.0, initial_state=S0,
                                       output_final_state=True)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(S, S_ref) < 1e-5
