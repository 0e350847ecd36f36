"""The one-launch Diagonal gain (:mod:`kdn.ops.triton.gain_lookback`) on CUDA (marker ``gpu``): programs run at once
and wait for each other's carries, which the interpreter's tests (tests/test_gain_lookback_interpret.py) cannot show.

The gain alone in FP32 against float64 (every segment size, omega before its softplus, fla's DPLR operands, 32K
tokens in 2,048 segments, packed sequences with an empty one), bitwise the same on a second run and within FP32
rounding of the three-launch gain at a training step's size; Diagonal KDN with it (``one_pass_gain=True``) within
the tolerances of tests/test_kdn_triton.py, strong forgetting, packed sequences and KDA's gate in the kernels included.
"""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from kdn_inputs import make_inputs, make_state, packed_diagonal_gain, rel_err

pytestmark = pytest.mark.gpu
NAMES = ("k", "g", "omega", "r", "mu", "p0")


def _leaves(B: int, T: int, H: int, K: int, N: int, softplus: bool, seed: int) -> dict[str, torch.Tensor]:
    x = make_inputs(B, T, H, K, K, isotropic=False, seed=seed, g_min=-3.0)
    if softplus:  # omega's input: both signs, some far below 0
        x["omega"] = torch.randn(x["omega"].shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4)) * 3
        x["omega"][:, :50] -= 20.0
    x["mu"] = torch.linspace(1.0, float(K), H, dtype=torch.float64)
    x["p0"] = make_state(N, H, K, K, isotropic=False)[1]
    return {n: x[n].cuda().requires_grad_() for n in NAMES}


def _errors(B: int, T: int, H: int, K: int, seg: int, softplus: bool = False, dplr: bool = False,
            lens: tuple[int, ...] | None = None) -> dict[str, float]:
    """FP32 one-launch gain against float64 (packed sequences one at a time in the reference)."""
    from kdn.ops import triton as kt

    l64 = _leaves(B, T, H, K, B if lens is None else len(lens), softplus, seed=T + K + seg)
    l32 = {n: t.detach().float().requires_grad_() for n, t in l64.items()}
    k, g, omega, r, mu, p0 = (l64[n] for n in NAMES)
    omega = F.softplus(omega) if softplus else omega
    cu = None if lens is None else [0, *itertools.accumulate(lens)]
    kappa, pT = packed_diagonal_gain(k, g, omega, r, mu, p0, lens)
    ref_outs = (kappa, g.exp() * k, -kappa, pT) if dplr else (kappa, pT)
    fn = kt.diagonal_gain_dplr if dplr else kt.diagonal_gain
    outs = fn(*(l32[n] for n in NAMES), cu_seqlens=None if cu is None else torch.tensor(cu, device="cuda"),
              omega_softplus=softplus, segment_size=seg, one_pass=True)
    gen = torch.Generator(device="cuda").manual_seed(2)
    ups = [torch.randn(t.shape, generator=gen, device="cuda", dtype=torch.float64) for t in ref_outs]
    sum((t * u).sum() for t, u in zip(ref_outs, ups)).backward()
    sum((t.double() * u).sum() for t, u in zip(outs, ups)).backward()
    errs = {f"out{i}": rel_err(o, r) for i, (o, r) in enumerate(zip(outs, ref_outs))}
    return errs | {f"d{n}": rel_err(l32[n].grad, l64[n].grad) for n in NAMES}


@pytest.mark.parametrize("seg", [16, 32, 64])
@pytest.mark.parametrize("softplus,dplr,K", [(False, False, 128), (True, True, 64)], ids=["plain", "softplus_dplr"])
def test_one_launch_gain_fp32_is_tight(seg: int, softplus: bool, dplr: bool, K: int) -> None:
    errs = _errors(2, 3000, 8, K, seg, softplus, dplr)
    assert max(errs.values()) < 1e-4, errs


@pytest.mark.parametrize("lens", [None, (0, 1, 100, 5000, 17, 3000)], ids=["long", "packed"])
def test_one_launch_gain_long_and_packed(lens: tuple[int, ...] | None) -> None:
    """32,768 tokens in 2,048 segments of 16 (256 groups in a chain), or packed sequences of 0 to 5,000 tokens."""
    B, T = (1, 32768) if lens is None else (1, sum(lens))
    errs = _errors(B, T, 4, 64, 16, lens=lens)
    assert max(errs.values()) < 1e-4, errs


def test_one_launch_gain_is_deterministic_and_equals_three_launches() -> None:
    """A training step's size (4 x 8192 tokens, 16 heads of 128), KDA's gate and the memory's gradients as
    ``chunk_diagonal_kdn`` runs them (bench.gain_throughput): a second run is bitwise the same, and every output and
    gradient is within FP32 rounding of the three-launch gain (bf16 outputs: a bf16 rounding)."""
    from bench.gain_throughput import inputs, results

    x = inputs(4, 8192, 16, 128)
    first = results(x, 32, True)[0]
    assert all(torch.equal(u, v) for u, v in zip(first, results(x, 32, True)[0]))
    three = results(x, None, False)[0]
    errs = [rel_err(u, v) for u, v in zip(first, three)]
    assert max(errs) < 1e-2 and sorted(errs)[len(errs) // 2] < 1e-3, errs


@pytest.mark.parametrize("T,H,K,g_min", [(1000, 16, 128, -2.0), (4096, 16, 64, -2.0), (1000, 4, 64, -12.0)])
def test_diagonal_kdn_with_one_launch_gain(T: int, H: int, K: int, g_min: float) -> None:
    from test_kdn_triton import _assert_within, _case, _compare

    case = _case(2, T, H, K, False, seed=T + H + K, g_min=g_min)
    _assert_within(_compare(False, case, {"T": T, "H": H, "K": K, "g_min": g_min, "one_pass_gain": True},
                            one_pass_gain=True))


def test_diagonal_kdn_with_one_launch_gain_packed_and_gated() -> None:
    """Packed sequences, KDA's gate in the kernels, segments of 32: within fla's tolerances of float64, and within a
    bf16 rounding of the unfused composition (tests/test_kdn_triton.py, ``test_gain_and_memory_fused``)."""
    from test_kdn_triton import _assert_within
    from test_kdn_triton_interpret import fused_errors

    r = fused_errors((1, 100, 63, 700, 64, 2), 1, 930, -8.0, False, 16, 64, device="cuda", dtype=torch.bfloat16,
                     gate=True, segment_size=32, one_pass=True)
    _assert_within(r["ref"])
    assert r["unfused"]["dk"] < 1e-2 and max(e for n, e in r["unfused"].items() if n != "dk") < 1e-3, r["unfused"]
