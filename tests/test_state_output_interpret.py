"""``kdn.ops.triton.state_output.chunk_state_output`` (the memory's chunk states and output in one launch) on the CPU
through Triton's interpreter (``tests/triton_interpret.py``).

Against fla's two launches (``chunk_gated_delta_rule_fwd_h`` + ``chunk_gla_fwd_o_gk``) on the same FP32 inputs:
``o``, the kept states ``h`` and values ``v_new``, and the final state, to 1e-5 (relative), with T not a multiple of
the chunk, ``K`` not a power of two, several value blocks, an initial state, and packed sequences (one of a single
token, one of exactly a chunk); the launch that keeps no states gives the same output, and so does one that reads
``qg`` instead of ``q`` and ``gc``. ``chunk_wy_state_output`` (the WY terms too) against fla's three launches
(``recompute_w_u_fwd`` first) on the same inputs, with two value blocks: ``o``, ``h``, ``v_new``, the final state and
the kept ``w``, ``qg``, ``kg``. Then the asymmetric memory (its autograd node, a write key apart from the read key) with
each of our launches, against the float64 token recurrence (``kdn.ops.naive.memory_step``): output, final state and the
gradient of every input; and its forward without gradients, which keeps nothing, gives the same output.
"""
from __future__ import annotations

import pytest

pytest.importorskip("triton")
pytest.importorskip("fla")
triton_interpret = pytest.importorskip("triton_interpret")  # tests/triton_interpret.py

