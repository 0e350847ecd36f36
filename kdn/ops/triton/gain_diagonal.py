"""The fused Diagonal gain (docs/math.md §3, §6): Triton kernels, their launches and the autograd node.

The channels' variances follow independent Möbius recurrences; only the gain's row sum
``s_t = r_t + sum_K p^_t k_t^2`` couples them. A program is one warp holding the whole key axis of one
(sequence, head, segment) and walks its tokens one by one, each step a few FP32 operations per channel and one warp
reduction, the next token's row loaded ahead. Sequence parallelism: three launches. The first composes each segment's
posterior maps ``M_t = [[a, w], [u a, 1 + u w]]`` (``a = exp(2g)``, ``u = mu k^2 / r``) into one 2x2 matrix per
channel, renormalised by its largest entry after every token; the second walks the segments of each sequence applying
them to ``p0`` (the entering carries and ``p_T``); the third replays each segment from its carry and writes
``kappa = p^ k / s`` (plus fla's DPLR operands ``a = exp(g) k``, ``b = -kappa`` on request). Segments:
:func:`kdn.ops.triton.utils.gain_segments` (about 4096 programs, at least 64 tokens each).

Backward: the forward keeps only the segments' carries. The adjoint
``lambda_{t-1} = a_t (e_t + lambda_t / (1 + u_t p^_t)^2)`` (``e`` the direct gradient of ``p^``) is affine in
``lambda``. The first launch replays each segment, stores every token's ``p_t`` in a transient FP32 buffer and
composes the segment's adjoint steps into one ``(P, Q)`` per channel; the second walks the segments backwards from
``dp_T`` (each segment's ``lambda`` at its last token, and ``dp0``); the third walks each segment's tokens latest
first, reading ``p_{t-1}`` back, and writes every gradient. Gradients reduced over time (``mu``) are per-program
partials summed in torch.

Packed sequences: with ``cu_seqlens [N+1]`` (``B = 1``) the grid is ``(N*H, NS)``, ``NS`` from the longest sequence;
a program reads its sequence's first row and length from ``cu_seqlens`` (``IS_VARLEN``), segments past the end do
nothing, and states and carries are per sequence.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kdn.ops.triton.utils import (
    _DIAG_WARPS,
    _chan,
    _check_gain_shapes,
    _sequence,
    _softplus,
    _softplus_grad,
    gain_segments,
)


@triton.jit
def _diag_row(k_ptr, g_ptr, w_ptr, r_ptr, row, h, offs_k, ok, H: tl.constexpr, K: tl.constexpr,
              OMEGA_SOFTPLUS: tl.constexpr):
    # token `row` (of the [B*T] or packed token axis) of head h: k (FP32), g, omega over the channels (the softplus
    # of what w_ptr holds when OMEGA_SOFTPLUS) and r; a row not to be read (ok False) gives the identity step
    # k = g = omega = 0, r = 1
    base = (row * H + h) * K + offs_k
    m = _chan(offs_k, K, ok)
    kf = tl.load(k_ptr + base, mask=m, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + base, mask=m, other=0.0)
    w = tl.load(w_ptr + base, mask=m, other=0.0).to(tl.float32)
    if OMEGA_SOFTPLUS:
        w = tl.where(m, _softplus(w), 0.0)
    r = tl.load(r_ptr + row * H + h, mask=ok, other=1.0)
    return kf, g, w, r


@triton.jit
def _diag_dkappa(dkappa_ptr, db_ptr, row, h, offs_k, ok, H: tl.constexpr, K: tl.constexpr, EMIT_AB: tl.constexpr):
    # the gradient reaching kappa at token `row` (0 unless ok): dkappa, minus db when b = -kappa was emitted too
    idx = (row * H + h) * K + offs_k
    m = _chan(offs_k, K, ok)
    dkap = tl.load(dkappa_ptr + idx, mask=m, other=0.0).to(tl.float32)
    if EMIT_AB:
        dkap = dkap - tl.load(db_ptr + idx, mask=m, other=0.0).to(tl.float32)
    return dkap


@triton.jit
def _diag_mem_grads(dk_ptr, dg_ptr, row, h, offs_k, ok, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                    ACCUMULATE: tl.constexpr):
    # the memory's gradients of k and g at token `row` in FP32 (zeros unless ACCUMULATE and ok), loaded a token
    # ahead of their use in the gain's backward, like its other per-token inputs
    if ACCUMULATE:
        idx = (row * H + h) * K + offs_k
        m = _chan(offs_k, K, ok)
        dkm = tl.load(dk_ptr + idx, mask=m, other=0.0).to(tl.float32)
        dgm = tl.load(dg_ptr + idx, mask=m, other=0.0).to(tl.float32)
    else:
        dkm = tl.zeros([BK], tl.float32)
        dgm = tl.zeros([BK], tl.float32)
    return dkm, dgm


@triton.jit
def _diag_program(cu_ptr, mu_ptr, T, SEG, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                  IS_VARLEN: tl.constexpr):
    # this program's (sequence*head bh, segment s): its head, the sequence's first row, the segment's tokens
    # [t0, t1) (empty past the sequence's end), the channel offsets and mask, and mu
    bh = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    h = bh % H
    bos, Tn = _sequence(cu_ptr, bh // H, T, IS_VARLEN)
    t0 = s * SEG
    offs_k = tl.arange(0, BK)
    return bh, s, h, bos, t0, tl.minimum(t0 + SEG, Tn), offs_k, offs_k < K, tl.load(mu_ptr + h)


@triton.jit
def _diag_predict(p, kf, g, w, r, mu):
    # one token from p_{t-1}: a = alpha^2, p^ = a p + w, k^2, the posterior's denominator 1 + u p^ and the row sum
    # s = r + sum_K p^ k^2
    a = tl.exp(2.0 * g)
    ph = a * p + w
    k2 = kf * kf
    return a, ph, k2, 1.0 + mu / r * k2 * ph, r + tl.sum(ph * k2, axis=0)


@triton.jit
def _diag_direct(dkap, ph, kf, k2, srow):
    # through kappa alone: c = sum_K dkappa kappa and the direct gradient of p^, e = (dkappa k - c k^2) / s
    c = tl.sum(dkap * ph * kf, axis=0) / srow
    return c, (dkap * kf - c * k2) / srow


@triton.jit
def _diag_seg_fwd_kernel(
    k_ptr, g_ptr, w_ptr, r_ptr, mu_ptr, seg_ptr, cu_ptr, T, NS, SEG,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr,
    OMEGA_SOFTPLUS: tl.constexpr,
):
    # one (sequence*head, segment): the product of the segment's posterior maps M_t = [[a, w], [u a, 1 + u w]]
    # per channel, renormalised by its largest entry (all entries are >= 0) -> seg [N*H, NS, 4, K]
    bh, s, h, bos, t0, t1, offs_k, mk, mu = _diag_program(cu_ptr, mu_ptr, T, SEG, H, K, BK, IS_VARLEN)
    m11 = tl.full([BK], 1.0, tl.float32)
    m12 = tl.zeros([BK], tl.float32)
    m21 = tl.zeros([BK], tl.float32)
    m22 = tl.full([BK], 1.0, tl.float32)
    kf, g, w, r = _diag_row(k_ptr, g_ptr, w_ptr, r_ptr, bos + t0, h, offs_k, t0 < t1, H, K, OMEGA_SOFTPLUS)
    for t in range(t0, t1):
        kn, gn, wn, rn = _diag_row(k_ptr, g_ptr, w_ptr, r_ptr, bos + t + 1, h, offs_k, t + 1 < t1, H, K, OMEGA_SOFTPLUS)
        a = tl.exp(2.0 * g)
        u = mu / r * kf * kf
        n11 = a * m11 + w * m21
        n12 = a * m12 + w * m22
        n21 = u * n11 + m21
        n22 = u * n12 + m22
        sc = 1.0 / tl.maximum(tl.maximum(tl.maximum(n11, n12), tl.maximum(n21, n22)), 1e-30)
        m11, m12, m21, m22 = n11 * sc, n12 * sc, n21 * sc, n22 * sc
        kf, g, w, r = kn, gn, wn, rn
    base = seg_ptr + (bh * NS + s) * 4 * K + offs_k
    tl.store(base, m11, mask=mk)
    tl.store(base + K, m12, mask=mk)
    tl.store(base + 2 * K, m21, mask=mk)
    tl.store(base + 3 * K, m22, mask=mk)


@triton.jit
def _diag_carry_fwd_kernel(
    seg_ptr, p0_ptr, carry_ptr, pT_ptr, cu_ptr, T, NS, SEG,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    # one sequence*head: each segment's entering carry p_{t0-1} (the earlier segments' maps applied to p0 in
    # order) -> carry [N*H, NS, K], and the final p_T (p0 for an empty sequence)
    bh = tl.program_id(0).to(tl.int64)
    _, Tn = _sequence(cu_ptr, bh // H, T, IS_VARLEN)
    offs_k = tl.arange(0, BK)
    mk = offs_k < K
    p = tl.load(p0_ptr + bh * K + offs_k, mask=mk, other=1.0)
    for j in range(tl.cdiv(Tn, SEG)):
        base = (bh * NS + j) * 4 * K + offs_k
        tl.store(carry_ptr + (bh * NS + j) * K + offs_k, p, mask=mk)
        m11 = tl.load(seg_ptr + base, mask=mk, other=1.0)
        m12 = tl.load(seg_ptr + base + K, mask=mk, other=0.0)
        m21 = tl.load(seg_ptr + base + 2 * K, mask=mk, other=0.0)
        m22 = tl.load(seg_ptr + base + 3 * K, mask=mk, other=1.0)
        p = (m11 * p + m12) / (m21 * p + m22)
    tl.store(pT_ptr + bh * K + offs_k, p, mask=mk)


@triton.jit
def _diag_gain_fwd_kernel(
    k_ptr, g_ptr, w_ptr, r_ptr, mu_ptr, carry_ptr, kappa_ptr, a_ptr, b_ptr, cu_ptr, T, NS, SEG,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, EMIT_AB: tl.constexpr, IS_VARLEN: tl.constexpr,
    OMEGA_SOFTPLUS: tl.constexpr,
):
    # one (sequence*head, segment): from the entering carry, token by token: p^ = a p + w, the gain
    # kappa = p^ k / (r + sum_K p^ k^2), p = p^ / (1 + u p^); kappa (and DPLR's a = exp(g) k, b = -kappa) out
    bh, s, h, bos, t0, t1, offs_k, mk, mu = _diag_program(cu_ptr, mu_ptr, T, SEG, H, K, BK, IS_VARLEN)
    p = tl.load(carry_ptr + (bh * NS + s) * K + offs_k, mask=_chan(offs_k, K, t0 < t1), other=1.0)
    kf, g, w, r = _diag_row(k_ptr, g_ptr, w_ptr, r_ptr, bos + t0, h, offs_k, t0 < t1, H, K, OMEGA_SOFTPLUS)
    for t in range(t0, t1):
        kn, gn, wn, rn = _diag_row(k_ptr, g_ptr, w_ptr, r_ptr, bos + t + 1, h, offs_k, t + 1 < t1, H, K, OMEGA_SOFTPLUS)
        _, ph, _, d, srow = _diag_predict(p, kf, g, w, r, mu)
        p = ph / d
        kappa = ph * kf / srow
        idx = ((bos + t) * H + h) * K + offs_k
        tl.store(kappa_ptr + idx, kappa.to(kappa_ptr.dtype.element_ty), mask=mk)
        if EMIT_AB:
            tl.store(a_ptr + idx, (tl.exp(g) * kf).to(a_ptr.dtype.element_ty), mask=mk)
            tl.store(b_ptr + idx, (-kappa).to(b_ptr.dtype.element_ty), mask=mk)
        kf, g, w, r = kn, gn, wn, rn


@triton.jit
def _diag_seg_bwd_kernel(
    k_ptr, g_ptr, w_ptr, r_ptr, mu_ptr, carry_ptr, dkappa_ptr, db_ptr, post_ptr, seg_ptr, cu_ptr, T, NS, SEG,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, EMIT_AB: tl.constexpr, IS_VARLEN: tl.constexpr,
    OMEGA_SOFTPLUS: tl.constexpr,
):
    # one (sequence*head, segment): replays the segment from its carry, stores each token's posterior p_t in post
    # [B,T,H,K] (read back in reversed time by the last launch), and composes the adjoint steps
    # lambda_{t-1} = A_t lambda_t + B_t over the segment into lambda_{t0-1} = P lambda_{t1-1} + Q
    # -> seg [N*H, NS, 2, K]
    bh, s, h, bos, t0, t1, offs_k, mk, mu = _diag_program(cu_ptr, mu_ptr, T, SEG, H, K, BK, IS_VARLEN)
    p = tl.load(carry_ptr + (bh * NS + s) * K + offs_k, mask=_chan(offs_k, K, t0 < t1), other=1.0)
    P = tl.full([BK], 1.0, tl.float32)
    Q = tl.zeros([BK], tl.float32)
    kf, g, w, r = _diag_row(k_ptr, g_ptr, w_ptr, r_ptr, bos + t0, h, offs_k, t0 < t1, H, K, OMEGA_SOFTPLUS)
    dkap = _diag_dkappa(dkappa_ptr, db_ptr, bos + t0, h, offs_k, t0 < t1, H, K, EMIT_AB)
    for t in range(t0, t1):
        kn, gn, wn, rn = _diag_row(k_ptr, g_ptr, w_ptr, r_ptr, bos + t + 1, h, offs_k, t + 1 < t1, H, K, OMEGA_SOFTPLUS)
        dkn = _diag_dkappa(dkappa_ptr, db_ptr, bos + t + 1, h, offs_k, t + 1 < t1, H, K, EMIT_AB)
        a, ph, k2, d, srow = _diag_predict(p, kf, g, w, r, mu)
        p = ph / d
        tl.store(post_ptr + ((bos + t) * H + h) * K + offs_k, p, mask=mk)
        _, e = _diag_direct(dkap, ph, kf, k2, srow)
        Q += P * a * e
        P = P * a / (d * d)
        kf, g, w, r, dkap = kn, gn, wn, rn, dkn
    base = seg_ptr + (bh * NS + s) * 2 * K + offs_k
    tl.store(base, P, mask=mk)
    tl.store(base + K, Q, mask=mk)


@triton.jit
def _diag_carry_bwd_kernel(
    seg_ptr, dpT_ptr, lam_ptr, dp0_ptr, cu_ptr, T, NS, SEG,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    # one sequence*head: lambda at each segment's last token (the later segments' adjoint maps applied to dp_T,
    # latest first) -> lam [N*H, NS, K], and dp0 = lambda before the first token
    bh = tl.program_id(0).to(tl.int64)
    _, Tn = _sequence(cu_ptr, bh // H, T, IS_VARLEN)
    offs_k = tl.arange(0, BK)
    mk = offs_k < K
    lam = tl.load(dpT_ptr + bh * K + offs_k, mask=mk, other=0.0)
    n = tl.cdiv(Tn, SEG)
    for j in range(n):
        s = n - 1 - j
        tl.store(lam_ptr + (bh * NS + s) * K + offs_k, lam, mask=mk)
        base = seg_ptr + (bh * NS + s) * 2 * K + offs_k
        lam = tl.load(base, mask=mk, other=1.0) * lam + tl.load(base + K, mask=mk, other=0.0)
    tl.store(dp0_ptr + bh * K + offs_k, lam, mask=mk)


@triton.jit
def _diag_gain_bwd_kernel(
    k_ptr, g_ptr, w_ptr, r_ptr, mu_ptr, A_ptr, carry_ptr, post_ptr, lam_ptr, dkappa_ptr, da_ptr, db_ptr,
    dk_mem_ptr, dg_mem_ptr, dk_ptr, dg_ptr, dw_ptr, dr_ptr, dmu_ptr, dA_ptr, dbias_ptr, cu_ptr, T, NS, SEG,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, EMIT_AB: tl.constexpr, IS_VARLEN: tl.constexpr,
    OMEGA_SOFTPLUS: tl.constexpr, GATE: tl.constexpr, ACCUMULATE: tl.constexpr, DG_CHUNK: tl.constexpr,
):
    # one (sequence*head, segment), latest token first: p_{t-1} from post (the carry at the segment's first
    # token), p^ and the row sums again, then the gradients and lambda_{t-1} = a (e + lambda_t / (1 + u p^)^2);
    # ACCUMULATE: dk and dg also add the memory's gradients of the same k and g (dk_mem, dg_mem [B,T,H,K]), in FP32,
    # prefetched a token ahead; DG_CHUNK > 0: dg_mem holds per-token terms whose reverse cumulative sum within chunks
    # of DG_CHUNK tokens is the memory's gradient of g (the sum fla's intra-chunk backward ends with), kept here as a
    # running sum that starts from the terms of the segment's last chunk after the segment; GATE: dg_ptr takes the
    # gradient of the gate's input f, and the program's partial sums of those of A_log (sum dg g) and dt_bias go to
    # dA [N*H, NS] and dbias [N*H, NS, K]
    bh, s, h, bos, t0, t1, offs_k, mk, mu = _diag_program(cu_ptr, mu_ptr, T, SEG, H, K, BK, IS_VARLEN)
    gA = tl.exp(tl.load(A_ptr + h).to(tl.float32)) if GATE else 1.0
    ok = t0 < t1
    lam = tl.load(lam_ptr + (bh * NS + s) * K + offs_k, mask=_chan(offs_k, K, ok), other=0.0)
    p_in = tl.load(carry_ptr + (bh * NS + s) * K + offs_k, mask=_chan(offs_k, K, ok), other=1.0)
    dmu = tl.zeros([BK], tl.float32)
    dA = tl.zeros([BK], tl.float32)
    dbias = tl.zeros([BK], tl.float32)
    last = t1 - 1
    kf, g, w, r = _diag_row(k_ptr, g_ptr, w_ptr, r_ptr, bos + last, h, offs_k, ok, H, K, OMEGA_SOFTPLUS)
    dkap = _diag_dkappa(dkappa_ptr, db_ptr, bos + last, h, offs_k, ok, H, K, EMIT_AB)
    pp = tl.load(post_ptr + ((bos + last - 1) * H + h) * K + offs_k, mask=_chan(offs_k, K, last > t0), other=1.0)
    dkm, dgm = _diag_mem_grads(dk_mem_ptr, dg_mem_ptr, bos + last, h, offs_k, ok, H, K, BK, ACCUMULATE)
    dgs = tl.zeros([BK], tl.float32)
    if DG_CHUNK > 0:
        Tn = _sequence(cu_ptr, bh // H, T, IS_VARLEN)[1]
        for t in range(t1, tl.minimum(tl.cdiv(t1, DG_CHUNK) * DG_CHUNK, Tn)):
            dgs += tl.load(dg_mem_ptr + ((bos + t) * H + h) * K + offs_k, mask=mk, other=0.0).to(tl.float32)
    for j in range(t1 - t0):
        t = t1 - 1 - j
        nok = t - 1 >= t0
        kn, gn, wn, rn = _diag_row(k_ptr, g_ptr, w_ptr, r_ptr, bos + t - 1, h, offs_k, nok, H, K, OMEGA_SOFTPLUS)
        dkn = _diag_dkappa(dkappa_ptr, db_ptr, bos + t - 1, h, offs_k, nok, H, K, EMIT_AB)
        ppn = tl.load(post_ptr + ((bos + t - 2) * H + h) * K + offs_k, mask=_chan(offs_k, K, t - 2 >= t0), other=1.0)
        dkmn, dgmn = _diag_mem_grads(dk_mem_ptr, dg_mem_ptr, bos + t - 1, h, offs_k, nok, H, K, BK, ACCUMULATE)
        p_prev = tl.where(t > t0, pp, p_in)
        a, ph, k2, d, srow = _diag_predict(p_prev, kf, g, w, r, mu)
        u = mu / r * k2
        cc = 1.0 / (d * d)
        c, e = _diag_direct(dkap, ph, kf, k2, srow)
        dph = e + cc * lam
        du = -lam * ph * ph * cc
        dk = (dkap * ph - 2.0 * c * ph * kf) / srow + 2.0 * mu / r * du * kf
        dg = 2.0 * a * p_prev * dph
        idx = ((bos + t) * H + h) * K + offs_k
        if EMIT_AB:
            da = tl.load(da_ptr + idx, mask=mk, other=0.0).to(tl.float32) * tl.exp(g)
            dk += da
            dg += da * kf
        if DG_CHUNK > 0:
            dgs = tl.where(t % DG_CHUNK == DG_CHUNK - 1, 0.0, dgs) + dgm
            dgm = dgs
        dk += dkm
        dg += dgm
        tl.store(dk_ptr + idx, dk.to(dk_ptr.dtype.element_ty), mask=mk)
        if GATE:  # g = -gA softplus(x), x = f + dt_bias: dg/dx = -gA sigmoid(x), sigmoid(x) from softplus(x) = -g / gA
            dA += dg * g
            dg = -gA * dg * _softplus_grad(-g / gA)
            dbias += dg
        tl.store(dg_ptr + idx, dg.to(dg_ptr.dtype.element_ty), mask=mk)
        if OMEGA_SOFTPLUS:
            dw = dph * _softplus_grad(w)
        else:
            dw = dph
        tl.store(dw_ptr + idx, dw.to(dw_ptr.dtype.element_ty), mask=mk)
        tl.store(dr_ptr + (bos + t) * H + h, -c / srow - tl.sum(du * u, axis=0) / r)
        dmu += du * k2 / r
        lam = a * dph
        kf, g, w, r, dkap, pp, dkm, dgm = kn, gn, wn, rn, dkn, ppn, dkmn, dgmn
    tl.store(dmu_ptr + bh * NS + s, tl.sum(dmu, axis=0))
    if GATE:
        tl.store(dA_ptr + bh * NS + s, tl.sum(dA, axis=0))
        tl.store(dbias_ptr + (bh * NS + s) * K + offs_k, dbias, mask=mk)


def _diag_tiles(H: int, K: int, cu_seqlens: Tensor | None) -> dict[str, int | bool]:
    """The Diagonal gain kernels' shared launch parameters."""
    return {"H": H, "K": K, "BK": triton.next_power_of_2(K), "IS_VARLEN": cu_seqlens is not None,
            "num_warps": _DIAG_WARPS}


