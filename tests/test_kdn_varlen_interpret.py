"""Packed sequences (``cu_seqlens``) in the CUDA backend, on the CPU through Triton's interpreter.

Gains: the fused kernels with ``cu_seqlens`` against the float64 PyTorch reference (``kdn.ops.torch_gain``) run on each
sequence alone with its own initial uncertainty: values, final states and every gradient. Lengths
(1, 37, 64, 0, 5, 90) with forced segments of one and two 32-token chunks (the Diagonal gain: lengths
(1, 10, 16, 0, 5, 22) and segments of 8 and 16 tokens) make segments end inside a sequence, at its end and past it
(the empty sequence keeps its initial uncertainty). Memory: ``chunk_diagonal_kdn``
(``memory="asym"``, fla's asymmetric chunk-64 kernels) and ``chunk_isotropic_kdn`` (the same, write key ``beta k``)
with ``cu_seqlens`` against ``kdn``'s PyTorch backend in float64 (which unpacks into a padded batch), every gradient
including ``mu``, the initial memory ``S0 [N,H,K,V]`` and the uncertainty state (the Diagonal gain and memory as one
fused node: ``tests/test_kdn_triton_interpret.py``). Each runs in a fresh interpreter.
"""
from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from kdn_inputs import make_inputs, make_state, rel_err

pytest.importorskip("triton")
triton_interpret = pytest.importorskip("triton_interpret")  # tests/triton_interpret.py
ROOT = Path(__file__).resolve().parents[1]

NAMES = ("k", "g", "omega", "r", "mu", "u0")
MEMORY_NAMES = ("q", "k", "v", "g", "omega", "r")


def _offsets(lens: tuple[int, ...]) -> list[int]:
    return [0, *itertools.accumulate(lens)]


def _reference_gains(iso: bool, dplr: bool, l64: dict, cu: list[int]) -> tuple[torch.Tensor, ...]:
    """float64 gains, each sequence alone with its own initial uncertainty (an empty one keeps it)."""
    from kdn.ops import torch_gain as ref

    fn = ref.isotropic_gain if iso else ref.diagonal_gain
    gains, finals = [], []
    for n, (a, b) in enumerate(itertools.pairwise(cu)):
        u0 = l64["u0"][n:n + 1]
        if a == b:
            finals.append(u0)
            continue
        gain, final = fn(*(l64[x][:, a:b] for x in NAMES[:4]), l64["mu"], u0)
        gains.append(gain)
        finals.append(final)
    gain = torch.cat(gains, 1)
    if dplr:
        return gain, l64["g"].exp() * l64["k"], -gain, torch.cat(finals, 0)
    return gain, torch.cat(finals, 0)


