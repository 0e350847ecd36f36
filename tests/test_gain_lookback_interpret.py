"""The one-launch Diagonal gain (:mod:`kdn.ops.triton.gain_lookback`) on the CPU, through Triton's interpreter.

Against the float64 PyTorch reference (``kdn.ops.torch_gain``), FP32: the gain, the final uncertainty and the gradient
of every input (``mu`` and ``p0`` included) over several groups of segments (the carries cross groups), ``K`` not a
power of two, strong forgetting, omega before its softplus, fla's DPLR operands, packed sequences (an empty one, a
one-token one, one shorter than a segment) and a bf16 gain; bitwise the same on a second run; against the
three-launch gain, the same values to FP32 rounding. Diagonal KDN's gain and asymmetric memory as one node with the
one-launch gain: :func:`test_kdn_triton_interpret.fused_errors`, packed, with KDA's gate. The interpreter
runs the programs one after another, so it checks the arithmetic and the order of the carries, not the waiting:
that runs in the GPU suite (tests/test_kdn_triton.py).
"""
from __future__ import annotations

import pytest

pytest.importorskip("triton")
triton_interpret = pytest.importorskip("triton_interpret")  # tests/triton_interpret.py

GAINS = r"""
import itertools, json, sys, torch
sys.path.insert(0, "tests")
from kdn.ops import triton as kt
from kdn_inputs import make_inputs, make_state, packed_diagonal_gain, rel_err

NAMES = ("k", "g", "omega", "r", "mu", "p0")


def leaves(B, T, H, K, N, softplus, seed):
    x = make_inputs(B, T, H, K, K, isotropic=False, seed=seed, g_min=-3.0)
    x["g"][:, T // 2:T // 2 + 4] *= 4.0  # strong forgetting: g down to -12
    if softplus:  # omega's input: both signs, some far below 0
        x["omega"] = torch.randn(x["omega"].shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 3
        x["omega"][:, :5] -= 20.0
    x["mu"] = torch.linspace(1.0, float(K), H, dtype=torch.float64)
    x["p0"] = make_state(N, H, K, K, isotropic=False)[1]
    return {n: x[n].clone().requires_grad_() for n in NAMES}


def reference(l64, softplus, dplr, lens):
    # float64 outputs; packed sequences one at a time
    k, g, omega, r, mu, p0 = (l64[n] for n in NAMES)
    kappa, pT = packed_diagonal_gain(k, g, torch.nn.functional.softplus(omega) if softplus else omega, r, mu, p0,
                                     lens)
    return (kappa, g.exp() * k, -kappa, pT) if dplr else (kappa, pT)


def run(l, dtype, dplr, lens, **kw):
    fn = kt.diagonal_gain_dplr if dplr else kt.diagonal_gain
    cu = None if lens is None else torch.tensor([0, *itertools.accumulate(lens)])
    return fn(*(l[n] for n in NAMES), dtype, cu_seqlens=cu, **kw)


def grads(outs, l):
    gen = torch.Generator().manual_seed(0)
    sum((o.double() * torch.randn(o.shape, generator=gen, dtype=torch.float64)).sum() for o in outs).backward()
    return {"d" + n: t.grad.clone() for n, t in l.items()}


def case(B, T, H, K, seg, dtype=torch.float32, dplr=False, softplus=False, lens=None, three=False, seed=1):
    # the one-launch gain twice (bitwise), and with `three` the three-launch gain (its token loops are slow here)
    l64 = leaves(B, T, H, K, B if lens is None else len(lens), softplus, seed)
    l64["k"] = l64["k"].detach().to(dtype).double().requires_grad_()
    runs = []
    for one_pass in (True, True, False)[:3 if three else 2]:
        l32 = {n: t.detach().to(dtype if n == "k" else torch.float32).requires_grad_() for n, t in l64.items()}
        outs = run(l32, dtype, dplr, lens, omega_softplus=softplus, segment_size=seg if one_pass else None,
                   one_pass=one_pass)
        runs.append({f"out{i}": o.detach() for i, o in enumerate(outs)} | grads(outs, l32))
    o64 = reference(l64, softplus, dplr, lens)
    ref_all = {f"out{i}": o.detach() for i, o in enumerate(o64)} | grads(o64, l64)
    first = runs[0]
    return {
        "ref": {name: rel_err(first[name], ref_all[name]) for name in first},
        "three_launch": {name: rel_err(first[name], runs[2][name]) for name in first} if three else None,
        "bitwise": all(torch.equal(first[name], runs[1][name]) for name in first),
    }


cases = {  # name: (tolerance against float64, arguments of case)
    "groups_seg16": (1e-5, (1, 300, 2, 12, 16)),  # 19 segments a sequence: three groups, the last segment partial
    "dplr_softplus_seg32": (1e-5, (1, 77, 2, 12, 32), {"dplr": True, "softplus": True, "three": True}),
    "seg64": (1e-5, (2, 150, 1, 20, 64)),
    "packed_seg16": (1e-5, (1, 188, 2, 12, 16), {"lens": (40, 0, 1, 130, 17)}),
    "bf16_seg32": (1e-2, (1, 96, 2, 12, 32), {"dtype": torch.bfloat16}),
}
out = {}
for name, (tol, args, *kw) in cases.items():
    out[name] = [tol, case(*args, **(kw[0] if kw else {}))]
print(json.dumps(out))
"""

