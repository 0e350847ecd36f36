"""The Triton kernels (fused gains forward and backward, fused recurrent decoding) on the CPU, through Triton's
interpreter.

``TRITON_INTERPRET=1`` must be set before ``kdn.ops.triton`` is imported, so the checks run in a fresh
interpreter. Gains are compared in FP32 with the float64 PyTorch reference (``kdn.ops.torch_gain``): value, final
uncertainty and the gradient of every input (``mu`` and the initial uncertainty included). Sizes cross the
Isotropic kernels' chunk boundaries (32 tokens), ``K`` is not a power of two, some tokens
forget strongly (``g`` down to -12). Small forced segments (the kernels' ``segment_size``) run the sequence-
parallel path: 4 Diagonal segments of 8 tokens and 3 Isotropic ones of a chunk, the last partial; by the
default rule the Diagonal cases have segments of 64 tokens (2 here, the second of 2 tokens), the Isotropic ones a
single segment. The Diagonal kernels walk the tokens one by one, which the interpreter runs slowly: their sequences
are short, and long only where the default rule needs them to be.
Diagonal KDN's gain and asymmetric memory as one autograd node (``chunk_diagonal_kdn``), padded and packed,
against the float64 reference and the unfused composition: :func:`fused_errors`.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch
from kdn_inputs import make_inputs, make_state, rel_err

pytest.importorskip("triton")
triton_interpret = pytest.importorskip("triton_interpret")  # tests/triton_interpret.py

SCRIPT = r"""
import json, sys, torch
sys.path.insert(0, "tests")
from kdn.ops import fused_recurrent, naive, torch_gain as ref, triton as kt
from kdn_inputs import make_inputs, make_state, rel_err


