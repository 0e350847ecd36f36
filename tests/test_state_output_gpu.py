"""The memory's forward launches after its intra-chunk matrices (``kdn.ops.triton.state_output``) on CUDA (marker
``gpu``).

Both KDNs with ``KDN_STATE_KERNEL=fused`` and ``wy`` against the float64 reference, forward and every gradient,
within the tolerances of ``test_kdn_triton.py`` (tails, packed sequences with a one-token one, gates past fla's safe
envelope, the FP32 route); and our launches alone against fla's three (WY, states, output) on the same bf16 inputs,
at a training layer's shape and packed, keeping the states and keeping none.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kdn_inputs import make_state, rel_err
from test_kdn_triton import _assert_within, _case, _compare

pytestmark = pytest.mark.gpu


@pytest.fixture(params=["fused", "wy"])
def fused(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each of our launches: fla's WY launch + the fused states and output, and all three in one."""
    monkeypatch.setenv("KDN_STATE_KERNEL", request.param)
    return request.param


@pytest.mark.parametrize("isotropic", [False, True], ids=["diag", "iso"])
@pytest.mark.parametrize("T,H,K,g_min", [(1, 1, 64, -2.0), (65, 16, 128, -2.0), (1000, 4, 64, -12.0),
                                         (4096, 16, 128, -2.0)])
def test_kdn_through_the_fused_launch_matches_float64(fused: str, isotropic: bool, T: int, H: int, K: int,
                                                      g_min: float) -> None:
    case = _case(2, T, H, K, isotropic, seed=T + H + K, g_min=g_min)
    _assert_within(_compare(isotropic, case, {"T": T, "H": H, "K": K, "g_min": g_min, "state_kernel": fused}))


@pytest.mark.parametrize("isotropic", [False, True], ids=["diag", "iso"])
def test_packed_kdn_through_the_fused_launch_matches_float64(fused: str, isotropic: bool) -> None:
    lengths = [1, 100, 63, 700, 64, 2]
    case = _case(1, sum(lengths), 16, 64, isotropic, seed=8, g_min=-2.0)
    S0, u0 = make_state(len(lengths), 16, 64, 64, isotropic=isotropic, seed=9)
    case["S0"], case["u0"] = S0.cuda(), u0.cuda()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
    _assert_within(_compare(isotropic, case, {"T": sum(lengths), "H": 16, "K": 64, "varlen": lengths,
                                              "state_kernel": fused}, cu))


@pytest.mark.parametrize("isotropic", [False, True], ids=["diag", "iso"])
def test_fp32_route_through_the_fused_launch_matches_float64(fused: str, isotropic: bool) -> None:
    case = _case(2, 1000, 4, 128, isotropic, seed=11, g_min=-2.0)
    _assert_within(_compare(isotropic, case, {"T": 1000, "H": 4, "K": 128, "precision": "fp32",
                                              "state_kernel": fused}, precision="fp32"))


@pytest.mark.parametrize("lengths", [(8192,), (1, 4000, 64, 4127)], ids=["T8192", "packed"])
def test_our_launches_match_flas_launches(lengths: tuple[int, ...]) -> None:
    from fla.ops.utils import chunk_local_cumsum, prepare_chunk_indices
    from fla.ops.utils.constant import RCP_LN2

    from kdn.ops import fla_internals
    from kdn.ops.triton.state_output import chunk_state_output, chunk_wy_state_output

    T, H, K, V, BT = sum(lengths), 16, 128, 128, 64
    cu = None if len(lengths) == 1 else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
    N = len(lengths)
    gen = torch.Generator(device="cuda").manual_seed(3)

    def rnd(*shape: int, s: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device="cuda") * s).bfloat16()

    q, k, kappa, v, Aqk = rnd(1, T, H, K), rnd(1, T, H, K, s=0.1), rnd(1, T, H, K, s=0.1), rnd(1, T, H, V), \
        rnd(1, T, H, BT, s=0.1)
    beta = (torch.rand(1, T, H, generator=gen, device="cuda") * 0.8 + 0.1).bfloat16()
    t = torch.arange(T, device="cuda")
    starts = torch.zeros_like(t) if cu is None else cu[torch.searchsorted(cu, t, right=True) - 1]
    row, col = ((t - starts) % BT)[:, None, None], torch.arange(BT, device="cuda")
    Akk = torch.where(col < row, rnd(1, T, H, BT, s=0.1).float(), (col == row).float()).bfloat16()
    gc = chunk_local_cumsum(-F.softplus(torch.randn(1, T, H, K, generator=gen, device="cuda")) * 0.1, chunk_size=BT,
                            scale=RCP_LN2, cu_seqlens=cu)
    h0 = torch.randn(N, H, K, V, generator=gen, device="cuda")
    ci = None if cu is None else prepare_chunk_indices(cu, BT)
    w, u, qg, kg = fla_internals.recompute_w_u_fwd(k=k, k_precond=kappa, v=v, beta=beta, A=Akk, gk=gc, q=q,
                                                   output_qg=True, output_kg=True, cu_seqlens=cu, chunk_indices=ci)
    h, v_new, S = fla_internals.chunk_gated_delta_rule_fwd_h(k=kg, w=w, u=u, gk=gc, initial_state=h0,
                                                             output_final_state=True, chunk_size=BT, cu_seqlens=cu)
    o = fla_internals.chunk_gla_fwd_o_gk(q=q, v=v_new, g=gc, A=Aqk, h=h, scale=K ** -0.5, chunk_size=BT,
                                         cu_seqlens=cu, chunk_indices=ci)
    ref = (o, h, v_new, S, w, qg, kg)
    names = ("o", "h", "v_new", "S", "w", "qg", "kg")
    fused = chunk_state_output(q, kg, w, u, gc, Aqk, K ** -0.5, h0, True, cu_seqlens=cu, chunk_indices=ci)
    lean = chunk_state_output(q, kg, w, u, gc, Aqk, K ** -0.5, h0, True, save_states=False, cu_seqlens=cu)
    wy_args = (q, k, kappa, v, beta, gc, Akk, Aqk, K ** -0.5, h0, True)
    wy = chunk_wy_state_output(*wy_args, cu_seqlens=cu, chunk_indices=ci)
    wy_lean = chunk_wy_state_output(*wy_args, save_states=False, cu_seqlens=cu)
    errs = {f"fused_{n}": rel_err(a, b) for n, a, b in zip(names, fused, ref)}
    errs |= {f"wy_{n}": rel_err(a, b) for n, a, b in zip(names, wy, ref)}
    for path, out in (("fused", lean), ("wy", wy_lean)):
        errs |= {f"{path}_o_nothing_kept": rel_err(out[0], o), f"{path}_S_nothing_kept": rel_err(out[3], S)}
        assert all(x is None for x in out[1:3] + out[4:]), path
    print(errs)
    # fla's own roundings, in fla's order: the fused launch was bit-identical to fla's on an H100
    assert max(e for n, e in errs.items() if n.startswith("fused")) <= 1e-3, errs
    assert max(errs.values()) <= 0.005, errs  # bf16 outputs: the dots' shapes differ from fla's, not the values


def test_auto_takes_the_fused_launch_on_sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    from kdn.ops.triton.state_output import state_output_kernel

    monkeypatch.delenv("KDN_STATE_KERNEL", raising=False)
    dev = torch.device("cuda")
    want = "fused" if torch.cuda.get_device_capability(dev)[0] >= 9 else "fla"
    assert state_output_kernel(None, dev) == want
    assert state_output_kernel("fla", dev) == "fla"