SCRIPT = r"""
import json, os, sys, torch, triton
import torch.nn.functional as F
sys.path.insert(0, "tests")
import triton_interpret
triton_interpret.enable("fla.ops.common.chunk_delta_h", "fla.ops.gla.chunk", "fla.ops.utils", "fla.ops.kda",
                        "fla.ops.precond_kda.chunk", "fla.ops.precond_kda.wy_fast")
from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
from fla.ops.gla.chunk import chunk_gla_fwd_o_gk
from fla.ops.precond_kda.wy_fast import recompute_w_u_fwd
from fla.ops.utils import chunk_local_cumsum, prepare_chunk_indices
from fla.ops.utils.constant import RCP_LN2
from kdn.ops import naive
from kdn.ops.triton import state_output as so
from kdn_inputs import make_inputs, rel_err

BT = 64
CONFIGS = list(so._state_output_kernel.configs)


def use(**kw):  # the interpreter keeps the autotuner's first config
    so._state_output_kernel.configs = sorted(CONFIGS, key=lambda c: any(c.kwargs[n] != v for n, v in kw.items()))


def inputs(B, T, H, K, V, cu, N, seed):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)
    # keys and WY terms of norm about 0.3: the state stays of order one over the chunks (larger ones make the
    # recurrence grow without bound, and any rounding difference with it)
    x = {"q": rnd(B, T, H, K), "kg": rnd(B, T, H, K) * 0.3 / K ** 0.5, "w": rnd(B, T, H, K) * 0.3 / K ** 0.5,
         "u": rnd(B, T, H, V)}
    x["Aqk"] = rnd(B, T, H, BT) * 0.3  # the kernels read its lower triangle
    x["gc"] = chunk_local_cumsum(-F.softplus(rnd(B, T, H, K)) * 0.3, chunk_size=BT, scale=RCP_LN2, cu_seqlens=cu)
    x["h0"] = rnd(N, H, K, V) * 0.5
    return x


out = {}
cases = {  # B, T, H, K, V, cu_seqlens, initial state, BV
    "T77_K32_V32_h0": (2, 77, 2, 32, 32, None, True, 32),
    "T130_K96_V64": (1, 130, 1, 96, 64, None, False, 32),
    "T70_K128_V64_h0": (1, 70, 1, 128, 64, None, True, 64),
    "varlen_K32_V64_h0": (1, 130, 2, 32, 64, torch.tensor([0, 1, 65, 130]), True, 64),
}
for name, (B, T, H, K, V, cu, use_h0, bv) in cases.items():
    use(BV=bv)
    N = B if cu is None else len(cu) - 1
    x = inputs(B, T, H, K, V, cu, N, seed=T + K + V)
    h0 = x["h0"] if use_h0 else None
    h, v_new, S = chunk_gated_delta_rule_fwd_h(k=x["kg"], w=x["w"], u=x["u"], gk=x["gc"], initial_state=h0,
                                               output_final_state=True, chunk_size=BT, cu_seqlens=cu)
    o = chunk_gla_fwd_o_gk(q=x["q"], v=v_new, g=x["gc"], A=x["Aqk"], h=h, scale=0.37, cu_seqlens=cu, chunk_size=BT)
    args = (x["q"], x["kg"], x["w"], x["u"], x["gc"], x["Aqk"], 0.37, h0, True)
    o2, h2, v2, S2 = so.chunk_state_output(*args, cu_seqlens=cu)
    assert so._state_output_kernel.best_config.kwargs["BV"] == bv
    assert (o2.shape, h2.shape, v2.shape, S2.shape) == (o.shape, h.shape, v_new.shape, S.shape)
    o3, h3, v3, S3 = so.chunk_state_output(*args, save_states=False, cu_seqlens=cu)
    o4 = so.chunk_state_output(*args, qg=(x["q"] * torch.exp2(x["gc"])), cu_seqlens=cu)[0]
    out[name] = {"o": rel_err(o2, o), "h": rel_err(h2, h), "v_new": rel_err(v2, v_new), "S": rel_err(S2, S),
                 "o_unsaved": rel_err(o3, o), "S_unsaved": rel_err(S3, S), "o_qg": rel_err(o4, o),
                 "unsaved_none": h3 is None and v3 is None}

# the WY terms, states and output in one launch against fla's three launches
wy_cases = {  # B, T, H, K, V, cu_seqlens, initial state, BV: two value blocks (the first keeps the WY terms) or one
    "wy_T77_K32_V64_h0": (2, 77, 2, 32, 64, None, True, 32),
    "wy_T130_K96_V64": (1, 130, 1, 96, 64, None, False, 64),  # one value block: it keeps the WY terms
    "wy_varlen_K32_V64_h0": (1, 130, 2, 32, 64, torch.tensor([0, 1, 65, 130]), True, 32),
}
for name, (B, T, H, K, V, cu, use_h0, bv) in wy_cases.items():
    use(BV=bv)
    N = B if cu is None else len(cu) - 1
    x = inputs(B, T, H, K, V, cu, N, seed=T + K + V + 1)
    gen = torch.Generator().manual_seed(T + K)
    rnd = lambda *s: torch.randn(*s, generator=gen)
    k, kappa = rnd(B, T, H, K) * 0.3 / K ** 0.5, rnd(B, T, H, K) * 0.3 / K ** 0.5
    v, beta = rnd(B, T, H, V), torch.rand(B, T, H, generator=gen) * 0.8 + 0.1
    t = torch.arange(T)
    starts = torch.zeros(T, dtype=torch.long) if cu is None else cu[torch.searchsorted(cu, t, right=True) - 1]
    row = ((t - starts) % BT)[:, None, None]  # each token's row in its chunk
    col = torch.arange(BT)
    Akk = torch.where(col < row, rnd(B, T, H, BT) * 0.1, (col == row).float())  # the inverse: unit lower triangle
    h0 = x["h0"] if use_h0 else None
    ci = None if cu is None else prepare_chunk_indices(cu, BT)
    w, u, qg, kg = recompute_w_u_fwd(k=k, k_precond=kappa, v=v, beta=beta, A=Akk, gk=x["gc"], q=x["q"],
                                     output_qg=True, output_kg=True, cu_seqlens=cu, chunk_indices=ci)
    h, v_new, S = chunk_gated_delta_rule_fwd_h(k=kg, w=w, u=u, gk=x["gc"], initial_state=h0,
                                               output_final_state=True, chunk_size=BT, cu_seqlens=cu)
    o = chunk_gla_fwd_o_gk(q=x["q"], v=v_new, g=x["gc"], A=x["Aqk"], h=h, scale=0.37, cu_seqlens=cu, chunk_size=BT)
    args = (x["q"], k, kappa, v, beta, x["gc"], Akk, x["Aqk"], 0.37, h0, True)
    got = so.chunk_wy_state_output(*args, cu_seqlens=cu, chunk_indices=ci)
    lean = so.chunk_wy_state_output(*args, save_states=False, cu_seqlens=cu)
    out[name] = {n: rel_err(a, b) for n, a, b in zip(("o", "h", "v_new", "S", "w", "qg", "kg"), got,
                                                      (o, h, v_new, S, w, qg, kg))}
    out[name] |= {"o_unsaved": rel_err(lean[0], o), "S_unsaved": rel_err(lean[3], S),
                  "unsaved_none": all(t is None for t in lean[1:3] + lean[4:])}

# the asymmetric memory (a write key apart from the read key) through each of our launches against the float64
# recurrence, forward and every gradient
use(BV=32)
B, T, H, K, V = 1, 70, 2, 32, 64
x = make_inputs(B, T, H, K, V, seed=5)
beta = torch.rand(B, T, H, generator=torch.Generator().manual_seed(6), dtype=torch.float64) * 0.8 + 0.1
S0 = torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
kappa = F.normalize(torch.randn(B, T, H, K, generator=torch.Generator().manual_seed(9), dtype=torch.float64), dim=-1)
l64 = {"q": x["q"], "k": x["k"], "kappa": kappa, "v": x["v"], "g": x["g"], "beta": beta, "S0": S0}
l64 = {n: t.clone().requires_grad_() for n, t in l64.items()}
l32 = {n: t.detach().float().requires_grad_() for n, t in l64.items()}
S, os_ = l64["S0"], []
for t in range(T):
    o_t, S = naive.memory_step(l64["q"][:, t] * 0.41, l64["k"][:, t], l64["beta"][:, t, :, None] * l64["kappa"][:, t],
                               l64["v"][:, t], l64["g"][:, t], S)
    os_.append(o_t)
o64 = torch.stack(os_, 1)
gen = torch.Generator().manual_seed(8)
do = torch.randn(o64.shape, generator=gen, dtype=torch.float64)
dS = torch.randn(S.shape, generator=gen, dtype=torch.float64)
g64 = torch.autograd.grad((o64 * do).sum() + (S * dS).sum(), list(l64.values()))
import kdn.ops.triton.memory as memory
from kdn.ops.triton.safe_gate import safe_gate


def asym(l):  # the memory's autograd node, as the KDNs call it (a forward without gradients keeps no states)
    return memory._AsymmetricMemory.apply(*(l[n] for n in ("q", "k", "kappa", "v", "g", "beta", "S0")), 0.41, True,
                                          None, safe_gate(l["g"]), not torch.is_grad_enabled(), False)


kept = []
for kernel, fn in (("fused", "chunk_state_output"), ("wy", "chunk_wy_state_output")):
    os.environ["KDN_STATE_KERNEL"] = kernel
    o32, S32 = asym(l32)
    g32 = torch.autograd.grad((o32 * do.float()).sum() + (S32 * dS.float()).sum(), list(l32.values()))
    launch = getattr(memory, fn)
    setattr(memory, fn, lambda *a, launch=launch, **kw: kept.append((kernel, kw["save_states"])) or launch(*a, **kw))
    asym(l32)
    with torch.no_grad():
        o_ng = asym(l32)[0]
    setattr(memory, fn, launch)
    out[f"memory_{kernel}"] = {"o": rel_err(o32, o64), "S": rel_err(S32, S), "o_no_grad": rel_err(o_ng, o64)}
    out[f"memory_{kernel}"] |= {f"d{n}": rel_err(a, b) for n, a, b in zip(l64, g32, g64)}
out["states_kept"] = kept  # each launch with gradients, then without
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def errors() -> dict:
    return triton_interpret.run_interpreted(SCRIPT)


def _launch_cases(errors: dict, prefix: str) -> dict:
    return {n: e for n, e in errors.items() if n.startswith(prefix)}


def test_fused_state_and_output_match_flas_two_launches(errors: dict) -> None:
    cases = _launch_cases(errors, "T") | _launch_cases(errors, "varlen")
    assert set(cases) == {"T77_K32_V32_h0", "T130_K96_V64", "T70_K128_V64_h0", "varlen_K32_V64_h0"}
    for case, e in cases.items():
        assert e.pop("unsaved_none") is True, case  # the launch without the backward keeps neither h nor v_new
        assert max(e.values()) <= 1e-5, (case, e)


def test_wy_state_and_output_match_flas_three_launches(errors: dict) -> None:
    cases = _launch_cases(errors, "wy_")
    assert set(cases) == {"wy_T77_K32_V64_h0", "wy_T130_K96_V64", "wy_varlen_K32_V64_h0"}
    for case, e in cases.items():
        assert e.pop("unsaved_none") is True, case  # nothing kept: no h, v_new, w, qg or kg
        assert set(e) == {"o", "h", "v_new", "S", "w", "qg", "kg", "o_unsaved", "S_unsaved"}, case
        assert max(e.values()) <= 1e-5, (case, e)


@pytest.mark.parametrize("kernel", ["fused", "wy"])
def test_memory_through_our_launch_matches_float64(errors: dict, kernel: str) -> None:
    e = errors[f"memory_{kernel}"]
    assert set(e) == {"o", "S", "o_no_grad", "dq", "dk", "dkappa", "dv", "dg", "dbeta", "dS0"}
    assert max(e.values()) <= 1e-4, e


def test_a_forward_without_gradients_keeps_no_states(errors: dict) -> None:
    # our launches write h, v_new (and the WY terms) only for a backward
    assert errors["states_kept"] == [["fused", True], ["fused", False], ["wy", True], ["wy", False]]


@pytest.mark.parametrize("capability,want", [((9, 0), "fused"), ((10, 0), "fused"), ((8, 9), "fla")])
def test_auto_takes_the_fused_launch_from_sm90_on(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int],
                                                  want: str) -> None:
    import torch

    from kdn.ops.triton.state_output import state_output_kernel

    monkeypatch.delenv("KDN_STATE_KERNEL", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert state_output_kernel(None, torch.device("cuda")) == want
    assert state_output_kernel(None, torch.device("cpu")) == "fla"
    assert state_output_kernel("fla", torch.device("cuda")) == "fla"
    monkeypatch.setenv("KDN_STATE_KERNEL", "fla")
    assert state_output_kernel(None, torch.device("cuda")) == "fla"
    monkeypatch.setenv("KDN_STATE_KERNEL", "fast")
    with pytest.raises(ValueError, match="set KDN_STATE_KERNEL to one of them"):
        state_output_kernel(None, torch.device("cuda"))