def gain_case(iso, B, T, H, K, dtype, dplr=False, seg=None, softplus=False):
    # float64 reference on the same (dtype-rounded) key; every input a leaf; seg: tokens per segment; softplus:
    # omega given before its softplus (real values of both signs, some far below 0), applied in the kernels
    ns = kt.gain_segments(iso, B * H, T, seg)[1]
    x = make_inputs(B, T, H, K, K, isotropic=iso, seed=T + K, g_min=-3.0)
    x["g"][:, T // 2:T // 2 + 4] *= 4.0  # strong forgetting: g down to -12
    x["k"] = x["k"].to(dtype).double()
    if softplus:
        x["omega"] = torch.randn(x["omega"].shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 3
        x["omega"][:, :5] -= 20.0
    u0 = make_state(B, H, K, K, isotropic=iso)[1]
    mu = torch.linspace(1.0, float(K), H, dtype=torch.float64)
    l64 = {n: x[n].clone().requires_grad_() for n in ("k", "g", "omega", "r")}
    l64 |= {"mu": mu.requires_grad_(), "u0": u0.requires_grad_()}
    l32 = {n: t.detach().float().requires_grad_() for n, t in l64.items()}
    l32["k"] = l64["k"].detach().to(dtype).requires_grad_()
    args64 = [l64[n] for n in ("k", "g", "omega", "r", "mu", "u0")]
    args32 = [l32[n] for n in ("k", "g", "omega", "r", "mu", "u0")]
    kw = {"omega_softplus": True} if softplus else {}
    kw["segment_size"] = seg
    if softplus:
        args64[2] = torch.nn.functional.softplus(args64[2])
    if iso:
        outs64 = ref.isotropic_gain(*args64)
        outs32 = kt.isotropic_gain(*args32, out_dtype=dtype, **kw)
    elif dplr:
        kappa, pT = ref.diagonal_gain(*args64)
        outs64 = (kappa, l64["g"].exp() * l64["k"], -kappa, pT)
        outs32 = kt.diagonal_gain_dplr(*args32, out_dtype=dtype, **kw)
    else:
        outs64 = ref.diagonal_gain(*args64)
        outs32 = kt.diagonal_gain(*args32, out_dtype=dtype, **kw)
    assert outs32[0].dtype == dtype and outs32[-1].dtype == torch.float32
    gen = torch.Generator().manual_seed(0)
    ups = [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in outs64]
    sum((o * u).sum() for o, u in zip(outs64, ups)).backward()
    sum((o.double() * u).sum() for o, u in zip(outs32, ups)).backward()
    names = ("gain", "a", "b", "final") if len(outs64) == 4 else ("gain", "final")
    errs = {n: rel_err(o32, o64) for n, o32, o64 in zip(names, outs32, outs64)}
    assert l32["k"].grad.dtype == dtype
    return ns, errs | {"d" + n: rel_err(l32[n].grad, l64[n].grad) for n in l64}


out, segments = {}, {}
# The Diagonal kernels loop over tokens in one program per sequence and head, which the interpreter runs one after
# another: one case has a batch of 2 (the batch stride), the others one sequence of 2 heads (each head's mu).
cases = {  # name: (tolerance, iso, B, T, H, K, dtype, dplr, tokens per segment[, omega before its softplus])
    "diag_seg8": (1e-5, False, 2, 29, 2, 12, torch.float32, False, 8),
    "diag_default_seg": (1e-5, False, 1, 66, 2, 12, torch.float32, False, None),
    "diag_dplr_K72_seg8": (1e-5, False, 1, 29, 2, 72, torch.float32, True, 8),
    "diag_dplr_softplus_seg8": (1e-5, False, 1, 29, 2, 12, torch.float32, True, 8, True),
    "iso_seg32": (1e-5, True, 2, 77, 3, 12, torch.float32, False, 32),
    "iso_one_segment": (1e-5, True, 2, 77, 3, 12, torch.float32, False, None),
    "diag_bf16": (1e-2, False, 1, 20, 2, 12, torch.bfloat16, False, None),
    "iso_bf16": (1e-2, True, 1, 64, 2, 12, torch.bfloat16, False, None),
}
for name, (tol, *case) in cases.items():
    segments[name], errs = gain_case(*case)
    out[name] = (tol, errs)

# the fused recurrent (decoding) kernel: several tokens, K not a power of two, two value blocks
for iso in (False, True):
    B, T, H, K, V = 2, 5, 3, 12, 40
    x = make_inputs(B, T, H, K, V, isotropic=iso, seed=8)
    S0, u0 = make_state(B, H, K, V, isotropic=iso)
    mu = torch.tensor([0.5, 3.0, 12.0], dtype=torch.float64)
    rec = naive.isotropic_kdn_recurrent if iso else naive.diagonal_kdn_recurrent
    o64, (S64, e64) = rec(x["q"], x["k"], x["v"], x["g"], x["omega"], x["r"], mu, (S0, u0))
    x32 = [x[n].float() for n in ("q", "k", "v", "g", "omega", "r")]
    step = fused_recurrent.fused_recurrent_isotropic_kdn if iso else fused_recurrent.fused_recurrent_diagonal_kdn
    o32, (S32, e32) = step(*x32, mu.float(), (S0.float(), u0.float()))
    out[("iso" if iso else "diag") + "_recurrent"] = (1e-5, {"o": rel_err(o32, o64), "S": rel_err(S32, S64),
                                                             "final": rel_err(e32, e64)})
print(json.dumps({"errors": out, "segments": segments}))
"""


def fused_errors(lens: tuple[int, ...] | None, B: int, T: int, g_min: float, softplus: bool, H: int, K: int,
                 device: str = "cpu", dtype: torch.dtype = torch.float32,
                 gate: bool = False, segment_size: int | None = None,
                 iso: bool = False) -> dict[str, dict[str, float]]:
    """``chunk_diagonal_kdn`` (``memory="asym"``: the gain and the memory one autograd node), or with ``iso``
    ``chunk_isotropic_kdn`` (``omega`` after its softplus; the same key on both sides of the memory), ``q, k, v``
    in ``dtype``, ``mu`` and ``S0`` leaves, padded (``lens`` None) or packed; ``softplus``: ``omega`` before its
    softplus; ``gate``: ``g`` is the input of KDA's gate, applied in the kernels (``A_log`` and ``dt_bias`` leaves).
    Relative distances of its output, final states and every gradient to the float64 PyTorch backend (``ref``), to
    the unfused composition ``diagonal_gain`` + ``_AsymmetricMemory`` (``unfused``: autograd sums the two gradients
    of ``k`` and of ``g``, and takes ``g``'s through the gate), and to that composition's gradients less the memory's
    of ``k`` and ``g`` (``dropped``: what a missing accumulate would give; from the same backward, in float64).
    ``segment_size``: tokens per gain segment (default: the rule)."""
    import kdn
    from kdn.ops import chunk as kc
    from kdn.ops import triton as kt
    from kdn.ops.gate import kda_gate
    from kdn.ops.triton.memory import _AsymmetricMemory
    from kdn.ops.triton.safe_gate import safe_gate

    names = ("q", "k", "v", "g", "omega", "r")
    cu = None if lens is None else torch.tensor([0, *itertools.accumulate(lens)], device=device)
    N = B if lens is None else len(lens)
    x = make_inputs(B, T, H, K, K, seed=T, g_min=g_min, isotropic=iso)
    if softplus:  # omega's input: both signs, some far below 0
        x["omega"] = torch.randn(x["omega"].shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 3
        x["omega"][:, :5] -= 20.0
    x["S0"], x["u0"] = make_state(N, H, K, K, isotropic=iso)
    x["mu"] = torch.tensor([3.0, float(K)] * (H // 2), dtype=torch.float64)
    if gate:  # the gate's input f; exp(A_log) from 1 to -g_min, so that some tokens forget strongly
        gen = torch.Generator().manual_seed(5)
        x["g"] = torch.randn(x["g"].shape, generator=gen, dtype=torch.float64) * 2.5
        x["A_log"] = torch.linspace(math.log(1.0), math.log(-g_min), H, dtype=torch.float64)
        x["dt_bias"] = torch.randn(H * K, generator=gen, dtype=torch.float64) - 2.0

    def unfused(lv: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        g = kda_gate(lv["g"], lv["A_log"], lv["dt_bias"]) if gate else lv["g"]
        check = safe_gate(g)
        terms = (lv[n] for n in ("omega", "r", "mu", "u0"))
        if iso:
            beta, pT = kt.isotropic_gain(lv["k"], g, *terms, dtype, cu_seqlens=cu, segment_size=segment_size)
        else:
            kappa, pT = kt.diagonal_gain(lv["k"], g, *terms, dtype, cu_seqlens=cu, omega_softplus=softplus,
                                         segment_size=segment_size)
        # the memory's k and g through views of their own, whose gradients are the memory's alone
        k, g = lv["k"].view_as(lv["k"]), g.view_as(g)
        k.retain_grad()
        g.retain_grad()
        # Isotropic: the memory's key k on both sides, beta the gain (its gradient of k reaches the gain's too)
        kappa, beta = (k, beta) if iso else (kappa, None)
        o, S = _AsymmetricMemory.apply(lv["q"], k, kappa, lv["v"], g, beta, lv["S0"], 0.37, True, cu, check, False)
        return o, S, pT, k, g

    def run(kind: str) -> dict[str, dict[str, torch.Tensor]]:
        ref = kind == "ref"
        dts = {n: torch.float64 if ref else dtype if n in "qkv" else torch.float32 for n in x}
        lv = {n: t.detach().to(device, dts[n]).requires_grad_() for n, t in x.items()}  # fresh leaves
        kw = {"scale": 0.37, "cu_seqlens": cu} | ({} if iso else {"omega_softplus": softplus})
        if gate:
            kw["gate"] = (lv["A_log"], lv["dt_bias"])
        if ref:
            o, (S, uT) = (kdn.isotropic_kdn if iso else kdn.diagonal_kdn)(
                *(lv[n] for n in names), mu=lv["mu"], initial_state=(lv["S0"], lv["u0"]), output_final_state=True,
                backend="torch", **kw)
        elif kind == "fused":
            o, (S, uT) = (kc.chunk_isotropic_kdn if iso else kc.chunk_diagonal_kdn)(
                *(lv[n] for n in names), lv["mu"], (lv["S0"], lv["u0"]), segment_size=segment_size, **kw)
        else:
            o, S, uT, k_mem, g_mem = unfused(lv)
        gen = torch.Generator(device=device).manual_seed(0)
        ups = [torch.randn(t.shape, generator=gen, dtype=torch.float64, device=device) for t in (o, S, uT)]
        sum((t.double() * u).sum() for t, u in zip((o, S, uT), ups)).backward()
        out = {"o": o.detach(), "S": S.detach(), "uT": uT.detach()} | {"d" + n: t.grad for n, t in lv.items()}
        if kind != "unfused":
            return {kind: out}
        # the memory's gradients of k and g taken out of the composition's (and, through the gate, those of its
        # input and parameters): every other gradient is the composition's
        cut = out | {"dk": out["dk"].double() - k_mem.grad.double()}
        if gate:
            f, A, b = (lv[n].detach().requires_grad_() for n in ("g", "A_log", "dt_bias"))
            through = torch.autograd.grad(kda_gate(f, A, b), (f, A, b), g_mem.grad)
            cut |= {n: out[n].double() - t.double() for n, t in zip(("dg", "dA_log", "ddt_bias"), through)}
        else:
            cut["dg"] = out["dg"].double() - g_mem.grad.double()
        return {"unfused": out, "dropped": cut}

    res = {kind: r for run_kind in ("ref", "fused", "unfused") for kind, r in run(run_kind).items()}
    return {kind: {n: rel_err(res["fused"][n], res[kind][n]) for n in res["ref"]}
            for kind in ("ref", "unfused", "dropped")}


FUSED = r"""
import json, sys, torch
sys.path.insert(0, "tests")
import triton_interpret
triton_interpret.enable("fla.ops.kda", "fla.ops.precond_kda.chunk")
from test_kdn_triton_interpret import fused_errors
cases = {  # name: (lengths of packed sequences or None, B, T, g_min, omega before its softplus, KDA's gate inside)
    "padded": (None, 2, 70, -3.0, True, False),  # a full chunk of 64 and a partial one
    "packed": ((7, 64, 2), 1, 73, -12.0, False, True),  # short sequences and a full chunk, fla's token loop
}
# gain segments of 22 (Diagonal) and 32 (Isotropic) tokens: several a sequence, the accumulate runs in each; the
# memory's dg summed from a segment's end to its chunk's end (64) or its sequence's (70), and restarted at a chunk
# boundary inside a segment
out = {name: fused_errors(*case[:5], H=2, K=16, gate=case[5], segment_size=22) for name, case in cases.items()}
out |= {"iso_" + name: fused_errors(*case[:4], False, H=2, K=16, gate=case[5], segment_size=32, iso=True)
        for name, case in cases.items()}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def gains() -> dict:
    """One interpreted run of the gains and decoding (``SCRIPT``), fla unpatched."""
    return triton_interpret.run_interpreted(SCRIPT, timeout=600)


@pytest.fixture(scope="module")
def fused() -> dict[str, dict]:
    """One interpreted run of the fused node (``FUSED``, which patches fla for the interpreter): the module's costliest
    check, in a process of its own so that neither test carries both."""
    return triton_interpret.run_interpreted(FUSED, timeout=600)


def test_triton_kernels_in_interpreter_match_reference(gains: dict) -> None:
    results = gains["errors"]
    assert len(results) == 10
    for variant, (tol, errs) in results.items():
        assert all(v < tol for v in errs.values()), (variant, errs)
    # the forced segments really split the sequence (the last partial); the others do not
    assert gains["segments"] == {"diag_seg8": 4, "diag_default_seg": 2, "diag_dplr_K72_seg8": 4,
                                 "diag_dplr_softplus_seg8": 4, "iso_seg32": 3, "iso_one_segment": 1,
                                 "diag_bf16": 1, "iso_bf16": 1}


def test_segment_rule() -> None:
    """``(tokens per segment, segments)``. Isotropic: >= 512 programs where the sequence allows, >= 8 chunks of 32
    tokens a segment; Diagonal (one warp a program): >= 4096 programs, >= 64 tokens a segment."""
    from kdn.ops.triton import gain_segments

    assert gain_segments(True, 64, 8192) == (1024, 8)  # B=4, H=16, T=8K: 512 programs
    assert gain_segments(True, 64, 8200) == (1056, 8)  # T not a multiple of the chunk
    assert gain_segments(True, 2, 100) == (256, 1)  # short sequences: one segment
    assert gain_segments(False, 64, 8192) == (128, 64)  # 4096 programs
    assert gain_segments(False, 16, 32768) == (128, 256)  # B=1, T=32K
    assert gain_segments(False, 64, 8200) == (129, 64)
    assert gain_segments(False, 2, 100) == (64, 2)
    assert gain_segments(False, 2, 100, 24) == (24, 5)
    with pytest.raises(ValueError, match="multiple of the chunk size 32"):
        gain_segments(True, 2, 100, 24)


def test_fused_gain_and_memory_in_interpreter(fused: dict[str, dict]) -> None:
    """Each KDN's gain and memory as one autograd node (the gain's last backward launch adds the memory's gradients
    of ``k`` and ``g``, :func:`fused_errors`), FP32 with ``S0``: padded (Diagonal: ``omega`` before its softplus;
    fla's tensor-core diagonal blocks) and packed (strong forgetting: fla's token loop; KDA's gate applied in the
    kernels), gain segments of 22 (Diagonal) and 32 (Isotropic) tokens. Every output and gradient (``mu``, ``S0``,
    ``p0``, the gate's ``A_log`` and ``dt_bias`` included) matches the float64 reference and equals the unfused
    composition (to FP32 rounding where the gate runs in other kernels); with the memory's gradients of ``k`` and
    ``g`` cut, exactly ``dk`` and ``dg`` differ (and, through the gate, those of its parameters)."""
    pytest.importorskip("fla")
    assert fused.keys() == {"padded", "packed", "iso_padded", "iso_packed"}
    for case, r in fused.items():
        gated = {"dA_log", "ddt_bias"} if case.endswith("packed") else set()
        # dA_log sums dg g over every token and channel, terms of both signs: here |sum| is 1/34 of sum |terms| in one
        # head, so FP32's per-element errors (~4e-6 in dg) may grow tens of times (the tolerance allows a hundredfold)
        tol = {"dA_log": 5e-4}
        assert len(r["ref"]) == 12 + len(gated), (case, r["ref"])
        assert all(e < tol.get(n, 5e-5) for n, e in r["ref"].items()), (case, r["ref"])
        # the same values, except where the gate runs in other kernels (ours and fla's against torch's, FP32)
        assert all(e < (tol.get(n, 1e-4) if gated else 1e-6) for n, e in r["unfused"].items()), (case, r["unfused"])
        dropped = {n: e for n, e in r["dropped"].items() if e > 1e-4}
        assert dropped.keys() == {"dk", "dg"} | gated and min(dropped.values()) > 1e-3, (case, r["dropped"])


def test_exact_only_answers_the_token_loop_without_reading_the_gates() -> None:
    """Under ``exact_only`` (and in a CUDA graph capture) the safe-gate check answers the exact path for gates it
    would otherwise send down the tensor-core path; outside it, it reads them again."""
    from kdn.ops.triton.safe_gate import exact_only, safe_gate, safe_steepest

    g = -0.1 * torch.rand(2, 64, 3, 16) - 0.01
    assert bool(safe_gate(g)) and bool(safe_steepest(-g.amin(-1)))
    with exact_only():
        assert not bool(safe_gate(g)) and not bool(safe_steepest(-g.amin(-1)))
    assert bool(safe_gate(g))