def _diag_gain_fwd(
    k: Tensor, g: Tensor, omega: Tensor, r: Tensor, mu: Tensor, p0: Tensor, out_dtype: torch.dtype, emit_ab: bool,
    cu_seqlens: Tensor | None, N: int, L: int, omega_softplus: bool, A_log: Tensor | None = None,
    segment_size: int | None = None,
) -> tuple[tuple[Tensor, ...], tuple[Tensor | None, ...]]:
    """The Diagonal gain's forward launches: ``((kappa, [a, b,] p_T), saved)``, ``saved`` what
    :func:`_diag_gain_bwd` takes (``k``, FP32 gates, the carries ``[N*H, NS, K]``, ``cu_seqlens``, ``A_log``).
    ``A_log [H]``: ``g`` is the output of KDA's gate with these ``A_log`` (:func:`kdn.ops.triton.gate.kda_gate_fwd`),
    whose backward the gain's takes on (:func:`_diag_gain_bwd`). ``segment_size``: as in
    :func:`kdn.ops.triton.utils.gain_segments`."""
    B, T, H, K = k.shape
    k = k.contiguous()
    omega = omega.contiguous() if omega_softplus else omega.float().contiguous()
    g, r, mu, p0 = (x.float().contiguous() for x in (g, r, mu, p0))
    SEG, NS = gain_segments(False, N * H, L, segment_size)
    kappa = k.new_empty(B, T, H, K, dtype=out_dtype)
    a, b = (torch.empty_like(kappa), torch.empty_like(kappa)) if emit_ab else (kappa, kappa)
    carry = p0.new_empty(N * H, NS, K)
    pT = torch.empty_like(p0)
    seg = p0.new_empty(N * H, NS, 4, K)
    tiles = _diag_tiles(H, K, cu_seqlens)
    act = {"OMEGA_SOFTPLUS": omega_softplus}
    _diag_seg_fwd_kernel[(N * H, NS)](k, g, omega, r, mu, seg, cu_seqlens, L, NS, SEG, **tiles, **act)
    _diag_carry_fwd_kernel[(N * H,)](seg, p0, carry, pT, cu_seqlens, L, NS, SEG, **tiles)
    _diag_gain_fwd_kernel[(N * H, NS)](k, g, omega, r, mu, carry, kappa, a, b, cu_seqlens, L, NS, SEG,
                                       EMIT_AB=emit_ab, **tiles, **act)
    saved = (k, g, omega, r, mu, carry, cu_seqlens, None if A_log is None else A_log.float().contiguous())
    return (kappa, a, b, pT) if emit_ab else (kappa, pT), saved


