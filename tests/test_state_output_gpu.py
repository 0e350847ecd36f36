"""The memory's chunk states and output in one launch (``kdn.ops.triton.state_output``) on CUDA (marker ``gpu``).

Both KDNs with ``KDN_STATE_KERNEL=fused`` against the float64 reference, forward and every gradient, within the
tolerances of ``test_kdn_triton.py`` (tails, packed sequences with a one-token one, gates past fla's safe envelope,
the FP32 route); and the launch alone against fla's two launches on the same bf16 inputs, at a training layer's shape
and packed, keeping the states and keeping none.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kdn_inputs import make_state, rel_err
from test_kdn_triton import _assert_within, _case, _compare

pytestmark = pytest.mark.gpu


@pytest.fixture
def fused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KDN_STATE_KERNEL", "fused")


@pytest.mark.parametrize("isotropic", [False, True], ids=["diag", "iso"])
@pytest.mark.parametrize("T,H,K,g_min", [(1, 1, 64, -2.0), (65, 16, 128, -2.0), (1000, 4, 64, -12.0),
                                         (4096, 16, 128, -2.0)])
def test_kdn_through_the_fused_launch_matches_float64(fused: None, isotropic: bool, T: int, H: int, K: int,
                                                      g_min: float) -> None:
    case = _case(2, T, H, K, isotropic, seed=T + H + K, g_min=g_min)
    _assert_within(_compare(isotropic, case, {"T": T, "H": H, "K": K, "g_min": g_min, "state_kernel": "fused"}))


@pytest.mark.parametrize("isotropic", [False, True], ids=["diag", "iso"])
def test_packed_kdn_through_the_fused_launch_matches_float64(fused: None, isotropic: bool) -> None:
    lengths = [1, 100, 63, 700, 64, 2]
    case = _case(1, sum(lengths), 16, 64, isotropic, seed=8, g_min=-2.0)
    S0, u0 = make_state(len(lengths), 16, 64, 64, isotropic=isotropic, seed=9)
    case["S0"], case["u0"] = S0.cuda(), u0.cuda()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
    _assert_within(_compare(isotropic, case, {"T": sum(lengths), "H": 16, "K": 64, "varlen": lengths,
                                              "state_kernel": "fused"}, cu))


@pytest.mark.parametrize("isotropic", [False, True], ids=["diag", "iso"])
def test_fp32_route_through_the_fused_launch_matches_float64(fused: None, isotropic: bool) -> None:
    case = _case(2, 1000, 4, 128, isotropic, seed=11, g_min=-2.0)
    _assert_within(_compare(isotropic, case, {"T": 1000, "H": 4, "K": 128, "precision": "fp32",
                                              "state_kernel": "fused"}, precision="fp32"))


@pytest.mark.parametrize("lengths", [(8192,), (1, 4000, 64, 4127)], ids=["T8192", "packed"])
def test_fused_launch_matches_flas_two_launches(lengths: tuple[int, ...]) -> None:
    from fla.ops.utils import chunk_local_cumsum, prepare_chunk_indices
    from fla.ops.utils.constant import RCP_LN2

    from kdn.ops import fla_internals
    from kdn.ops.triton.state_output import chunk_state_output

    T, H, K, V, BT = sum(lengths), 16, 128, 128, 64
    cu = None if len(lengths) == 1 else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
    N = len(lengths)
    gen = torch.Generator(device="cuda").manual_seed(3)

    def rnd(*shape: int, s: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device="cuda") * s).bfloat16()

    q, kg, w, u, Aqk = rnd(1, T, H, K), rnd(1, T, H, K, s=0.1), rnd(1, T, H, K, s=0.1), rnd(1, T, H, V), \
        rnd(1, T, H, BT, s=0.1)
    gc = chunk_local_cumsum(-F.softplus(torch.randn(1, T, H, K, generator=gen, device="cuda")) * 0.1, chunk_size=BT,
                            scale=RCP_LN2, cu_seqlens=cu)
    h0 = torch.randn(N, H, K, V, generator=gen, device="cuda")
    ci = None if cu is None else prepare_chunk_indices(cu, BT)
    h, v_new, S = fla_internals.chunk_gated_delta_rule_fwd_h(k=kg, w=w, u=u, gk=gc, initial_state=h0,
                                                             output_final_state=True, chunk_size=BT, cu_seqlens=cu)
    o = fla_internals.chunk_gla_fwd_o_gk(q=q, v=v_new, g=gc, A=Aqk, h=h, scale=K ** -0.5, chunk_size=BT,
                                         cu_seqlens=cu, chunk_indices=ci)
    got = chunk_state_output(q, kg, w, u, gc, Aqk, K ** -0.5, h0, True, cu_seqlens=cu, chunk_indices=ci)
    lean = chunk_state_output(q, kg, w, u, gc, Aqk, K ** -0.5, h0, True, save_states=False, cu_seqlens=cu)
    errs = {n: rel_err(a, b) for n, a, b in zip(("o", "h", "v_new", "S"), got, (o, h, v_new, S))}
    errs |= {"o_nothing_kept": rel_err(lean[0], o), "S_nothing_kept": rel_err(lean[3], S)}
    assert lean[1] is None and lean[2] is None
    assert max(errs.values()) <= 0.005, errs  # bf16 outputs: the dots' order differs from fla's, not the values


def test_auto_takes_the_fused_launch_on_sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    from kdn.ops.triton.state_output import state_output_kernel

    monkeypatch.delenv("KDN_STATE_KERNEL", raising=False)
    dev = torch.device("cuda")
    want = "fused" if torch.cuda.get_device_capability(dev)[0] >= 9 else "fla"
    assert state_output_kernel(None, dev) == want
    assert state_output_kernel("fla", dev) == "fla"
