"""Bad input raises a ValueError that names the argument."""
from __future__ import annotations

import math

import pytest
import torch
from kdn_inputs import make_inputs

import kdn


def _set(x: dict, name: str, value: torch.Tensor) -> dict:
    return {**x, name: value}


@pytest.mark.parametrize("isotropic", [False, True])
@pytest.mark.parametrize(
    "name,mutate,match",
    [
        ("k", lambda t: t[:, :, :, :-1], "k has shape"),
        ("v", lambda t: t[:, :-1], "v has shape"),
        ("g", lambda t: t[..., :1], "g has shape"),
        ("r", lambda t: t[..., None], "r has shape"),
        ("omega", lambda t: t[:, 1:], "omega has shape"),
        ("q", lambda t: t.clone().index_fill_(1, torch.tensor([3]), math.nan), "q contains NaN"),
        ("v", lambda t: t.clone().index_fill_(1, torch.tensor([2]), math.inf), "v contains NaN or Inf"),
        ("g", lambda t: t.clone().index_fill_(1, torch.tensor([1]), 0.5), "g .*must be <= 0"),
        ("r", lambda t: t.clone().index_fill_(1, torch.tensor([0]), 0.0), "r must be > 0"),
        ("omega", lambda t: t.clone().index_fill_(1, torch.tensor([4]), -0.1), "omega must be >= 0"),
    ],
)
def test_bad_inputs_name_the_argument(isotropic: bool, name: str, mutate, match: str) -> None:  # noqa: ANN001
    x = make_inputs(2, 8, 2, 4, 3, isotropic=isotropic)
    fn = kdn.isotropic_kdn if isotropic else kdn.diagonal_kdn
    fn(**x)  # the unmodified input is accepted
    with pytest.raises(ValueError, match=match):
        fn(**_set(x, name, mutate(x[name])))


@pytest.mark.parametrize("mu", [0.0, -1.0, torch.tensor([1.0, -2.0], dtype=torch.float64)])
def test_nonpositive_mu(mu: float | torch.Tensor) -> None:
    x = make_inputs(1, 4, 2, 4, 3)
    with pytest.raises(ValueError, match="mu must be > 0"):
        kdn.diagonal_kdn(**x, mu=mu)


def test_bad_state_and_packing() -> None:
    x = make_inputs(1, 10, 2, 4, 3)
    with pytest.raises(ValueError, match=r"initial_state\[0\] \(S\) has shape"):
        kdn.diagonal_kdn(**x, initial_state=(torch.ones(1, 2, 4, 4), torch.ones(1, 2, 4)))
    with pytest.raises(ValueError, match=r"initial_state\[1\] \(p\) has shape"):
        kdn.diagonal_kdn(**x, initial_state=(torch.ones(1, 2, 4, 3), torch.ones(1, 2)))
    with pytest.raises(ValueError, match="must be > 0"):
        kdn.diagonal_kdn(**x, initial_state=(torch.ones(1, 2, 4, 3), -torch.ones(1, 2, 4)))
    with pytest.raises(ValueError, match="end at T=10"):
        kdn.diagonal_kdn(**x, cu_seqlens=torch.tensor([0, 4, 9]))
    with pytest.raises(ValueError, match="unknown backend"):
        kdn.diagonal_kdn(**x, backend="cuda")
    with pytest.raises(ValueError, match="triton"):
        kdn.diagonal_kdn(**x, backend="triton")  # CPU tensors


def test_validate_false_skips_only_the_value_checks() -> None:
    x = make_inputs(1, 6, 2, 4, 3)
    bad = {**x, "g": x["g"].abs() + 0.1}
    kdn.diagonal_kdn(**bad, validate=False)  # out of range, but the caller vouched for its inputs
    with pytest.raises(ValueError, match="k has shape"):
        kdn.diagonal_kdn(**{**x, "k": x["k"][..., :2]}, validate=False)


def test_step_validates_unless_told_not_to() -> None:
    x = make_inputs(2, 1, 2, 4, 3)
    one = {n: t[:, 0] for n, t in x.items()}
    state = (torch.zeros(2, 2, 4, 3, dtype=torch.float64), torch.ones(2, 2, 4, dtype=torch.float64))
    bad = {**one, "r": -one["r"]}
    with pytest.raises(ValueError, match="r must be > 0"):
        kdn.diagonal_kdn_step(**bad, state=state)
    kdn.diagonal_kdn_step(**bad, state=state, validate=False)
    with pytest.raises(ValueError, match="g has shape"):
        kdn.diagonal_kdn_step(**{**one, "g": one["g"][..., :2]}, state=state, validate=False)


