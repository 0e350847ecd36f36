"""The CUDA backend against the float64 PyTorch reference: forward and every gradient (marker ``gpu``).

Errors are ``||x - ref|| / ||ref||``. Tolerances are fla's own for KDA: o 0.005; dq, dk, dv, dS0 0.008;
gates (g, omega, r, initial uncertainty) 0.02. As a control, fla's ``chunk_kda`` is measured against the
same float64 reference on the same inputs. Set ``KDN_ACCURACY_JSON`` to append every measurement there.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from kdn_inputs import make_inputs, make_state, rel_err

import kdn
from kdn import chunk as kchunk

pytestmark = pytest.mark.gpu
TOL = {"o": 0.005, "q": 0.008, "k": 0.008, "v": 0.008, "S0": 0.008, "g": 0.02, "omega": 0.02, "r": 0.02,
       "u0": 0.02, "S": 0.005, "uT": 0.005}


def _record(entry: dict) -> None:
    path = os.environ.get("KDN_ACCURACY_JSON")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")


def _case(B: int, T: int, H: int, K: int, isotropic: bool, seed: int, g_min: float) -> dict:
    x = make_inputs(B, T, H, K, K, isotropic=isotropic, seed=seed, g_min=g_min)
    x["q"] = F.normalize(x["q"], dim=-1) * K ** -0.5  # as the layer feeds it
    S0, u0 = make_state(B, H, K, K, isotropic=isotropic, seed=seed + 1)
    return {**{n: t.cuda() for n, t in x.items()}, "S0": S0.cuda(), "u0": u0.cuda()}


def _run(case: dict, isotropic: bool, backend: str, dtype: torch.dtype, cu_seqlens: torch.Tensor | None = None,
         upstream: dict | None = None) -> tuple[dict, dict]:
    """Forward + backward; q, k, v in ``dtype``, gates and state in max(FP32, dtype)."""
    gate_dt = torch.float64 if dtype == torch.float64 else torch.float32
    leaves = {n: t.detach().to(dtype if n in "qkv" else gate_dt).requires_grad_() for n, t in case.items()}
    fn = kdn.isotropic_kdn if isotropic else kdn.diagonal_kdn
    o, (S, uT) = fn(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["omega"], leaves["r"],
                    initial_state=(leaves["S0"], leaves["u0"]), output_final_state=True,
                    cu_seqlens=cu_seqlens, backend=backend)
    outs = {"o": o, "S": S, "uT": uT}
    if upstream is None:
        gen = torch.Generator(device="cuda").manual_seed(0)
        upstream = {n: torch.randn(t.shape, generator=gen, device="cuda", dtype=torch.float64) for n, t in outs.items()}
    loss = sum((outs[n].double() * upstream[n]).sum() for n in outs)
    loss.backward()
    grads = {n: t.grad for n, t in leaves.items()}
    return {n: t.detach() for n, t in outs.items()}, {**grads, "_upstream": upstream}


def _compare(isotropic: bool, case: dict, tag: dict, cu_seqlens: torch.Tensor | None = None) -> dict:
    ref_out, ref_grad = _run(case, isotropic, "torch", torch.float64, cu_seqlens)
    out, grad = _run(case, isotropic, "triton", torch.bfloat16, cu_seqlens, upstream=ref_grad["_upstream"])
    errs = {n: rel_err(out[n], ref_out[n]) for n in out}
    errs.update({f"d{n}": rel_err(grad[n], ref_grad[n]) for n in case})
    for n, e in errs.items():
        assert e == e, f"{n}: NaN"
    _record({"variant": "isotropic" if isotropic else "diagonal", **tag, **errs})
    return errs


def _assert_within(errs: dict) -> None:
    bad = {n: e for n, e in errs.items() if e > TOL[n.removeprefix("d")]}
    assert not bad, f"over tolerance: {bad} (all: {errs})"


@pytest.mark.parametrize("isotropic", [False, True], ids=["diag", "iso"])
@pytest.mark.parametrize("K", [64, 128])
@pytest.mark.parametrize("H", [1, 16])
@pytest.mark.parametrize("T", [1, 63, 64, 65, 1000, 4096])
def test_triton_matches_float64_reference(isotropic: bool, K: int, H: int, T: int) -> None:
    case = _case(2, T, H, K, isotropic, seed=T + H + K, g_min=-2.0)
    _assert_within(_compare(isotropic, case, {"T": T, "H": H, "K": K, "g_min": -2.0}))


@pytest.mark.parametrize("isotropic", [False, True], ids=["diag", "iso"])
def test_triton_strong_forgetting(isotropic: bool) -> None:
    case = _case(2, 1000, 4, 64, isotropic, seed=5, g_min=-12.0)
    _assert_within(_compare(isotropic, case, {"T": 1000, "H": 4, "K": 64, "g_min": -12.0}))


@pytest.mark.parametrize("isotropic", [False, True], ids=["diag", "iso"])
def test_triton_long_sequence(isotropic: bool) -> None:
    case = _case(1, 32768, 2, 64, isotropic, seed=6, g_min=-2.0)
    _assert_within(_compare(isotropic, case, {"T": 32768, "H": 2, "K": 64, "g_min": -2.0}))


@pytest.mark.parametrize("isotropic", [False, True], ids=["diag", "iso"])
def test_triton_varlen(isotropic: bool) -> None:
    lengths = [1, 100, 63, 700, 64, 2]
    case = _case(1, sum(lengths), 16, 64, isotropic, seed=8, g_min=-2.0)
    S0, u0 = make_state(len(lengths), 16, 64, 64, isotropic=isotropic, seed=9)
    case["S0"], case["u0"] = S0.cuda(), u0.cuda()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
    _assert_within(_compare(isotropic, case, {"T": sum(lengths), "H": 16, "K": 64, "varlen": lengths}, cu))


@pytest.mark.parametrize("isotropic", [False, True], ids=["diag", "iso"])
def test_gain_scan_fp32_is_tight(isotropic: bool) -> None:
    """The Triton gain scan alone, FP32 against float64: forward and gradients to ~1e-5."""
    from kdn import gain as tgain
    from kdn import triton_ops

    B, T, H, K = 2, 3000, 8, 64
    x = make_inputs(B, T, H, K, K, isotropic=isotropic, seed=3, g_min=-3.0)
    u0 = make_state(B, H, K, K, isotropic=isotropic)[1]
    leaves64 = {n: x[n].cuda().requires_grad_() for n in ("k", "g", "omega", "r")} | {"u0": u0.cuda().requires_grad_()}
    leaves32 = {n: t.detach().float().requires_grad_() for n, t in leaves64.items()}
    mu = torch.full((H,), float(K), device="cuda")
    ref_fn, fn = (tgain.isotropic_gain, triton_ops.isotropic_gain) if isotropic else (tgain.diagonal_gain,
                                                                                        triton_ops.diagonal_gain)
    gain_ref, uT_ref = ref_fn(leaves64["k"], leaves64["g"], leaves64["omega"], leaves64["r"], mu.double(),
                              leaves64["u0"])
    gain, uT = fn(leaves32["k"], leaves32["g"], leaves32["omega"], leaves32["r"], mu, leaves32["u0"])
    up = torch.randn_like(gain_ref)
    upT = torch.randn_like(uT_ref)
    ((gain_ref * up).sum() + (uT_ref * upT).sum()).backward()
    ((gain.double() * up).sum() + (uT.double() * upT).sum()).backward()
    errs = {"gain": rel_err(gain, gain_ref), "uT": rel_err(uT, uT_ref)}
    errs.update({f"d{n}": rel_err(leaves32[n].grad, leaves64[n].grad) for n in leaves64})
    _record({"variant": ("isotropic" if isotropic else "diagonal") + "_gain_fp32", "T": T, **errs})
    assert max(errs.values()) < 1e-4, errs


def test_control_fla_kda_against_float64() -> None:
    """fla's own chunk_kda, bf16, against the float64 memory scan with the same beta (the control)."""
    from fla.ops.kda import chunk_kda

    for T, H, K in [(1000, 16, 64), (4096, 16, 128)]:
        case = _case(2, T, H, K, True, seed=T, g_min=-2.0)
        beta = torch.rand(2, T, H, device="cuda", dtype=torch.float64)
        leaves64 = {n: case[n].detach().requires_grad_() for n in ("q", "k", "v", "g", "S0")}
        o_ref, S_ref = kchunk.memory_chunk(leaves64["q"], leaves64["k"], beta[..., None] * leaves64["k"],
                                           leaves64["v"], leaves64["g"], leaves64["S0"])
        up, upS = torch.randn_like(o_ref), torch.randn_like(S_ref)
        ((o_ref * up).sum() + (S_ref * upS).sum()).backward()
        lv = {n: t.detach().to(torch.bfloat16 if n in "qkv" else torch.float32).requires_grad_()
              for n, t in leaves64.items()}
        o, S = chunk_kda(lv["q"], lv["k"], lv["v"], lv["g"], beta.to(torch.bfloat16), scale=1.0,
                         initial_state=lv["S0"], output_final_state=True)
        ((o.double() * up).sum() + (S.double() * upS).sum()).backward()
        errs = {"o": rel_err(o, o_ref), "S": rel_err(S, S_ref)}
        errs.update({f"d{n}": rel_err(lv[n].grad, leaves64[n].grad) for n in leaves64})
        _record({"variant": "control_fla_chunk_kda", "T": T, "H": H, "K": K, **errs})
        assert max(errs.values()) < 0.05, errs


