"""The CUDA backend's fla-based paths on the CPU, through Triton's interpreter (``tests/triton_interpret.py``).

In FP32 against the float64 PyTorch reference: the whole CUDA Diagonal and Isotropic KDN (``kdn.ops.chunk``)
through fla's asymmetric chunk-64 kernels and our WY backward (``memory="asym"``; the Isotropic write key is
``beta k``; with an initial memory; the WY terms and chunk states kept from the forward, and recomputed in the
backward, ``recompute_states=True``, with identical gradients), each through both of fla's paths for the diagonal
blocks (``kdn.ops.triton.safe_gate``: tensor-core matmuls with bounded gates, the token loop under strong
forgetting), with our gain kernels, every gradient (packed sequences: ``tests/test_kdn_varlen_interpret.py``); and the
fused front end (our short convs + L2 norms, ``kdn.modules.conv``, fla's for the cached prefill; fla's KDA gate and
gated norm) against the PyTorch front end (``fused=False``) in whole layers (padded, packed, prefill + decoding). Each
runs in a fresh interpreter. (fla's DPLR kernels do not run in the interpreter; they are checked on the H200,
``tests/test_kdn_triton.py``.)
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import timeout_s

pytest.importorskip("triton")
pytest.importorskip("fla")
triton_interpret = pytest.importorskip("triton_interpret")  # tests/triton_interpret.py

MEMORY = r"""
import json, sys, torch
sys.path.insert(0, "tests")
import triton_interpret
triton_interpret.enable("fla.ops.kda", "fla.ops.precond_kda.chunk")
import kdn
from kdn.ops import chunk as kc
from kdn.ops import triton as kt
from kdn.ops.triton.safe_gate import safe_gate
from kdn_inputs import make_inputs, make_state, rel_err
out = {}
names = ("q", "k", "v", "g", "omega", "r")
# a batch of 2 with S0 (tensor-core diagonal blocks, 64 + 2 tokens); one sequence under strong forgetting (fla's
# token loop, 64 + 1 tokens), which the interpreter runs slowly; gain segments of 22 and 96 tokens, which straddle
# the memory's chunks (the gains' last launches sum the memory's dg within the chunks: from a segment's end to its
# chunk's end or the sequence's, and restarted at a chunk boundary inside a segment)
for iso, B, T, g_min, with_S0, seg in ((False, 2, 66, -3.0, True, None), (False, 1, 65, -12.0, False, None),
                                       (True, 1, 65, -12.0, False, None), (True, 2, 66, -3.0, True, None),
                                       (False, 1, 70, -3.0, False, 22), (True, 1, 130, -3.0, False, 96)):
    H, K = 2, 16
    x = make_inputs(B, T, H, K, K, isotropic=iso, seed=T, g_min=g_min)
    S0, u0 = make_state(B, H, K, K, isotropic=iso)
    l64 = {n: x[n].clone().requires_grad_() for n in names} | {"u0": u0.requires_grad_()}
    if with_S0:
        l64["S0"] = S0.requires_grad_()
    l32 = {n: t.detach().float().requires_grad_() for n, t in l64.items()}
    mu = torch.tensor([3.0, 16.0])
    fn = kdn.isotropic_kdn if iso else kdn.diagonal_kdn
    o64, (S64, e64) = fn(*(l64[n] for n in names), mu=mu.double(), initial_state=(l64.get("S0"), l64["u0"]),
                         scale=0.37, output_final_state=True, backend="torch")
    tf = kc.chunk_isotropic_kdn if iso else kc.chunk_diagonal_kdn
    o32, (S32, e32) = tf(*(l32[n] for n in names), mu, (l32.get("S0"), l32["u0"]), scale=0.37, segment_size=seg)
    gen = torch.Generator().manual_seed(0)
    ups = [torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in (o64, S64, e64)]
    sum((a * u).sum() for a, u in zip((o64, S64, e64), ups)).backward()
    sum((a.double() * u).sum() for a, u in zip((o32, S32, e32), ups)).backward()
    errs = {"o": rel_err(o32, o64), "S": rel_err(S32, S64), "uT": rel_err(e32, e64)}
    errs |= {"d" + n: rel_err(l32[n].grad, l64[n].grad) for n in l64}
    errs["safe_gate"] = float(bool(safe_gate(l32["g"])))
    out[f"{'iso' if iso else 'diag_asym'}_T{T}_g{g_min:g}" + (f"_seg{seg}" if seg else "")] = errs
    if with_S0 and not iso:  # the backward's recomputed WY terms and chunk states give the kept ones' gradients
        lr = {n: t.detach().clone().requires_grad_() for n, t in l32.items()}
        o_r, (S_r, e_r) = tf(*(lr[n] for n in names), mu, (lr.get("S0"), lr["u0"]), scale=0.37,
                             recompute_states=True)
        sum((a.double() * u).sum() for a, u in zip((o_r, S_r, e_r), ups)).backward()
        gap = max((lr[n].grad - l32[n].grad).abs().max().item() for n in lr)
        out[f"{'iso' if iso else 'diag_asym'}_T{T}_recompute_gap"] = {"gap": gap, "safe_gate": -1.0}