def _diag_gain_bwd(
    saved: tuple[Tensor | None, ...], grads: tuple[Tensor, ...], emit_ab: bool, N: int, L: int,
    omega_softplus: bool, need_dmu: bool, mem_grads: tuple[Tensor, Tensor] | None = None,
    f_dtype: torch.dtype = torch.float32, segment_size: int | None = None, mem_dg_chunk: int = 0,
) -> tuple[Tensor | None, ...]:
    """The Diagonal gain's backward launches: ``(dk, dg, domega, dr, dmu, dp0, dgate)`` from ``saved``
    (:func:`_diag_gain_fwd`) and the gradients of its outputs ``grads = (dkappa, [da, db,] dp_T)``.
    ``mem_grads = (dk_mem, dg_mem)``, ``[B,T,H,K]`` each (any float dtype): further gradients of the same ``k``
    and ``g``, added in the last launch (in FP32; ``dk`` is stored in ``k``'s dtype); with ``mem_dg_chunk > 0``,
    ``dg_mem`` holds per-token terms whose reverse cumulative sums within chunks of that many tokens (counted from
    each sequence's start) are the gradient, summed in that launch. ``dmu`` is ``None``
    unless ``need_dmu``. When ``g`` came from KDA's gate (``A_log`` saved, :func:`_diag_gain_fwd`), ``dg`` is that of
    the gate's input ``f`` (in ``f_dtype``) and ``dgate = (dA_log [H], ddt_bias [H*K])`` (FP32); ``None`` otherwise.
    ``segment_size``: the forward's."""
    k, g, omega, r, mu, carry, cu_seqlens, A_log = saved
    gate = A_log is not None
    H, K = k.shape[2:]
    SEG, NS = gain_segments(False, N * H, L, segment_size)
    dkappa, *rest, dpT = (x.contiguous() for x in grads)
    da, db = rest if emit_ab else (dkappa, dkappa)
    dk_mem, dg_mem = (x.contiguous() for x in mem_grads) if mem_grads is not None else (dkappa, dkappa)
    dk = torch.empty_like(k)
    dg = torch.empty_like(g, dtype=f_dtype if gate else g.dtype)
    dw = torch.empty_like(omega)  # of omega's input when omega_softplus
    dr = torch.empty_like(r)
    dp0 = carry.new_empty(N, H, K)
    dmu = carry.new_empty(N, H, NS)
    dA, dbias = (carry.new_empty(N, H, NS), carry.new_empty(N, H, NS, K)) if gate else (dmu, dmu)
    flags = {"EMIT_AB": emit_ab, "OMEGA_SOFTPLUS": omega_softplus, "GATE": gate, "ACCUMULATE": mem_grads is not None,
             "DG_CHUNK": mem_dg_chunk if mem_grads is not None else 0}
    post = torch.empty_like(g)
    seg = carry.new_empty(N * H, NS, 2, K)
    lam = torch.empty_like(carry)
    tiles = _diag_tiles(H, K, cu_seqlens)
    act = {"EMIT_AB": emit_ab, "OMEGA_SOFTPLUS": omega_softplus}
    _diag_seg_bwd_kernel[(N * H, NS)](k, g, omega, r, mu, carry, dkappa, db, post, seg, cu_seqlens, L, NS,
                                      SEG, **tiles, **act)
    _diag_carry_bwd_kernel[(N * H,)](seg, dpT.float(), lam, dp0, cu_seqlens, L, NS, SEG, **tiles)
    _diag_gain_bwd_kernel[(N * H, NS)](k, g, omega, r, mu, A_log if gate else mu, carry, post, lam, dkappa, da,
                                       db, dk_mem, dg_mem, dk, dg, dw, dr, dmu, dA, dbias, cu_seqlens, L, NS, SEG,
                                       **tiles, **flags)
    dgate = (dA.sum((0, 2)), dbias.sum((0, 2)).view(-1)) if gate else None
    return dk, dg, dw, dr, dmu.sum((0, 2)) if need_dmu else None, dp0, dgate


