"""The functional API at the edges of its input ranges, on the CPU (PyTorch path).

FP32 stays finite and matches float64 where float64 is finite: a tiny observation noise ``r``, a huge process noise
``omega`` or information scale ``mu`` (each token's Möbius matrix is formed already divided by ``(1 + u)(1 + w)``,
``kdn.ops.torch_gain``). Zero-sized dimensions and a float64 tensor among FP32 ones are refused with one-line errors.
"""
from __future__ import annotations

import pytest
import torch
from kdn_inputs import make_inputs, make_state, rel_err

import kdn

B, T, H, K = 2, 70, 2, 8  # T crosses the gain's 64-token and the memory's 32-token chunks
EXTREMES = [("r", 1e-20), ("omega", 1e20), ("mu", 1e20), ("r", 1e-35), ("omega", 1e35)]
NAMES = ("q", "k", "v", "g", "omega", "r")


def _extreme(isotropic: bool, name: str, value: float) -> tuple[dict, float | None]:
    x = make_inputs(B, T, H, K, K, isotropic=isotropic, seed=1)
    if name == "r":
        x["r"].fill_(value)
    elif name == "omega":
        x["omega"].mul_(value)
    return x, (value if name == "mu" else None)


def _run(isotropic: bool, x: dict, mu: float | None, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Output, final state and every gradient of one call in ``dtype`` (leaves made from the float64 ``x``)."""
    S0, p0 = make_state(B, H, K, K, isotropic=isotropic)
    leaves = {n: t.detach().to(dtype).requires_grad_() for n, t in {**x, "S0": S0, "p0": p0}.items()}
    fn = kdn.isotropic_kdn if isotropic else kdn.diagonal_kdn
    o, (S, p) = fn(*(leaves[n] for n in NAMES), mu=mu, initial_state=(leaves["S0"], leaves["p0"]),
                   output_final_state=True)
    gen = torch.Generator().manual_seed(0)
    ups = [torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in (o, S, p)]
    sum((t.double() * u).sum() for t, u in zip((o, S, p), ups)).backward()
    return {"o": o, "S": S, "p": p} | {"d" + n: t.grad for n, t in leaves.items()}


@pytest.mark.parametrize("isotropic", [False, True], ids=["diagonal", "isotropic"])
@pytest.mark.parametrize("name,value", EXTREMES, ids=[f"{n}={v:g}" for n, v in EXTREMES])
def test_fp32_is_finite_and_matches_float64_at_extreme_noise(isotropic: bool, name: str, value: float) -> None:
    """Outputs and states within 1e-5 of float64; gradients within 1e-5 on the scale of the call's largest gradient
    (where float64's gradient is near zero, as ``domega`` when ``r -> 0`` makes the Isotropic gain ``1 / ||k||^2``,
    FP32 keeps the rounding of the terms that cancel)."""
    x, mu = _extreme(isotropic, name, value)
    ref, out = _run(isotropic, x, mu, torch.float64), _run(isotropic, x, mu, torch.float32)
    assert all(bool(t.isfinite().all()) for t in ref.values())
    assert all(bool(t.isfinite().all()) for t in out.values()), {n: bool(t.isfinite().all()) for n, t in out.items()}
    for n in ("o", "S", "p"):
        assert rel_err(out[n], ref[n]) < 1e-5, (n, rel_err(out[n], ref[n]))
    scale = max(t.norm().item() for n, t in ref.items() if n.startswith("d"))
    errs = {n: (out[n].double() - ref[n]).norm().item() / scale for n in ref if n.startswith("d")}
    assert max(errs.values()) < 1e-5, errs


@pytest.mark.parametrize("isotropic", [False, True], ids=["diagonal", "isotropic"])
@pytest.mark.parametrize("name,value", EXTREMES[:3], ids=[f"{n}={v:g}" for n, v in EXTREMES[:3]])
def test_fp32_gains_and_steps_match_float64_at_extreme_noise(isotropic: bool, name: str, value: float) -> None:
    x, mu = _extreme(isotropic, name, value)
    S0, p0 = make_state(B, H, K, K, isotropic=isotropic)
    gain = kdn.isotropic_kdn_gain if isotropic else kdn.diagonal_kdn_gain
    step = kdn.isotropic_kdn_step if isotropic else kdn.diagonal_kdn_step
    res = {}
    for dt in (torch.float64, torch.float32):
        xs = {n: t.to(dt) for n, t in x.items()}
        kappa, pT = gain(*(xs[n] for n in ("k", "g", "omega", "r")), mu=mu, initial_state=p0.to(dt),
                         output_final_state=True)
        o, (S, p) = step(*(xs[n][:, 0] for n in NAMES), (S0.to(dt), p0.to(dt)), mu=mu)
        res[dt] = (kappa, pT, o, S, p)
    for a, b in zip(res[torch.float32], res[torch.float64]):
        assert bool(a.isfinite().all()) and rel_err(a, b) < 1e-5, rel_err(a, b)


@pytest.mark.parametrize("dims", ["B", "H", "K", "V"])
def test_zero_sized_dimensions_are_refused(dims: str) -> None:
    sizes = {"B": 2, "T": 5, "H": 2, "K": 4, "V": 3} | {dims: 0}
    x = make_inputs(sizes["B"], sizes["T"], sizes["H"], sizes["K"], sizes["V"], isotropic=False)
    with pytest.raises(ValueError, match=f"{dims}=0"):
        kdn.diagonal_kdn(**x)
    xi = make_inputs(sizes["B"], sizes["T"], sizes["H"], sizes["K"], sizes["V"], isotropic=True)
    with pytest.raises(ValueError, match=f"{dims}=0"):
        kdn.isotropic_kdn(**xi)
    S0, p0 = make_state(sizes["B"], sizes["H"], sizes["K"], sizes["V"], isotropic=False)
    with pytest.raises(ValueError, match=f"{dims}=0"):
        kdn.diagonal_kdn_step(*(x[n][:, 0] for n in NAMES), (S0, p0))
    if dims != "V":
        with pytest.raises(ValueError, match="every size must be at least 1"):
            kdn.diagonal_kdn_gain(*(x[n] for n in ("k", "g", "omega", "r")))


def test_float64_among_fp32_is_refused_and_low_precision_mixes_compute_in_fp32() -> None:
    x = make_inputs(1, 10, 2, 4, 4, isotropic=False, dtype=torch.float32)
    for name in ("q", "g", "r"):
        mixed = x | {name: x[name].double()}
        with pytest.raises(ValueError, match=f"{name} is float64 but .* is torch.float32: pass every tensor in"):
            kdn.diagonal_kdn(**mixed)
    with pytest.raises(ValueError, match="q is float64 but"):
        kdn.diagonal_kdn_step(*(x[n][:, 0].double() if n == "q" else x[n][:, 0] for n in NAMES),
                              make_state(1, 2, 4, 4, isotropic=False, dtype=torch.float32))
    with pytest.raises(ValueError, match="k is float64 but"):
        kdn.diagonal_kdn_gain(x["k"].double(), x["g"], x["omega"], x["r"])
    half = x | {n: x[n].bfloat16() for n in ("q", "k", "v")}  # the layers' mix: bf16 activations, FP32 gates
    o, _ = kdn.diagonal_kdn(**half)
    ref, _ = kdn.diagonal_kdn(**{n: t.float() for n, t in half.items()})
    assert o.dtype == torch.bfloat16
    torch.testing.assert_close(o, ref.bfloat16(), rtol=0, atol=0)