print(json.dumps(out))
"""

FRONT_END = r"""
import json, sys, torch
sys.path.insert(0, "tests")
import triton_interpret
triton_interpret.enable("fla.modules", "fla.ops.kda.gate", "fla.modules.norm.fused_norm_gate")
import kdn
import kdn.modules.front_end as front_end
import kdn.ops.gate as ops_gate
from kdn.layers import RecurrentCache
from kdn_inputs import rel_err
# the fused kernels on CPU tensors (the interpreter runs them): fla_fused answers the modules' fused flag alone
front_end.fla_fused = ops_gate.fla_fused = lambda t, fused=True: fused
out = {}
for cls in (kdn.DiagonalKDN, kdn.IsotropicKDN):
    torch.manual_seed(0)
    layer = cls(64, 2, 16, layer_idx=0, backend="torch")
    plain = cls(64, 2, 16, layer_idx=0, backend="torch", fused=False)
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(2, 40, 64)
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :7] = 0
    cases = {"padded": ({"attention_mask": mask}, x), "packed": ({"cu_seqlens": torch.tensor([0, 20, 33, 40])}, x[:1])}
    for case, (kw, xin) in cases.items():
        res = {}
        for fused, net in ((False, plain), (True, layer)):
            xi = xin.clone().requires_grad_()
            o = net(xi, **kw)[0]
            w = torch.randn(o.shape, generator=torch.Generator().manual_seed(3))
            (o * w).sum().backward()
            res[fused] = [o.detach(), xi.grad] + [p.grad for p in net.parameters()]
        names = ["o", "dx"] + [n for n, _ in layer.named_parameters()]
        out[f"{cls.__name__}_{case}"] = {n: rel_err(a, b) for n, a, b in zip(names, res[True], res[False])}
    with torch.no_grad():  # prefill through the fused conv (its cache), then PyTorch decoding steps
        full = layer(x)[0]
        cache = RecurrentCache()
        parts = [layer(x[:, :30], past_key_values=cache, use_cache=True)[0]]
        parts += [layer(x[:, t:t + 1], past_key_values=cache, use_cache=True)[0] for t in range(30, 40)]
    out[f"{cls.__name__}_prefill_decode"] = {"o": rel_err(torch.cat(parts, 1), full)}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict]:
    """One interpreted run of this module's scripts (defined below), read by the tests."""
    scripts = {"memory": (MEMORY,), "front_end": (FRONT_END,), "steepest": (STEEPEST,), "gate_fwd": (GATE_FWD,)}
    return triton_interpret.run_interpreted_many(scripts, timeout=600)