class _DiagonalGain(torch.autograd.Function):
    """``(k, g, omega, r, mu, p0) -> (kappa, [a, b,] p_T)``: the fused Diagonal gain, forward and backward.

    Each direction is three launches: the segments' compositions on a ``(N*H, NS)`` grid, the walk over the
    segments (``N*H`` programs), then the segments again. ``N`` sequences (the batch rows, or the packed
    sequences of ``cu_seqlens``), ``NS`` from the longest ``L``. The forward keeps the segments' entering carries;
    the backward holds every token's ``p`` in a transient FP32 ``[B,T,H,K]`` buffer.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, k: Tensor, g: Tensor, omega: Tensor, r: Tensor, mu: Tensor,
        p0: Tensor, out_dtype: torch.dtype, emit_ab: bool, cu_seqlens: Tensor | None, N: int, L: int,
        omega_softplus: bool, segment_size: int | None,
    ) -> tuple[Tensor, ...]:
        outs, saved = _diag_gain_fwd(k, g, omega, r, mu, p0, out_dtype, emit_ab, cu_seqlens, N, L, omega_softplus,
                                     segment_size=segment_size)
        ctx.save_for_backward(*saved)
        ctx.emit_ab, ctx.seqs, ctx.omega_softplus, ctx.segment_size = emit_ab, (N, L), omega_softplus, segment_size
        return outs

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, *grads: Tensor) -> tuple[Tensor | None, ...]:
        dk, dg, dw, dr, dmu, dp0, _ = _diag_gain_bwd(ctx.saved_tensors, grads, ctx.emit_ab, *ctx.seqs,
                                                     ctx.omega_softplus, ctx.needs_input_grad[4],
                                                     segment_size=ctx.segment_size)
        return dk, dg, dw, dr, dmu, dp0, *(None,) * 7


def diagonal_gain(
    k: Tensor, g: Tensor, omega: Tensor, r: Tensor, mu: Tensor, p0: Tensor, out_dtype: torch.dtype = torch.float32,
    *, cu_seqlens: Tensor | None = None, omega_softplus: bool = False, segment_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Fused Triton Diagonal gains: ``kappa [B,T,H,K]`` in ``out_dtype`` and ``p_T [N,H,K]`` (FP32).

    ``k: [B,T,H,K]`` (any float dtype), ``g, omega: [B,T,H,K]``, ``r: [B,T,H]``, ``mu: [H]``, ``p0: [N,H,K]``;
    gates, ``mu`` and ``p0`` are used in FP32. ``N = B``, or with ``cu_seqlens [N+1]`` (int32/int64 offsets of
    packed sequences along T, ``B = 1``) the number of sequences, each with its own ``p0`` and ``p_T``.
    ``omega_softplus``: ``omega`` holds the process noise before its softplus (any float dtype), applied in the
    kernels (FP32), which saves a pass over ``[B,T,H,K]`` each way. ``segment_size``: tokens per segment of the
    sequence-parallel scan instead of :func:`kdn.ops.triton.utils.gain_segments`' rule.
    Differentiable in every tensor input.

    Example::

        kappa, pT = diagonal_gain(k, g, omega, r, mu, p0, torch.bfloat16)  # CUDA tensors
    """
    N, L = _check_gain_shapes(k, g, omega, r, mu, p0, False, cu_seqlens)
    return _DiagonalGain.apply(k, g, omega, r, mu, p0, out_dtype, False, cu_seqlens, N, L, omega_softplus,
                               segment_size)


def diagonal_gain_dplr(
    k: Tensor, g: Tensor, omega: Tensor, r: Tensor, mu: Tensor, p0: Tensor, out_dtype: torch.dtype = torch.float32,
    *, cu_seqlens: Tensor | None = None, omega_softplus: bool = False, segment_size: int | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`diagonal_gain` plus fla's DPLR operands from the same kernel: ``(kappa, a = exp(g) k, b = -kappa,
    p_T)``, the first three ``[B,T,H,K]`` in ``out_dtype``."""
    N, L = _check_gain_shapes(k, g, omega, r, mu, p0, False, cu_seqlens)
    return _DiagonalGain.apply(k, g, omega, r, mu, p0, out_dtype, True, cu_seqlens, N, L, omega_softplus,
                               segment_size)
