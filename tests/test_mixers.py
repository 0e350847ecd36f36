"""Mixer-level tests: recurrences against fla's naive references and an independent Mamba-3 step loop,
parameter parity with fla's layers, attention windows, padding and packing. CPU, toy sizes."""
from __future__ import annotations

import math
import sys
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from kdn.layers import RecurrentCache
from models.layers._mamba_kernels import ShapeStableJit, stabilise_tilelang_kernels
from models.layers.attention import Attention
from models.layers.delta import DELTA_MIXERS, fla_layer_kwargs, fla_state_dict_map
from models.layers.mamba3 import Mamba3, mamba3_scan, rotate

warnings.filterwarnings("ignore", message=".*Triton is not supported.*")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _delta_inputs(B: int, T: int, H: int, K: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = _gen(seed)
    return {
        "q": F.normalize(torch.randn(B, T, H, K, generator=g), dim=-1),
        "k": F.normalize(torch.randn(B, T, H, K, generator=g), dim=-1),
        "v": torch.randn(B, T, H, K, generator=g),
        "g_head": -F.softplus(torch.randn(B, T, H, generator=g)) * 0.5,
        "g_chan": -F.softplus(torch.randn(B, T, H, K, generator=g)) * 0.5,
        "beta": torch.rand(B, T, H, generator=g),
        "b": torch.rand(B, T, H, K, generator=g),
        "w": torch.rand(B, T, H, K, generator=g),
        "S0": torch.randn(B, H, K, K, generator=g) * 0.3,
    }


def _fla_naive(name: str, x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    if name == "deltanet":
        from fla.ops.delta_rule.naive import delta_rule_recurrence

        o, S = delta_rule_recurrence(*(x[n].transpose(1, 2) for n in ("q", "k", "v", "beta")),
                                     initial_state=x["S0"].clone(), output_final_state=True)
        return o.transpose(1, 2), S
    if name == "gdn":
        from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

        return naive_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["beta"], x["g_head"],
                                                initial_state=x["S0"].clone(), output_final_state=True)
    if name == "kda":
        from fla.ops.kda.naive import naive_recurrent_kda

        return naive_recurrent_kda(x["q"], x["k"], x["v"], x["g_chan"], x["beta"], initial_state=x["S0"].clone(),
                                   output_final_state=True)
    from fla.ops.gdn2.naive import naive_recurrent_gdn2

    return naive_recurrent_gdn2(x["q"], x["k"], x["v"], x["g_chan"], x["b"], x["w"], initial_state=x["S0"].clone(),
                                output_final_state=True)


@pytest.mark.parametrize("name", sorted(DELTA_MIXERS))
def test_delta_scan_matches_fla_naive_reference(name: str) -> None:
    B, T, H, K = 2, 45, 2, 16
    x = _delta_inputs(B, T, H, K)
    mixer = DELTA_MIXERS[name](32, H, K)
    g = {"deltanet": None, "gdn": x["g_head"]}.get(name, x["g_chan"])
    terms = {"b": x["b"], "w": x["w"]} if name == "gdn2" else {"beta": x["beta"]}
    o, S = mixer.torch_call(x["q"], x["k"], x["v"], g, terms, x["S0"], None, torch.float32)
    o_ref, S_ref = _fla_naive(name, x)
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(S, S_ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", sorted(DELTA_MIXERS))
def test_delta_parameters_match_fla_layer(name: str) -> None:
    from fla import layers as fla_layers

    cls = {"deltanet": fla_layers.DeltaNet, "gdn": fla_layers.GatedDeltaNet, "kda": fla_layers.KimiDeltaAttention,
           "gdn2": fla_layers.GatedDeltaNet2}[name]
    d, H, K = 96, 3, 32
    ours = DELTA_MIXERS[name](d, H, K)
    theirs = cls(**fla_layer_kwargs(name, d, H, K, 1e-5))
    mapped = {k: tuple(v.shape) for k, v in fla_state_dict_map(name, ours.state_dict()).items()}
    assert mapped == {k: tuple(v.shape) for k, v in theirs.state_dict().items()}
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters())


@pytest.mark.parametrize("mimo", [False, True])
def test_mamba3_parameters_match_fla_layer(mimo: bool) -> None:
    from fla.layers import Mamba3 as FlaMamba3

    kw = {"hidden_size": 64, "state_size": 16, "head_dim": 16, "is_mimo": mimo, "mimo_rank": 2}
    ours, theirs = Mamba3(**kw), FlaMamba3(**kw)
    assert {k: tuple(v.shape) for k, v in ours.named_parameters()} == {
        k: tuple(v.shape) for k, v in theirs.named_parameters()}


def test_delta_output_gate_is_validated() -> None:
    with pytest.raises(ValueError, match="output_gate"):
        DELTA_MIXERS["kda"](32, 2, 16, output_gate="relu")
    with pytest.raises(ValueError, match="backend"):
        DELTA_MIXERS["kda"](32, 2, 16, backend="cuda")
    with pytest.raises(ValueError, match="needs CUDA"):
        DELTA_MIXERS["kda"](32, 2, 16, backend="fla")(torch.randn(1, 4, 32))


# --- Mamba-3 ----------------------------------------------------------------------------------------


def _mamba_step_loop(
    q: Tensor, k: Tensor, x: Tensor, z: Tensor, adt: Tensor, dt: Tensor, trap: Tensor, angles: Tensor,
    qb: Tensor, kb: Tensor, D: Tensor, mimo: tuple[Tensor, Tensor, Tensor] | None,
) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor, Tensor]]:
    """Token by token, from the Mamba-3 decode equations (mamba-ssm's step reference), float64."""
    B, T, R, G, N = q.shape
    H, P = x.shape[2:]
    pairwise = mimo is None
    qh = q.repeat_interleave(H // G, 3) + qb.transpose(0, 1)
    kh = k.repeat_interleave(H // G, 3) + kb.transpose(0, 1)
    S = torch.zeros(B, H, P, N, dtype=x.dtype)
    theta = torch.zeros(B, H, angles.shape[-1], dtype=x.dtype)
    k_prev, x_prev = torch.zeros(B, R, H, N, dtype=x.dtype), torch.zeros(B, H, P, dtype=x.dtype)
    x_proj = torch.ones(R, H, P, dtype=x.dtype) if mimo is None else mimo[0].transpose(0, 1)
    ys = []
    for t in range(T):
        theta = theta + torch.tanh(angles[:, t])[:, None] * math.pi * dt[:, t, :, None]
        C_t, B_t = rotate(qh[:, t], theta[:, None], pairwise), rotate(kh[:, t], theta[:, None], pairwise)
        alpha, lam = torch.exp(adt[:, t]), torch.sigmoid(trap[:, t])
        beta, gamma = (1 - lam) * dt[:, t] * alpha, lam * dt[:, t]
        xv, xv_prev = x[:, t, None] * x_proj, x_prev[:, None] * x_proj
        S = (S * alpha[..., None, None] + torch.einsum("brhp,brhn->bhpn", xv * gamma[:, None, :, None], B_t)
             + torch.einsum("brhp,brhn->bhpn", xv_prev * beta[:, None, :, None], k_prev))
        y_r = torch.einsum("bhpn,brhn->brhp", S, C_t) + xv * D[:, None]
        if mimo is None:
            ys.append(y_r[:, 0] * F.silu(z[:, t]))
        else:
            zr = z[:, t, None] * mimo[1].transpose(0, 1)
            ys.append((y_r * F.silu(zr) * mimo[2].transpose(0, 1)).sum(1))
        k_prev, x_prev = B_t, x[:, t]
    return torch.stack(ys, 1), (theta, S, k_prev, x_prev)


def _mamba_inputs(mimo: bool, T: int = 37, seed: int = 0) -> tuple:
    g = _gen(seed)
    B, R, G, N, H, P, A = 2, (3 if mimo else 1), 2, 8, 4, 6, 2

    def r(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=g, dtype=torch.float64)

    dt = F.softplus(r(B, T, H))
    seq = (r(B, T, R, G, N), r(B, T, R, G, N), r(B, T, H, P), r(B, T, H, P), -F.softplus(r(B, T, H)) * dt, dt,
           r(B, T, H), r(B, T, A))
    params = (r(H, R, N), r(H, R, N), r(H), tuple(r(H, R, P) for _ in range(3)) if mimo else None)
    return seq, params


@pytest.mark.parametrize("mimo", [False, True])
def test_mamba3_scan_matches_step_recurrence(mimo: bool) -> None:
    seq, (qb, kb, D, mimo_p) = _mamba_inputs(mimo)
    y_ref, (theta, S, k_last, x_last) = _mamba_step_loop(*seq, qb, kb, D, mimo_p)
    for chunk in (1, 8, 64):
        y, (angle, ssm, k_state, v_state) = mamba3_scan(*seq, qb, kb, D, mimo_p, chunk=chunk)
        torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(ssm, S, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(k_state, k_last)
        torch.testing.assert_close(v_state, x_last)
        torch.testing.assert_close(torch.cos(angle), torch.cos(theta))
        torch.testing.assert_close(torch.sin(angle), torch.sin(theta))


@pytest.mark.parametrize("mimo", [False, True])
def test_mamba3_scan_gradients_match_step_recurrence(mimo: bool) -> None:
    """Float64 gradients of the chunked scan (several chunks, a partial last one) equal the token loop's, for every
    input and parameter, by ``||g - g_ref|| / ||g_ref||``."""
    seq, (qb, kb, D, mimo_p) = _mamba_inputs(mimo, T=29, seed=3)
    leaves = [t.clone().requires_grad_() for t in (*seq, qb, kb, D, *(mimo_p or ()))]
    n = len(seq) + 3

    def grads(fn) -> list[torch.Tensor]:
        mimo_args = tuple(leaves[n:]) or None
        y, (_, S, _, _) = fn(*leaves[:len(seq)], *leaves[len(seq):n], mimo_args)
        w = torch.randn(y.shape, generator=_gen(7), dtype=y.dtype)
        ((y * w).sum() + S.square().sum()).backward()
        out = [t.grad.clone() for t in leaves]
        for t in leaves:
            t.grad = None
        return out

    ref = grads(_mamba_step_loop)
    got = grads(lambda *a: mamba3_scan(*a, chunk=8))
    for g, r in zip(got, ref):
        assert (g - r).norm() / r.norm() < 1e-10


@pytest.mark.parametrize("mimo", [False, True])
def test_mamba3_scan_continues_from_its_state(mimo: bool) -> None:
    seq, (qb, kb, D, mimo_p) = _mamba_inputs(mimo)
    y_full, s_full = mamba3_scan(*seq, qb, kb, D, mimo_p, chunk=8)
    y1, s1 = mamba3_scan(*(t[:, :20] for t in seq), qb, kb, D, mimo_p, chunk=8)
    y2, s2 = mamba3_scan(*(t[:, 20:] for t in seq), qb, kb, D, mimo_p, chunk=16, state=s1)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y_full, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s2[1], s_full[1], rtol=1e-10, atol=1e-10)


def test_rotate_conventions() -> None:
    x = torch.arange(1.0, 9.0)  # N = 8, two rotary planes
    theta = torch.tensor([math.pi / 2, math.pi])
    pair = rotate(x, theta, pairwise=True)  # planes (0,1), (2,3); dims 4..7 pass through
    torch.testing.assert_close(pair, torch.tensor([-2.0, 1.0, -3.0, -4.0, 5.0, 6.0, 7.0, 8.0]))
    half = rotate(x, theta, pairwise=False)  # planes (0,4), (1,5); dims 2,3,6,7 pass through
    torch.testing.assert_close(half, torch.tensor([-5.0, -2.0, 3.0, 4.0, 1.0, -6.0, 7.0, 8.0]))


@pytest.mark.parametrize("mimo", [False, True])
def test_mamba3_padding_steps_are_identities(mimo: bool) -> None:
    torch.manual_seed(0)
    layer = Mamba3(32, state_size=8, head_dim=16, is_mimo=mimo, mimo_rank=2, layer_idx=0).double()
    x = torch.randn(1, 12, 32, dtype=torch.float64)
    padded = torch.cat([torch.randn(1, 5, 32, dtype=torch.float64), x], 1)
    mask = torch.tensor([[0] * 5 + [1] * 12])
    y, _, c1 = layer(padded, attention_mask=mask, past_key_values=RecurrentCache(), use_cache=True)
    y_ref, _, c2 = layer(x, past_key_values=RecurrentCache(), use_cache=True)
    torch.testing.assert_close(y[:, 5:], y_ref)
    (angle, ssm, k, v), (angle_ref, ssm_ref, k_ref, v_ref) = c1.get(0)["recurrent"], c2.get(0)["recurrent"]
    torch.testing.assert_close(torch.cos(angle), torch.cos(angle_ref))
    for a, b in ((ssm, ssm_ref), (k, k_ref), (v, v_ref)):
        torch.testing.assert_close(a, b)


def test_mamba3_bad_arguments() -> None:
    with pytest.raises(ValueError, match="divisible by head_dim"):
        Mamba3(48, head_dim=64)
    with pytest.raises(ValueError, match="rope_fraction"):
        Mamba3(64, rope_fraction=0.25)
    with pytest.raises(ValueError, match="needs CUDA"):
        Mamba3(64, state_size=8, head_dim=16, backend="kernels")(torch.randn(1, 3, 64))
    cuda = torch.device("cuda")  # the choice of path needs no GPU: no tensor is made
    with pytest.raises(ValueError, match="head_dim in"):
        Mamba3(64, state_size=8, head_dim=16, is_mimo=True, backend="kernels")._use_kernels(cuda, False, 64)
    assert not Mamba3(64, state_size=8, head_dim=16, is_mimo=True)._use_kernels(cuda, False, 64)
    with pytest.raises(ValueError, match="head_dim <= state_size"):
        Mamba3(128, state_size=32, head_dim=64, backend="kernels")._use_kernels(cuda, False, 64)
    assert not Mamba3(128, state_size=32, head_dim=64)._use_kernels(cuda, False, 64)



class _Var:
    """Stands in for TileLang's symbolic dimension: a new object per call, equal only to itself."""

    def __init__(self, name: str, dtype: str = "int32") -> None:
        self.name, self.dtype = name, dtype


class _Jit:
    """Stands in for ``tilelang.jit``: counts the kernels it builds."""

    def __init__(self) -> None:
        self.built: list[tuple] = []

    def __call__(self, *args: object, **kwargs: object) -> tuple:
        self.built.append((args, kwargs))
        return ("kernel", len(self.built))

    def get_tir(self) -> str:
        return "tir"


def test_tilelang_kernels_are_built_once_per_argument_names(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("fake_mimo_fwd")
    jit, other = _Jit(), _Jit()
    module.mamba_mimo_fwd, module.helper = jit, other
    monkeypatch.setitem(sys.modules, "fake_mimo_fwd", module)
    assert stabilise_tilelang_kernels(("fake_mimo_fwd", "not_imported"), _Jit, _Var) == 2
    assert stabilise_tilelang_kernels(("fake_mimo_fwd",), _Jit, _Var) == 0  # wrapped already
    factory = module.mamba_mimo_fwd
    assert isinstance(factory, ShapeStableJit) and factory.get_tir() == "tir"
    first = factory(_Var("B"), _Var("S"), 32, 64, True, chunk_size=16)
    assert factory(_Var("B"), _Var("S"), 32, 64, True, chunk_size=16) is first  # fresh variables, same names
    assert len(jit.built) == 1
    assert factory(_Var("B"), _Var("S"), 32, 64, True, chunk_size=8) != first  # another static argument
    assert factory(_Var("B"), _Var("T"), 32, 64, True, chunk_size=16) != first  # another dimension name
    assert factory(_Var("B", "int64"), _Var("S"), 32, 64, True, chunk_size=16) != first
    assert len(jit.built) == 4 and not other.built
    key = next(iter(factory.kernels))  # a kept key gives back the arguments, with new dimensions of the same names
    args, kwargs = ShapeStableJit.arguments(key, _Var)
    assert [a.name for a in args[:2]] == ["B", "S"] and args[2:] == (32, 64, True) and kwargs == {"chunk_size": 16}
    assert factory(*args, **kwargs) is first and len(jit.built) == 4


# --- attention --------------------------------------------------------------------------------------


def test_sliding_window_sees_exactly_window_tokens() -> None:
    torch.manual_seed(0)
    layer = Attention(32, 2, 16, window=5).double()
    x = torch.randn(1, 20, 32, dtype=torch.float64)
    y = layer(x)[0]
    x2 = x.clone()
    x2[:, 7] += 1.0
    y2 = layer(x2)[0]
    changed = (y2 - y).abs().amax(-1)[0] > 1e-12
    assert changed.tolist() == [7 <= t <= 11 for t in range(20)]  # token 7 is seen by 7..11 only


def test_full_attention_matches_softmax_reference() -> None:
    torch.manual_seed(0)
    layer = Attention(32, 2, 16, window=None).double()
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    pos = torch.arange(9).expand(2, 9)
    from models.layers.attention import apply_rope

    q = apply_rope(layer.q_proj(x).view(2, 9, 2, 16), pos, 10000.0)
    k = apply_rope(layer.k_proj(x).view(2, 9, 2, 16), pos, 10000.0)
    v = layer.v_proj(x).view(2, 9, 2, 16)
    scores = torch.einsum("bthk,bshk->bhts", q, k) / 4.0
    scores = scores.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), float("-inf"))
    ref = layer.o_proj(torch.einsum("bhts,bshk->bthk", scores.softmax(-1), v).reshape(2, 9, 32))
    torch.testing.assert_close(layer(x)[0], ref)


def test_sliding_window_cache_is_bounded_and_exact() -> None:
    torch.manual_seed(0)
    layer = Attention(32, 2, 16, window=4, layer_idx=0).double()
    x = torch.randn(1, 15, 32, dtype=torch.float64)
    full = layer(x)[0]
    cache = RecurrentCache()
    outs = [layer(x[:, :6], past_key_values=cache, use_cache=True)[0]]
    for t in range(6, 15):
        outs.append(layer(x[:, t:t + 1], past_key_values=cache, use_cache=True)[0])
        assert cache.get(0)["k"].shape[2] == 3  # window - 1 past keys
    torch.testing.assert_close(torch.cat(outs, 1), full)


def test_attention_rejects_bad_window() -> None:
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="window"):
            Attention(32, 2, 16, window=bad)