@pytest.mark.parametrize("isotropic", [False, True], ids=["diag", "iso"])
@pytest.mark.parametrize("K", [64, 128])
def test_fused_recurrent_decoding_matches_float64(isotropic: bool, K: int) -> None:
    """``kdn.*_step`` on CUDA without grad takes the fused recurrent kernel; FP32 against float64."""
    B, T, H = 3, 20, 16
    case = _case(B, T, H, K, isotropic, seed=K, g_min=-3.0)
    fn = kdn.isotropic_kdn_step if isotropic else kdn.diagonal_kdn_step
    state64 = (case["S0"], case["u0"])
    state32 = (case["S0"].float(), case["u0"].float())
    errs = {"o": 0.0, "S": 0.0, "uT": 0.0}
    with torch.no_grad():
        for t in range(T):
            step = {n: case[n][:, t] for n in ("q", "k", "v", "g", "omega", "r")}
            o64, state64 = fn(**step, state=state64)
            o32, state32 = fn(**{n: x.float() for n, x in step.items()}, state=state32)
            errs = {"o": max(errs["o"], rel_err(o32, o64)), "S": max(errs["S"], rel_err(state32[0], state64[0])),
                    "uT": max(errs["uT"], rel_err(state32[1], state64[1]))}
    _record({"variant": ("isotropic" if isotropic else "diagonal") + "_fused_recurrent", "K": K, **errs})
    assert max(errs.values()) < 1e-4, errs