@pytest.mark.parametrize("isotropic", [False, True], ids=["diag", "iso"])
def test_scale_and_zero_memory_state(isotropic: bool) -> None:
    """``scale`` equals scaling ``q``; ``initial_state=(None, u)`` equals a zero memory; bad scales are refused."""
    x = make_inputs(2, 70, 3, 8, 5, isotropic=isotropic, seed=4)
    fn = kdn.isotropic_kdn if isotropic else kdn.diagonal_kdn
    u0 = torch.rand(*((2, 3) if isotropic else (2, 3, 8)), dtype=torch.float64) + 0.2
    S0 = torch.zeros(2, 3, 8, 5, dtype=torch.float64)
    o1, (S1, p1) = fn(**x, scale=0.3, initial_state=(None, u0), output_final_state=True)
    o2, (S2, p2) = fn(**{**x, "q": x["q"] * 0.3}, initial_state=(S0, u0), output_final_state=True)
    torch.testing.assert_close(o1, o2)
    torch.testing.assert_close(S1, S2)
    torch.testing.assert_close(p1, p2)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="scale"):
            fn(**x, scale=bad)


def test_dplr_memory_refuses_chunk_64() -> None:
    """fla's DPLR kernels at chunk 64 miss the gradient tolerance under strong forgetting: refused before any kernel,
    by the functional API on any backend and by the CUDA entry point."""
    x = make_inputs(1, 8, 2, 4, 4, isotropic=False, seed=0)
    with pytest.raises(ValueError, match="memory='dplr' takes chunk_size 16 or 32, got 64"):
        kdn.diagonal_kdn(**x, memory="dplr", chunk_size=64)
    pytest.importorskip("triton")
    from kdn.ops.chunk import chunk_diagonal_kdn

    state = (None, torch.ones(1, 2, 4))
    with pytest.raises(ValueError, match="memory='dplr' takes chunk_size 16 or 32, got 64"):
        chunk_diagonal_kdn(x["q"], x["k"], x["v"], x["g"], x["omega"], x["r"], torch.ones(2), state, memory="dplr",
                           chunk_size=64)


def test_memory_settings_are_checked() -> None:
    """The memory route and its settings are arguments, each checked with a one-line error naming the fix."""
    x = make_inputs(1, 8, 2, 4, 4, isotropic=False, seed=0)
    with pytest.raises(ValueError, match=r"memory must be one of \('asym', 'dplr'\), got 'bogus'"):
        kdn.diagonal_kdn(**x, memory="bogus")
    with pytest.raises(ValueError, match="memory='asym' runs chunks of 64 tokens"):
        kdn.diagonal_kdn(**x, chunk_size=32)
    with pytest.raises(ValueError, match="recompute_states must be True or False"):
        kdn.diagonal_kdn(**x, recompute_states="yes")
    ref, _ = kdn.diagonal_kdn(**x)
    for kw in ({"memory": "dplr"}, {"memory": "dplr", "chunk_size": 32}, {"recompute_states": True}):
        o, _ = kdn.diagonal_kdn(**x, **kw)  # CUDA routes: on the CPU the same PyTorch result
        torch.testing.assert_close(o, ref, rtol=0, atol=0)
    iso = make_inputs(1, 8, 2, 4, 4, isotropic=True, seed=0)
    with pytest.raises(ValueError, match="recompute_states must be True or False"):
        kdn.isotropic_kdn(**iso, recompute_states=1)
    with pytest.raises(ValueError, match="memory must be one of"):
        kdn.DiagonalKDN(32, 2, 8, memory="bogus")
    with pytest.raises(ValueError, match=r"IsotropicKDN does not take \['memory'\]; its options are the fields of "
                                         "IsotropicKDNConfig"):  # it runs the asymmetric memory only
        kdn.IsotropicKDN(32, 2, 8, memory="dplr")
    with pytest.raises(ValueError, match="fused must be True or False"):
        kdn.DiagonalKDN(32, 2, 8, fused=None)


def test_gate_inputs() -> None:
    """``gate=(A_log, dt_bias)``: ``g`` is the gate's input (positive values allowed), the result equals passing the
    gate's output; a wrong-shaped parameter or a non-pair is refused by name, and the triton pass checks its own."""
    from kdn.modules import kda_gate
    from kdn.ops.triton.gate import kda_gate_fwd

    x = make_inputs(2, 8, 2, 4, 3, isotropic=False)
    f = torch.randn(x["g"].shape, dtype=x["g"].dtype, generator=torch.Generator().manual_seed(1))
    A_log, dt_bias = torch.randn(2, dtype=f.dtype), torch.randn(8, dtype=f.dtype)
    o, _ = kdn.diagonal_kdn(**_set(x, "g", f), gate=(A_log, dt_bias))
    ref, _ = kdn.diagonal_kdn(**_set(x, "g", kda_gate(f, A_log, dt_bias)))
    torch.testing.assert_close(o, ref, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"gate\[0\] \(A_log\) has shape"):
        kdn.diagonal_kdn(**_set(x, "g", f), gate=(A_log[:1], dt_bias))
    with pytest.raises(ValueError, match=r"gate\[1\] \(dt_bias\) has shape"):
        kdn.diagonal_kdn(**_set(x, "g", f), gate=(A_log, dt_bias[:4]))
    with pytest.raises(ValueError, match="gate must be a pair"):
        kdn.diagonal_kdn(**_set(x, "g", f), gate=(A_log,))
    with pytest.raises(ValueError, match="A_log must be"):
        kda_gate_fwd(f, A_log[:1], dt_bias)