@pytest.mark.parametrize("script", ["memory", "front_end"])
def test_fla_paths_in_interpreter_match_reference(script: str, interpreted: dict[str, dict]) -> None:
    errs = triton_interpret.result(interpreted, script)
    paths = {case: e.pop("safe_gate") for case, e in errs.items() if "safe_gate" in e}
    for case, e in errs.items():
        assert all(v < 5e-5 for v in e.values()), (case, e)
    if script == "memory":  # both memories through both of fla's diagonal-block paths
        assert paths == {"diag_asym_T66_g-3": 1.0, "diag_asym_T65_g-12": 0.0, "iso_T65_g-12": 0.0, "iso_T66_g-3": 1.0,
                         "diag_asym_T70_g-3_seg22": 1.0, "iso_T130_g-3_seg96": 1.0,
                         "diag_asym_T66_recompute_gap": -1.0}
        assert errs["diag_asym_T66_recompute_gap"]["gap"] == 0.0


def test_safe_gate_checks_fla_envelope() -> None:
    """fla's tensor-core diagonal blocks are taken only while no channel falls by more than 75 nats over 15
    consecutive tokens (checked on the steepest channel of each token, in any window)."""
    from kdn.ops.triton.safe_gate import safe_gate

    def gates(*runs: tuple[int, float], T: int = 64) -> torch.Tensor:
        g = -0.01 * torch.rand(2, T, 3, 8, generator=torch.Generator().manual_seed(0))
        for start, value in runs:  # one channel of one head, from `start` on for 15 tokens
            g[1, start:start + 15, 2, 5] = value
        return g

    assert safe_gate(gates((10, -4.9)))
    assert not safe_gate(gates((10, -5.1)))
    assert safe_gate(gates((0, -4.9), (49, -4.9)))  # two steep runs, never 15 steep tokens in one window
    g = gates()
    g[1, 30, 2, 5] = -70.0  # one token that forgets almost everything
    assert safe_gate(g)
    g[1, 40, 0, 1] = -10.0  # another head: its own windows
    assert safe_gate(g)
    g[1, 40, 2, 1] = -10.0  # another channel of the same head and window: the steepest-channel sum exceeds 75
    assert not safe_gate(g)
    assert safe_gate(gates(T=1)) and safe_gate(gates(T=7)) and safe_gate(torch.zeros(1, 0, 2, 4))
    assert not safe_gate(gates(T=7).index_fill_(1, torch.tensor([3]), -80.0))
    assert not safe_gate(gates().index_fill_(1, torch.tensor([3]), math.nan))
    head = torch.full((2, 40, 3), -0.5)  # a gate per head (Gated DeltaNet), [B, T, H]
    assert safe_gate(head) and not safe_gate(head.index_fill_(1, torch.arange(10, 25), -5.1))


STEEPEST = r"""
import json, math, torch
from kdn.ops.triton.safe_gate import _steepest_triton
out = {}
for shape in ((2, 33, 3, 128), (1, 5, 2, 100), (3, 7, 1, 16)):
    g = -3 * torch.rand(shape, generator=torch.Generator().manual_seed(sum(shape)))
    rows = g.view(-1, shape[-1])
    rows[1, 4], rows[2, -1], rows[3, 0] = math.nan, -math.inf, -50.0
    ours, ref = _steepest_triton(g), g.amin(-1).neg()
    out[str(shape)] = bool(torch.equal(ours.isnan(), ref.isnan()) and torch.equal(ours.nan_to_num(), ref.nan_to_num()))
    out[str(shape) + " nan row"] = bool(ours.view(-1)[1].isnan() and ours.view(-1)[2] == math.inf)
print(json.dumps(out))
"""


def test_steepest_channel_kernel_matches_amin(interpreted: dict[str, dict]) -> None:
    """The check's one-pass row minimum (used on CUDA) equals ``-g.amin(-1)`` bitwise, NaN and -inf rows included,
    for widths below, at and off a power of two."""
    res = triton_interpret.result(interpreted, "steepest")
    assert all(res.values()) and len(res) == 6, res