def gain_errors(iso: bool, dplr: bool, lens: tuple[int, ...], H: int, K: int, seg: int | None,
                device: str = "cpu") -> tuple[int, dict[str, float]]:
    """The fused gain with ``cu_seqlens`` (FP32) against :func:`_reference_gains`: the number of segments and
    the relative errors of the outputs and of every input's gradient. ``seg``: forced tokens per segment."""
    from kdn.ops import triton as kt

    cu = _offsets(lens)
    N, T = len(lens), cu[-1]
    ns = kt.gain_segments(iso, N * H, max(lens), seg)[1]
    x = make_inputs(1, T, H, K, K, isotropic=iso, seed=len(lens) + K, g_min=-3.0)
    strong = min(120, T // 2)
    x["g"][:, strong:strong + 6] *= 4.0  # strong forgetting: g down to -12
    u0 = make_state(N, H, K, K, isotropic=iso, seed=5)[1]
    l64 = {n: x[n].to(device).requires_grad_() for n in NAMES[:4]}
    l64 |= {"mu": torch.linspace(1.0, float(K), H, dtype=torch.float64, device=device).requires_grad_(),
            "u0": u0.to(device).requires_grad_()}
    l32 = {n: t.detach().float().requires_grad_() for n, t in l64.items()}
    outs64 = _reference_gains(iso, dplr, l64, cu)
    fn = kt.isotropic_gain if iso else kt.diagonal_gain_dplr if dplr else kt.diagonal_gain
    cu_t = torch.tensor(cu, dtype=torch.int32 if iso else torch.int64, device=device)
    outs32 = fn(*(l32[n] for n in NAMES), cu_seqlens=cu_t, segment_size=seg)
    gen = torch.Generator(device=device).manual_seed(0)
    ups = [torch.randn(o.shape, generator=gen, dtype=torch.float64, device=device) for o in outs64]
    sum((o * u).sum() for o, u in zip(outs64, ups)).backward()
    sum((o.double() * u).sum() for o, u in zip(outs32, ups)).backward()
    names = ("gain", "a", "b", "final") if dplr else ("gain", "final")
    errs = {n: rel_err(o32, o64) for n, o32, o64 in zip(names, outs32, outs64)}
    return ns, errs | {"d" + n: rel_err(l32[n].grad, l64[n].grad) for n in l64}


def memory_errors(iso: bool, lens: tuple[int, ...], g_min: float, with_S0: bool, H: int, K: int,
                  device: str = "cpu", dtype: torch.dtype = torch.float32,
                  segment_size: int | None = None) -> dict[str, float]:
    """``chunk_diagonal_kdn`` (``memory="asym"``) or ``chunk_isotropic_kdn`` with ``cu_seqlens``, ``q, k, v`` in
    ``dtype``, gain segments of ``segment_size`` tokens (default: the rule), against ``kdn``'s PyTorch backend in
    float64: relative errors of the output, the final states and every gradient (``mu``; ``S0 [N,H,K,V]`` when
    ``with_S0``, else a zero memory)."""
    import kdn
    from kdn.ops import chunk as kc

    cu = torch.tensor(_offsets(lens), device=device)
    N, T = len(lens), int(cu[-1])
    x = make_inputs(1, T, H, K, K, isotropic=iso, seed=T, g_min=g_min)
    S0, u0 = make_state(N, H, K, K, isotropic=iso)
    l64 = {n: x[n].to(device).requires_grad_() for n in MEMORY_NAMES} | {"u0": u0.to(device).requires_grad_()}
    l64["mu"] = torch.tensor([3.0, float(K)] * (H // 2), dtype=torch.float64, device=device).requires_grad_()
    if with_S0:
        l64["S0"] = S0.to(device).requires_grad_()
    l32 = {n: t.detach().to(dtype if n in ("q", "k", "v") else torch.float32).requires_grad_() for n, t in l64.items()}
    fn = kdn.isotropic_kdn if iso else kdn.diagonal_kdn
    o64, (S64, e64) = fn(*(l64[n] for n in MEMORY_NAMES), mu=l64["mu"], initial_state=(l64.get("S0"), l64["u0"]),
                         scale=0.37, output_final_state=True, cu_seqlens=cu, backend="torch")
    tf = kc.chunk_isotropic_kdn if iso else kc.chunk_diagonal_kdn
    o32, (S32, e32) = tf(*(l32[n] for n in MEMORY_NAMES), l32["mu"], (l32.get("S0"), l32["u0"]), scale=0.37,
                         cu_seqlens=cu, segment_size=segment_size)
    gen = torch.Generator(device=device).manual_seed(0)
    ups = [torch.randn(t.shape, generator=gen, dtype=torch.float64, device=device) for t in (o64, S64, e64)]
    sum((a * u).sum() for a, u in zip((o64, S64, e64), ups)).backward()
    sum((a.double() * u).sum() for a, u in zip((o32, S32, e32), ups)).backward()
    errs = {"o": rel_err(o32, o64), "S": rel_err(S32, S64), "uT": rel_err(e32, e64)}
    return errs | {"d" + n: rel_err(l32[n].grad, l64[n].grad) for n in l64}


GAINS = r"""
import json, sys
sys.path.insert(0, "tests")
from test_kdn_varlen_interpret import gain_errors
LENS = (1, 37, 64, 0, 5, 90)
# the Diagonal kernels walk the tokens one by one (slowly in the interpreter), and take segments of any length: the
# same pattern a quarter as long
DIAG_LENS = (1, 10, 16, 0, 5, 22)
cases = {  # name: (iso, dplr, lens, H, K, tokens per segment)
    "diag_seg8": (False, False, DIAG_LENS, 2, 16, 8),
    "diag_dplr_seg16": (False, True, DIAG_LENS, 2, 16, 16),
    "diag_one_segment": (False, False, (33, 7, 20), 2, 12, None),
    "iso_seg32": (True, False, LENS, 2, 16, 32),
    "iso_seg64": (True, False, LENS, 2, 16, 64),
}
out, segments = {}, {}
for name, args in cases.items():
    segments[name], out[name] = gain_errors(*args)
print(json.dumps({"errors": out, "segments": segments}))
"""

MEMORY = r"""
import json, sys
sys.path.insert(0, "tests")
import triton_interpret
triton_interpret.enable("fla.ops.kda", "fla.ops.precond_kda.chunk")
from test_kdn_varlen_interpret import memory_errors
iso = sys.argv[1] == "iso"
# fla's chunks of 64 restart at each sequence: a one-token sequence, partial chunks, and a sequence of two chunks
# (its first full, at an offset inside a chunk of the packed row) with three 32-token gain segments (the last of 2
# tokens), then the token loop (strong forgetting) over two sequences
out = {f"lens{lens}_g{g_min:g}": memory_errors(iso, lens, g_min, with_S0, 2, 16, segment_size=32)
       for lens, g_min, with_S0 in (((1, 13, 5, 66), -3.0, True), ((66, 3), -12.0, False))}
print(json.dumps(out))
"""


COMPILE = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kdn.ops.triton import gain_diagonal as gd, gain_isotropic as gi, utils as tu
from kdn.ops.triton.gate import _kda_gate_fwd_kernel

BF16 = ("k_ptr", "kappa_ptr", "a_ptr", "b_ptr", "dk_ptr", "dkappa_ptr", "da_ptr", "db_ptr", "beta_ptr", "dbeta_ptr",
        "dk_mem_ptr")
DIAG = (gd._diag_seg_fwd_kernel, gd._diag_carry_fwd_kernel, gd._diag_gain_fwd_kernel, gd._diag_seg_bwd_kernel,
        gd._diag_carry_bwd_kernel, gd._diag_gain_bwd_kernel)
ISO = (gi._iso_seg_fwd_kernel, gi._iso_gain_fwd_kernel, gi._iso_seg_bwd_kernel, gi._iso_gain_bwd_kernel)


def compile_for_sm90(kernel, consts, varlen, t_is_one, warps):
    # bf16 keys and gains (and the gradient of the gate's input with GATE), FP32 rest; packed: int32 offsets, else
    # cu_ptr None and (as Triton specializes an int argument equal to 1) T = 1 a constexpr
    bf16 = BF16 + (("dg_ptr",) if consts.get("GATE") else ())
    sig, cst = {}, {}
    for i, n in enumerate(kernel.arg_names):
        if n in consts or (n in ("cu_ptr", "idx_ptr") and not varlen) or (n == "T" and t_is_one):
            sig[n] = "constexpr"
            cst[(i,)] = consts.get(n, None if n == "cu_ptr" else 1)
        elif n.endswith("_ptr"):
            sig[n] = "*i32" if n in ("cu_ptr", "idx_ptr") else "*bf16" if n in bf16 else "*fp32"
        else:
            sig[n] = "fp32" if n == "scale" else "i32"
    triton.compile(ASTSource(kernel, sig, cst), target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


n = 0
for varlen, t_is_one, K in ((True, False, 128), (True, False, 64), (False, True, 128)):
    BK = triton.next_power_of_2(K)
    for kernel in DIAG:
        flags = {f: True for f in ("EMIT_AB", "ACCUMULATE") if f in kernel.arg_names}  # their branches on
        flags |= {"GATE": varlen} if "GATE" in kernel.arg_names else {}  # KDA's gate in the kernels, and not
        compile_for_sm90(kernel, {"H": 8, "K": K, "BK": BK, "IS_VARLEN": varlen} | flags, varlen, t_is_one,
                         tu._DIAG_WARPS)
        n += 1
    if K == 128:
        for kernel in ISO:
            bk = {"BK": BK} if kernel in (gi._iso_seg_fwd_kernel, gi._iso_gain_bwd_kernel) else {}
            if kernel is gi._iso_gain_bwd_kernel:  # the memory's gradients summed in, and KDA's gate or not
                bk |= {"ACCUMULATE": True, "DG_CHUNK": 64, "GATE": varlen}
            compile_for_sm90(kernel, {"H": 8, "K": K, "BT": tu._ISO_BT, "IS_VARLEN": varlen} | bk, varlen, t_is_one,
                             4)
            n += 1
for varlen, gate in ((False, True), (True, True), (False, False)):  # KDA's gate (or g given) in one pass
    compile_for_sm90(_kda_gate_fwd_kernel, {"H": 8, "K": 128, "BT": 64, "BK": 128, "IS_VARLEN": varlen,
                                            "GATE": gate}, varlen, False, 1)
    n += 1
print(n)
"""


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict]:
    """One interpreted run of the gains, then of both memories (which patch fla for the interpreter)."""
    scripts = {"gains": (GAINS,), "diag_asym": (MEMORY, "diag_asym"), "iso": (MEMORY, "iso")}
    return triton_interpret.run_interpreted_many(scripts, timeout=600)


def test_packed_gains_in_interpreter_match_reference_per_sequence(interpreted: dict[str, dict]) -> None:
    report = triton_interpret.result(interpreted, "gains")
    results = report["errors"]
    assert len(results) == 5
    for case, errs in results.items():
        assert all(v < 1e-5 for v in errs.values()), (case, errs)
    # the forced segments split the longest sequence (90 tokens: 3 chunks of 32; Diagonal: 22 tokens, 3 segments of
    # 8); without them one segment
    assert report["segments"] == {"diag_seg8": 3, "diag_dplr_seg16": 2, "diag_one_segment": 1, "iso_seg32": 3,
                                  "iso_seg64": 2}


@pytest.mark.parametrize("variant", ["diag_asym", "iso"])
def test_packed_memory_in_interpreter_matches_reference(variant: str, interpreted: dict[str, dict]) -> None:
    pytest.importorskip("fla")
    errs = triton_interpret.result(interpreted, variant)
    assert len(errs) == 2
    for case, e in errs.items():
        assert all(v < 5e-5 for v in e.values()), (case, e)


def test_gain_kernels_compile_for_hopper(tmp_path: Path) -> None:
    """The compiled path types loop-carried values strictly (the interpreter does not): every gain kernel compiles
    to an sm_90 cubin on the CPU (Triton's bundled ptxas), packed and batched, bf16, with ``T = 1`` specialized, the
    last backward launches with KDA's gate and without; and the one-pass gate (``kdn.ops.triton.gate``) packed and
    not, and on a given ``g``."""
    assert triton_interpret.compile_for_hopper(COMPILE, tmp_path).split()[-1] == "29"


@pytest.mark.gpu
@pytest.mark.parametrize("K", [64, 128])
@pytest.mark.parametrize("variant", ["diag", "diag_dplr", "iso"])
def test_packed_gains_compiled_match_reference(variant: str, K: int) -> None:
    """The compiled kernels (``BT = 16`` with the register cap at ``K = 128``) with the default segment rule:
    several segments in the longest sequence, short and empty sequences beside it."""
    ns, errs = gain_errors(variant == "iso", variant == "diag_dplr", (1, 3000, 0, 700, 64, 2, 1500), 8, K, None,
                           device="cuda")
    assert ns > 4
    assert all(v < 1e-4 for v in errs.values()), errs


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["diag_asym", "iso"])
def test_packed_memory_compiled_matches_reference(variant: str) -> None:
    """bf16 ``q, k, v`` within fla's KDA tolerances (as ``tests/test_kdn_triton.py``)."""
    tol = {"o": 0.005, "S": 0.005, "uT": 0.005, "dq": 0.008, "dk": 0.008, "dv": 0.008, "dS0": 0.008}
    for lens, g_min, with_S0 in (((1, 100, 63, 700, 64, 2), -2.0, True), ((2000, 5, 129), -8.0, False)):
        errs = memory_errors(variant == "iso", lens, g_min, with_S0, 16, 64, device="cuda", dtype=torch.bfloat16)
        bad = {n: e for n, e in errs.items() if not e <= tol.get(n, 0.02)}
        assert not bad, (lens, bad, errs)


def _gain_inputs(T: int, N: int, isotropic: bool) -> list[torch.Tensor]:
    H, K = 2, 8
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K), dim=-1)
    omega = torch.rand(1, T, H) if isotropic else torch.rand(1, T, H, K)
    u0 = torch.rand(N, H) + 0.5 if isotropic else torch.rand(N, H, K) + 0.5
    return [k, -torch.rand(1, T, H, K), omega + 0.1, torch.rand(1, T, H) + 0.5, torch.full((H,), 8.0), u0]


@pytest.mark.parametrize("isotropic", [False, True], ids=["diagonal", "isotropic"])
def test_packed_gain_inputs_are_checked(isotropic: bool) -> None:
    from kdn.ops import triton as kt

    fn = kt.isotropic_gain if isotropic else kt.diagonal_gain
    x = _gain_inputs(10, 2, isotropic)
    with pytest.raises(ValueError, match="int32/int64"):
        fn(*x, cu_seqlens=torch.tensor([0.0, 4.0, 10.0]))
    with pytest.raises(ValueError, match="end at T=10"):
        fn(*x, cu_seqlens=torch.tensor([0, 4, 9]))
    with pytest.raises(ValueError, match="non-decreasing"):
        fn(*x, cu_seqlens=torch.tensor([0, 6, 4, 10]))
    with pytest.raises(ValueError, match="3 sequences"):
        fn(*x, cu_seqlens=torch.tensor([0, 4, 6, 10]))
    batch = [torch.cat([t, t]) if i < 4 else t for i, t in enumerate(x)]
    with pytest.raises(ValueError, match="batch size 1"):
        fn(*batch, cu_seqlens=torch.tensor([0, 4, 10]))


def test_dplr_memory_refuses_packed_sequences() -> None:
    pytest.importorskip("fla")
    from kdn.ops import chunk as kc

    k, g, omega, r, mu, p0 = _gain_inputs(10, 2, False)
    q, v = torch.randn(1, 10, 2, 8), torch.randn(1, 10, 2, 8)
    with pytest.raises(NotImplementedError, match="kdn.ops.api's unpacking for the DPLR memory"):
        kc.chunk_diagonal_kdn(q, k, v, g, omega, r, mu, (None, p0), cu_seqlens=torch.tensor([0, 4, 10]),
                              memory="dplr")