FUSED = r"""
import json, sys
sys.path.insert(0, "tests")
import triton_interpret
triton_interpret.enable("fla.ops.kda", "fla.ops.precond_kda.chunk")
from test_kdn_triton_interpret import fused_errors
cases = {  # name: (lengths of packed sequences or None, B, T, g_min, omega before its softplus, KDA's gate, segment)
    "packed": ((20, 64, 5), 1, 89, -12.0, True, True, 32),
}
out = {name: fused_errors(*c[:5], H=2, K=16, gate=c[5], segment_size=c[6], one_pass=True) for name, c in cases.items()}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict]:
    """One interpreted run of the gain cases (``GAINS``) and of the fused node (``FUSED``, which patches fla)."""
    return triton_interpret.run_interpreted_many({"gains": (GAINS,), "fused": (FUSED,)}, timeout=600)


def test_one_launch_gain_matches_reference_and_three_launch_gain(interpreted: dict[str, dict]) -> None:
    report = triton_interpret.result(interpreted, "gains")
    assert len(report) == 5
    for name, (tol, r) in report.items():
        assert len(r["ref"]) >= 8 and max(r["ref"].values()) < tol, (name, r["ref"])
        assert r["bitwise"], name
    # the same arithmetic in another order: FP32 rounding apart
    three = report["dplr_softplus_seg32"][1]["three_launch"]
    assert len(three) == 10 and max(three.values()) < 2e-6, three


def test_fused_node_with_one_launch_gain(interpreted: dict[str, dict]) -> None:
    """As :func:`test_kdn_triton_interpret.test_fused_gain_and_memory_in_interpreter`, with the one-launch gain, packed
    sequences, omega before its softplus and KDA's gate: its backward adds the memory's gradients of ``k`` and ``g``
    (``dg``'s within the memory's chunks of 64 tokens, which segments of 32 divide: the chunk's later half is summed
    after the segment) and takes them through the gate."""
    pytest.importorskip("fla")
    report = triton_interpret.result(interpreted, "fused")
    assert report.keys() == {"packed"}
    for case, r in report.items():
        gated = {"dA_log", "ddt_bias"}
        tol = {"dA_log": 5e-4}  # a sum of terms of both signs (test_kdn_triton_interpret)
        assert len(r["ref"]) == 12 + len(gated), (case, r["ref"])
        assert all(e < tol.get(n, 5e-5) for n, e in r["ref"].items()), (case, r["ref"])
        assert all(e < (tol.get(n, 1e-4) if gated else 1e-6) for n, e in r["unfused"].items()), (case, r["unfused"])
        dropped = {n: e for n, e in r["dropped"].items() if e > 1e-4}
        assert dropped.keys() == {"dk", "dg"} | gated and min(dropped.values()) > 1e-3, (case, r["dropped"])


def test_one_launch_gain_refuses_bad_settings_in_one_line() -> None:
    """Segments the tiles cannot hold, a flag that is not a bool, and the setting on the Isotropic layer, whose gain
    has no one-launch route."""
    import kdn
    from kdn.ops.triton.gain_lookback import lookback_segments

    assert lookback_segments(100, None) == (16, 7) and lookback_segments(100, 64) == (64, 2)
    for seg in (24, 128, 0):
        with pytest.raises(ValueError, match="segment_size 16, 32 or 64") as err:
            lookback_segments(100, seg)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="one_pass_gain must be True or False"):
        kdn.DiagonalKDN(64, 2, 32, one_pass_gain="yes")
    with pytest.raises(ValueError, match="drop it for IsotropicKDN"):
        kdn.IsotropicKDN(64, 2, 32, one_pass_gain=True)
    assert kdn.DiagonalKDN(64, 2, 32, one_pass_gain=True).one_pass_gain is True