GATE_FWD = r"""
import itertools, json, math, sys, torch
from kdn.ops.gate import kda_gate
from kdn.ops.triton.gate import kda_gate_fwd
dev = sys.argv[1] if len(sys.argv) > 1 else "cpu"
out = {}
gen = torch.Generator().manual_seed(0)
for name, (B, T, H, K), lens in (("batch", (2, 130, 2, 32), None), ("packed", (1, 150, 2, 20), (70, 0, 1, 79)),
                                 ("short", (1, 5, 1, 16), None)):
    f = (4 * torch.randn(B, T, H, K, generator=gen)).bfloat16()
    f.view(-1, K)[3, 2] = math.nan
    A_log, dt_bias = torch.randn(H, generator=gen), torch.randn(H * K, generator=gen) - 2.0
    cu = None if lens is None else torch.tensor([0, *itertools.accumulate(lens)])
    g, gc, steep = (x.cpu() for x in kda_gate_fwd(f.to(dev), A_log.to(dev), dt_bias.to(dev),
                                                   None if cu is None else cu.to(dev)))
    ref = kda_gate(f, A_log, dt_bias, fused=False).view(B * T, H, K)  # the reference: PyTorch's softplus in FP32
    starts = [b * T for b in range(B + 1)] if lens is None else cu.tolist()
    ref_gc = torch.empty_like(ref)
    for a, b in zip(starts, starts[1:]):  # chunk-local sums from each sequence's start, in log2 units
        for c in range(a, b, 64):
            ref_gc[c:min(c + 64, b)] = ref[c:min(c + 64, b)].cumsum(0) / math.log(2)
    ref_steep = ref.amin(-1).neg()

    def gap(x, r):
        same_nan = torch.equal(x.isnan(), r.isnan())
        x, r = x.nan_to_num(), r.nan_to_num()
        return (x - r).norm().item() / r.norm().item() if same_nan else math.inf

    out[name] = {"g": gap(g.view_as(ref), ref), "gc": gap(gc.view_as(ref), ref_gc),
                 "steep": gap(steep.view(B * T, H), ref_steep), "nan_rows": int(steep.isnan().sum())}
print(json.dumps(out))
"""


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_kda_gate_pass_matches_torch(device: str, request: pytest.FixtureRequest) -> None:
    """One pass of KDA's gate (``kdn.ops.triton.gate``; on the CPU through the interpreter): the gate's output, its
    chunk-local cumulative sums in log2 units (restarting at each packed sequence, empty and one-token ones included)
    and each token's steepest channel match PyTorch to FP32 rounding; a NaN input reaches exactly its row's check."""
    if device == "cpu":
        res = triton_interpret.result(request.getfixturevalue("interpreted"), "gate_fwd")
    else:
        path = os.pathsep.join([str(triton_interpret.ROOT), os.environ.get("PYTHONPATH", "")])  # fla may come from it
        proc = subprocess.run([sys.executable, "-c", GATE_FWD, "cuda"], cwd=triton_interpret.ROOT, capture_output=True,
                              text=True, timeout=timeout_s(300), env={**os.environ, "PYTHONPATH": path})
        assert proc.returncode == 0, proc.stderr[-3000:]
        res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res.keys() == {"batch", "packed", "short"}
    for case, r in res.items():
        assert r.pop("nan_rows") == 1 and all(v < 1e-6 for v in r.values()), (case, r)


def test_isotropic_gain_refuses_a_chunk_that_splits_its_tiles() -> None:
    """The Isotropic gain sums the memory's dg over whole 32-row tiles: a chunk length that is not a multiple of
    them is refused in one line before any launch."""
    from kdn.ops.triton.gain_isotropic import _iso_gain_bwd

    x = torch.randn(1, 4, 1, 8)
    with pytest.raises(ValueError, match="mem_dg_chunk must be a positive multiple of 32"):
        _iso_gain_bwd((x,) * 9 + (None,), x[..., 0], x[0, 0], 1, 4, False, None, (x, x, x), 48)
