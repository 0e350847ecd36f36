"""The CUDA backend of KDN: fused Triton gain kernels plus fla's chunk memory kernels (docs/math.md §3, §4, §6).

Diagonal gain (ours, Triton): the channels' variances follow independent Möbius recurrences; only the gain's row
sum ``s_t = r_t + sum_K p^_t k_t^2`` couples them. A program is one warp holding the whole key axis of one
(sequence, head, segment) and walks its tokens one by one, each step a few FP32 operations per channel and one
warp reduction, the next token's row loaded ahead. Sequence parallelism: three launches. The first composes each
segment's posterior maps ``M_t = [[a, w], [u a, 1 + u w]]`` (``a = exp(2g)``, ``u = mu k^2 / r``) into one
2x2 matrix per channel, renormalised by its largest entry after every token; the second walks the segments of
each sequence applying them to ``p0`` (the entering carries and ``p_T``); the third replays each segment from its
carry and writes ``kappa = p^ k / s`` (plus fla's DPLR operands ``a = exp(g) k``, ``b = -kappa`` on request).
Segments: :func:`gain_segments` (about 4096 programs, at least 64 tokens each).

Diagonal backward: the forward keeps only the segments' carries. The adjoint
``lambda_{t-1} = a_t (e_t + lambda_t / (1 + u_t p^_t)^2)`` (docs/math.md §6, ``e`` the direct gradient of ``p^``) is
affine in ``lambda``. The first launch replays each segment, stores every token's ``p_t`` in a transient FP32
buffer and composes the segment's adjoint steps into one ``(P, Q)`` per channel; the second walks the segments
backwards from ``dp_T`` (each segment's ``lambda`` at its last token, and ``dp0``); the third walks each
segment's tokens latest first, reading ``p_{t-1}`` back, and writes every gradient. Gradients reduced over
time (``mu``) are per-program partials summed in torch.

Isotropic gain: a program holds one (sequence, head) segment and walks it in chunks of ``BT`` tokens; inside a
chunk the scalar Möbius matrices are composed with ``tl.associative_scan`` (renormalised, FP32), pairing each
prediction with the previous token's update, ``N_t = [[a_t + w_t u_{t-1}, w_t], [u_{t-1}, 1]]``, so the scan
emits ``b^_t`` directly. Its first launch composes the segments and stores the per-token
``abar = mean_K exp(2g)`` and ``||k||^2``; the second applies the earlier segments' maps to ``b0`` and runs the
segment's chunks. Its backward keeps one carry per chunk; each chunk recomputes ``b^`` in time order, passes it
through a per-program scratch buffer to read it back reversed (``tl.associative_scan(reverse=True)`` is avoided:
triton-lang/triton#4362), and runs the affine adjoint as a forward scan over the reversed rows.

Packed sequences: with ``cu_seqlens [N+1]`` (``B = 1``) the grid is ``(N*H, NS)``, ``NS`` from the longest
sequence; a program reads its sequence's first row and length from ``cu_seqlens`` (``IS_VARLEN``), segments
past the end do nothing, and states, carries and scratch are per sequence. The segment holding a sequence's
last token writes its final state (segment 0 for an empty sequence, whose state passes through).

Memory: both KDNs run fla's asymmetric chunk-64 kernels (and our WY backward, ``kdn.triton_wy``) with ``kappa`` on
the write side and ``k`` on the read side; Isotropic KDN's ``kappa = k`` with the kernels' ``beta`` = the KDN gain
makes it KDA's rule (fla's ``chunk_kda``), which is how the KDA baseline runs too (:func:`kda`). Diagonal KDN can
also map (``DIAG_MEMORY = "dplr"``; ``"asym"`` is the default) onto ``chunk_dplr_delta_rule(q, k=kappa, v, a=exp(g) k,
b=-kappa, gk=g)``. With ``"asym"`` the Diagonal gain and memory are one autograd node (:class:`_DiagonalKDN`): the
gain's last backward launch adds the memory's gradients of ``k`` and ``g`` to its own, sparing autograd two
``[B,T,H,K]`` sums. Given KDA's gate input (``gate=``), that node makes ``g``, the memory's chunk sums and the
check below in one pass (:mod:`kdn.triton_gate`), and the same launch takes ``dg`` through the gate. The memory's
forward keeps its WY terms and chunk states for the backward unless :data:`RECOMPUTE_STATES`.
fla's chunk-64 kernels (``chunk_kda``, the asymmetric ones) have two paths for the 16 x 16 diagonal blocks of each
chunk: a token-by-token loop with exact pairwise decays, and tensor-core matmuls (``safe_gate``) that split each
decay ``exp(G_i - G_j)`` into ``exp(G_i - C) exp(C - G_j)``, exact while those factors stay inside FP32's range.
:func:`safe_gate` checks that envelope on the actual gates at every call, so the faster path is taken exactly when
it is exact.

Decoding: ``fused_recurrent`` runs gain and memory token by token in one kernel, the state in registers.
"""
from __future__ import annotations

from collections import Counter

import torch
import triton
import triton.language as tl
from torch import Tensor

from kdn._validate import check_cu_seqlens
from kdn.modules import kda_gate

State = tuple[Tensor, Tensor]


@triton.jit
def _mobius_combine(a11, a12, a21, a22, b11, b12, b21, b22):
    # a: the earlier prefix, b: the later element; returns b @ a rescaled by its max-abs entry
    c11 = b11 * a11 + b12 * a21
    c12 = b11 * a12 + b12 * a22
    c21 = b21 * a11 + b22 * a21
    c22 = b21 * a12 + b22 * a22
    s = tl.maximum(tl.maximum(tl.abs(c11), tl.abs(c12)), tl.maximum(tl.abs(c21), tl.abs(c22)))
    s = tl.maximum(s, 1e-30)
    return c11 / s, c12 / s, c21 / s, c22 / s


@triton.jit
def _adjoint_combine(aP, aQ, aR, aS, bP, bQ, bR, bS):
    # maps x -> (P x + Q, R x + S) that read lambda_t and give (lambda_{t-1}, lambda_t); a is applied
    # first (the later token), b next; returns b o a
    return bP * aP, bP * aQ + bQ, bR * aP, bR * aQ + bS


@triton.jit
def _affine_combine(aP, aQ, bP, bQ):
    # maps x -> P x + Q in time order (a: the earlier token, b: the later one); the adjoint runs backward in
    # time, so b is applied first: returns a o b
    return aP * bP, aP * bQ + aQ


@triton.jit
def _seg_chunks(s, SEGC, T, BT: tl.constexpr):
    # the chunks [c0, c1) of segment s of a sequence of T tokens (empty past its end)
    c0 = s * SEGC
    return c0, tl.minimum(c0 + SEGC, tl.cdiv(T, BT))


@triton.jit
def _sequence(cu_ptr, b, T, IS_VARLEN: tl.constexpr):
    # sequence b: the row of its first token and its length; packed sequences read cu_seqlens, batch rows have
    # T tokens each
    if IS_VARLEN:
        bos = tl.load(cu_ptr + b).to(tl.int64)
        Tn = tl.load(cu_ptr + b + 1).to(tl.int64) - bos
    else:
        bos = b * T
        Tn = T
    return bos, Tn


@triton.jit
def _last_segment(T, SEGC, BT: tl.constexpr):
    # the segment holding the last token of a sequence of T tokens (0 for an empty sequence)
    return tl.maximum(tl.cdiv(tl.cdiv(T, BT), SEGC), 1) - 1


@triton.jit
def _chan(offs_k, K: tl.constexpr, ok):
    # the channel mask of a row read only when ok (a comparison: the interpreter rejects a vector & a scalar mask)
    return offs_k < tl.where(ok, K, 0)


@triton.jit
def _softplus(x):
    # log(1 + exp(x)) in FP32: no overflow, and a series for log1p where exp(-|x|) is small
    e = tl.exp(-tl.abs(x))
    return tl.maximum(x, 0.0) + tl.where(e < 1e-2, e * (1.0 - e * (0.5 - e * (1.0 / 3.0 - 0.25 * e))),
                                         tl.log(1.0 + e))


@triton.jit
def _softplus_grad(w):
    # d softplus(x) / dx = sigmoid(x) = 1 - exp(-w) from w = softplus(x); a series where w is small
    return tl.where(w < 1e-2, w * (1.0 - w * (0.5 - w * (1.0 / 6.0 - w / 24.0))), 1.0 - tl.exp(-w))


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
    OMEGA_SOFTPLUS: tl.constexpr, GATE: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    # one (sequence*head, segment), latest token first: p_{t-1} from post (the carry at the segment's first
    # token), p^ and the row sums again, then the gradients and lambda_{t-1} = a (e + lambda_t / (1 + u p^)^2);
    # ACCUMULATE: dk and dg also add the memory's gradients of the same k and g (dk_mem, dg_mem [B,T,H,K]), in FP32,
    # prefetched a token ahead; GATE: dg_ptr takes the gradient of the gate's input f, and the program's partial sums
    # of those of A_log (sum dg g) and dt_bias go to dA [N*H, NS] and dbias [N*H, NS, K]
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


@triton.jit
def _iso_chunk(abar_ptr, n_ptr, w_ptr, r_ptr, mu, p, bos, h, t0, T, H: tl.constexpr, K: tl.constexpr,
               BT: tl.constexpr):
    # [BT] rows of the sequence starting at row bos (T tokens long) in time order from the carry p = b_{t0-1},
    # from the per-token abar and ||k||^2: b^, b after each token, u, r, n, abar, the rows' offsets and mask;
    # rows past T are identities
    ar = tl.arange(0, BT)
    rows = t0 + ar
    mt = rows < T
    tok = (bos + rows) * H + h
    mp = (rows > t0) & mt
    r = tl.load(r_ptr + tok, mask=mt, other=1.0)
    n = tl.load(n_ptr + tok, mask=mt, other=0.0)
    u = mu * n / (K * r)
    up = mu * tl.load(n_ptr + tok - H, mask=mp, other=0.0) / (K * tl.load(r_ptr + tok - H, mask=mp, other=1.0))
    abar = tl.load(abar_ptr + tok, mask=mt, other=1.0)
    w = tl.load(w_ptr + tok, mask=mt, other=0.0)
    P11, P12, P21, P22 = tl.associative_scan(
        (abar + w * up, w, up, tl.full([BT], 1.0, tl.float32)), 0, _mobius_combine
    )
    bhat = (P11 * p + P12) / (P21 * p + P22)
    post = bhat / (1.0 + u * bhat)
    return bhat, post, u, r, n, abar, tok, mt


@triton.jit
def _iso_adjoint_rows(bhat, u, r, n, dbeta):
    # per row: the direct gradient e of b^, the row sum s and cc = db/db^
    s = r + bhat * n
    d = 1.0 + u * bhat
    return dbeta * r / (s * s), s, 1.0 / (d * d)


@triton.jit
def _iso_seg_fwd_kernel(
    k_ptr, g_ptr, w_ptr, r_ptr, mu_ptr, abar_ptr, n_ptr, seg_ptr, cu_ptr, T, NS, SEGC,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    # one (sequence*head, segment): abar = mean_K exp(2g) and n = ||k||^2 per token, and the product of the
    # segment's posterior maps, renormalised -> seg [N*H, NS, 4] (identities past the sequence's end)
    bh = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    b, h = bh // H, bh % H
    bos, Tn = _sequence(cu_ptr, b, T, IS_VARLEN)
    offs_k = tl.arange(0, BK)
    mk = offs_k < K
    ar = tl.arange(0, BT)
    mu = tl.load(mu_ptr + h)
    m11, m12, m21, m22 = 1.0, 0.0, 0.0, 1.0
    c0, c1 = _seg_chunks(s, SEGC, Tn, BT)
    for c in range(c0, c1):
        rows = c * BT + ar
        mt = rows < Tn
        tok = (bos + rows) * H + h
        m = mt[:, None] & mk[None, :]
        idx = tok[:, None] * K + offs_k[None, :]
        kf = tl.load(k_ptr + idx, mask=m, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + idx, mask=m, other=0.0)
        abar = tl.sum(tl.where(mk[None, :], tl.exp(2.0 * g), 0.0), axis=1) / K  # 1 past T: identities
        n = tl.sum(kf * kf, axis=1)
        tl.store(abar_ptr + tok, abar, mask=mt)
        tl.store(n_ptr + tok, n, mask=mt)
        w = tl.load(w_ptr + tok, mask=mt, other=0.0)
        u = mu * n / (K * tl.load(r_ptr + tok, mask=mt, other=1.0))
        P11, P12, P21, P22 = tl.associative_scan((abar, w, u * abar, 1.0 + u * w), 0, _mobius_combine)
        last = ar == BT - 1
        m11, m12, m21, m22 = _mobius_combine(
            m11, m12, m21, m22, tl.sum(tl.where(last, P11, 0.0), axis=0), tl.sum(tl.where(last, P12, 0.0), axis=0),
            tl.sum(tl.where(last, P21, 0.0), axis=0), tl.sum(tl.where(last, P22, 0.0), axis=0),
        )
    base = seg_ptr + (bh * NS + s) * 4
    tl.store(base, m11)
    tl.store(base + 1, m12)
    tl.store(base + 2, m21)
    tl.store(base + 3, m22)


@triton.jit
def _iso_gain_fwd_kernel(
    w_ptr, r_ptr, mu_ptr, b0_ptr, abar_ptr, n_ptr, seg_ptr, beta_ptr, carry_ptr, bT_ptr, cu_ptr, T, NS, SEGC,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    # one (sequence*head, segment): the earlier segments' maps give the entering carry, then the segment's
    # chunks; T is the longest sequence's length (the carry's layout), segments past a sequence's end do nothing
    bh = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    b, h = bh // H, bh % H
    bos, Tn = _sequence(cu_ptr, b, T, IS_VARLEN)
    s_last = _last_segment(Tn, SEGC, BT)
    ar = tl.arange(0, BT)
    mu = tl.load(mu_ptr + h)
    p = tl.load(b0_ptr + bh)
    for j in range(tl.where(s <= s_last, s, 0)):
        base = seg_ptr + (bh * NS + j) * 4
        p = (tl.load(base) * p + tl.load(base + 1)) / (tl.load(base + 2) * p + tl.load(base + 3))
    NT = tl.cdiv(T, BT)
    c0, c1 = _seg_chunks(s, SEGC, Tn, BT)
    for c in range(c0, c1):
        t0 = c * BT
        tl.store(carry_ptr + bh * NT + c, p)
        bhat, post, _, r, n, _, tok, mt = _iso_chunk(abar_ptr, n_ptr, w_ptr, r_ptr, mu, p, bos, h, t0, Tn, H, K, BT)
        tl.store(beta_ptr + tok, (bhat / (r + bhat * n)).to(beta_ptr.dtype.element_ty), mask=mt)
        p = tl.sum(tl.where(ar == tl.minimum(Tn - t0, BT) - 1, post, 0.0), axis=0)
    if s == s_last:
        tl.store(bT_ptr + bh, p)


@triton.jit
def _iso_seg_bwd_kernel(
    w_ptr, r_ptr, mu_ptr, abar_ptr, n_ptr, carry_ptr, dbeta_ptr, seg_ptr, cu_ptr, T, NS, SEGC,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    # one (sequence*head, segment): the composition of the segment's adjoint steps -> seg [N*H, NS, 2] (A, B)
    bh = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    b, h = bh // H, bh % H
    bos, Tn = _sequence(cu_ptr, b, T, IS_VARLEN)
    last = tl.arange(0, BT) == BT - 1
    mu = tl.load(mu_ptr + h)
    A, Bv = 1.0, 0.0
    NT = tl.cdiv(T, BT)
    c0, c1 = _seg_chunks(s, SEGC, Tn, BT)
    for c in range(c0, c1):
        p = tl.load(carry_ptr + bh * NT + c)
        bhat, _, u, r, n, abar, tok, mt = _iso_chunk(abar_ptr, n_ptr, w_ptr, r_ptr, mu, p, bos, h, c * BT, Tn,
                                                     H, K, BT)
        e, _, cc = _iso_adjoint_rows(bhat, u, r, n, tl.load(dbeta_ptr + tok, mask=mt, other=0.0).to(tl.float32))
        P, Q = tl.associative_scan((abar * cc, abar * e), 0, _affine_combine)
        A, Bv = _affine_combine(A, Bv, tl.sum(tl.where(last, P, 0.0), axis=0), tl.sum(tl.where(last, Q, 0.0), axis=0))
    tl.store(seg_ptr + (bh * NS + s) * 2, A)
    tl.store(seg_ptr + (bh * NS + s) * 2 + 1, Bv)


@triton.jit
def _iso_gain_bwd_kernel(
    k_ptr, g_ptr, w_ptr, r_ptr, mu_ptr, abar_ptr, n_ptr, carry_ptr, seg_ptr, dbeta_ptr, dbT_ptr, scratch_ptr,
    dk_ptr, dg_ptr, dw_ptr, dr_ptr, dmu_ptr, db0_ptr, cu_ptr, T, NS, SEGC,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    # one (sequence*head, segment): the later segments' adjoint maps give lambda at the segment's last token,
    # then its chunks, latest first
    bh = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    b, h = bh // H, bh % H
    bos, Tn = _sequence(cu_ptr, b, T, IS_VARLEN)
    s_last = _last_segment(Tn, SEGC, BT)
    offs_k = tl.arange(0, BK)
    mk = offs_k < K
    ar = tl.arange(0, BT)
    mu = tl.load(mu_ptr + h)
    lam = tl.load(dbT_ptr + bh)
    for j in range(s_last - s):
        base = seg_ptr + (bh * NS + s_last - j) * 2
        lam = tl.load(base) * lam + tl.load(base + 1)
    dmu = tl.zeros([BT], tl.float32)
    sc = scratch_ptr + (bh * NS + s) * (4 * BT)
    one = tl.full([BT], 1.0, tl.float32)
    zero = tl.zeros([BT], tl.float32)
    first = ar == BT - 1
    c0, c1 = _seg_chunks(s, SEGC, Tn, BT)
    NT = tl.cdiv(T, BT)
    for j in range(c1 - c0):
        c = c1 - 1 - j
        t0 = c * BT
        p = tl.load(carry_ptr + bh * NT + c)
        bhat_f, post_f, _, _, _, _, _, _ = _iso_chunk(abar_ptr, n_ptr, w_ptr, r_ptr, mu, p, bos, h, t0, Tn, H, K, BT)
        buf = sc + (j % 2) * (2 * BT)
        tl.store(buf + ar, bhat_f)
        tl.store(buf + BT + ar, post_f)
        tl.debug_barrier()
        # reversed order: row i holds token t0 + BT - 1 - i
        rows = t0 + BT - 1 - ar
        mt = rows < Tn
        tok = (bos + rows) * H + h
        m = mt[:, None] & mk[None, :]
        idx = tok[:, None] * K + offs_k[None, :]
        bhat = tl.load(buf + BT - 1 - ar, volatile=True)
        b_prev = tl.where(first, p, tl.load(buf + 2 * BT - 2 - ar, mask=ar < BT - 1, other=1.0, volatile=True))
        abar = tl.load(abar_ptr + tok, mask=mt, other=1.0)
        n = tl.load(n_ptr + tok, mask=mt, other=0.0)
        r = tl.load(r_ptr + tok, mask=mt, other=1.0)
        dbeta = tl.load(dbeta_ptr + tok, mask=mt, other=0.0).to(tl.float32)
        u = mu * n / (K * r)
        e, s_row, cc = _iso_adjoint_rows(bhat, u, r, n, dbeta)
        P, Q, R, S = tl.associative_scan((abar * cc, abar * e, one, zero), 0, _adjoint_combine)
        lam_t = R * lam + S
        dbh = e + cc * lam_t
        du = -lam_t * bhat * bhat * cc
        dn = -dbeta * bhat * bhat / (s_row * s_row) + du * mu / (K * r)
        kf = tl.load(k_ptr + idx, mask=m, other=0.0).to(tl.float32)
        a = tl.exp(2.0 * tl.load(g_ptr + idx, mask=m, other=0.0))
        tl.store(dk_ptr + idx, (2.0 * kf * dn[:, None]).to(dk_ptr.dtype.element_ty), mask=m)
        tl.store(dg_ptr + idx, (2.0 / K) * a * (b_prev * dbh)[:, None], mask=m)
        tl.store(dw_ptr + tok, dbh, mask=mt)
        tl.store(dr_ptr + tok, -dbeta * bhat / (s_row * s_row) - du * u / r, mask=mt)
        dmu += du * n / (K * r)
        lam = tl.sum(tl.where(first, P * lam + Q, 0.0), axis=0)  # lambda_{t0-1}
    if s == 0:
        tl.store(db0_ptr + bh, lam)
    tl.store(dmu_ptr + bh * NS + s, tl.sum(dmu, axis=0))


@triton.jit
def _fused_recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, w_ptr, r_ptr, mu_ptr, S_ptr, u_ptr, u_out_ptr, o_ptr, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    ISOTROPIC: tl.constexpr,
):
    # one (batch, head) and one block of value columns; the whole key axis lives in registers
    pid_v = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    h = bh % H
    offs_k = tl.arange(0, BK)
    offs_v = pid_v * BV + tl.arange(0, BV)
    mk, mv = offs_k < K, offs_v < V
    mkv = mk[:, None] & mv[None, :]
    S = tl.load(S_ptr + bh * K * V + offs_k[:, None] * V + offs_v[None, :], mask=mkv, other=0.0)
    mu = tl.load(mu_ptr + h)
    if ISOTROPIC:
        unc = tl.load(u_ptr + bh)
    else:
        unc = tl.load(u_ptr + bh * K + offs_k, mask=mk, other=0.0)
    b = bh // H
    for t in range(T):
        tok = (b * T + t) * H + h  # row of [B, T, H, *]
        q = tl.load(q_ptr + tok * K + offs_k, mask=mk, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + tok * K + offs_k, mask=mk, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + tok * V + offs_v, mask=mv, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + tok * K + offs_k, mask=mk, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + tok).to(tl.float32)
        alpha = tl.exp(g)
        k2 = k * k
        if ISOTROPIC:
            w = tl.load(w_ptr + tok).to(tl.float32)
            a = tl.sum(tl.where(mk, alpha * alpha, 0.0), axis=0) / K
            b_hat = a * unc + w
            n = tl.sum(k2, axis=0)
            kappa = b_hat / (r + b_hat * n) * k
            unc = b_hat / (1.0 + mu * n / (K * r) * b_hat)
        else:
            w = tl.load(w_ptr + tok * K + offs_k, mask=mk, other=0.0).to(tl.float32)
            p_hat = alpha * alpha * unc + w
            kappa = p_hat * k / (r + tl.sum(p_hat * k2, axis=0))
            unc = p_hat / (1.0 + mu / r * k2 * p_hat)
        S = S * alpha[:, None]
        delta = v - tl.sum(S * k[:, None], axis=0)
        S = S + kappa[:, None] * delta[None, :]
        o = tl.sum(S * q[:, None], axis=0)
        tl.store(o_ptr + tok * V + offs_v, o, mask=mv)
    tl.store(S_ptr + bh * K * V + offs_k[:, None] * V + offs_v[None, :], S, mask=mkv)
    if pid_v == 0:  # every value block computes the same uncertainty; a separate buffer avoids a read race
        if ISOTROPIC:
            tl.store(u_out_ptr + bh, unc)
        else:
            tl.store(u_out_ptr + bh * K + offs_k, unc, mask=mk)


def fused_recurrent(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, omega: Tensor, r: Tensor, mu: Tensor, state: State,
    isotropic: bool,
) -> tuple[Tensor, State]:
    """Token-by-token KDN in one kernel (decoding, short prefill), without autograd.

    ``q, k, g: [B,T,H,K]``, ``v: [B,T,H,V]``, ``omega: [B,T,H,K]`` (``[B,T,H]`` isotropic), ``r: [B,T,H]``,
    ``mu: [H]``, ``state = (S [B,H,K,V], p [B,H,K] or b [B,H])``. Returns ``o [B,T,H,V]`` (FP32) and the
    new state (FP32 copies; the inputs are not modified).
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    S = state[0].float().contiguous().clone()
    unc = state[1].float().contiguous()
    unc_out = torch.empty_like(unc)
    o = torch.empty(B, T, H, V, device=v.device, dtype=torch.float32)
    BK = triton.next_power_of_2(K)
    BV = min(triton.next_power_of_2(V), 32)
    args = [x.contiguous() for x in (q, k, v, g, omega, r)]
    _fused_recurrent_kernel[(triton.cdiv(V, BV), B * H)](
        *args, mu.float().contiguous(), S, unc, unc_out, o, T, H=H, K=K, V=V, BK=BK, BV=BV, ISOTROPIC=isotropic,
    )
    return o, (S, unc_out)


_ISO_BT = 32
# Sequence parallelism (Isotropic): about this many programs per gain launch, segments of at least
# _MIN_SEG_CHUNKS chunks (each program first applies every earlier segment's map).
_TARGET_PROGRAMS = 512
_MIN_SEG_CHUNKS = 8
# Diagonal: one warp per (sequence*head, segment), about this many of them (32 a 132-SM H200 can hold at once
# each), segments of at least _DIAG_MIN_SEG tokens (the carry launches walk the segments one by one).
_DIAG_PROGRAMS = 4096
_DIAG_MIN_SEG = 64
_DIAG_WARPS = 1
_SEG_OVERRIDE: int | None = None  # tokens per segment (a multiple of the chunk) instead of the rule above: tests


def _segments(BH: int, T: int, BT: int, programs: int = _TARGET_PROGRAMS,
              min_chunks: int = _MIN_SEG_CHUNKS) -> tuple[int, int]:
    """``(SEGC, NS)``: chunks of ``BT`` tokens per segment and the number of segments, for ``B*H = BH``:
    about ``programs`` programs, at least ``min_chunks`` chunks a segment."""
    NT = triton.cdiv(T, BT)
    if _SEG_OVERRIDE is None:
        segc = max(min_chunks, triton.cdiv(NT, triton.cdiv(programs, BH)))
    elif _SEG_OVERRIDE > 0 and _SEG_OVERRIDE % BT == 0:
        segc = _SEG_OVERRIDE // BT
    else:
        raise ValueError(f"_SEG_OVERRIDE must be a positive multiple of the chunk size {BT}, got {_SEG_OVERRIDE}")
    return segc, triton.cdiv(NT, segc)


def gain_segments(isotropic: bool, BH: int, T: int) -> tuple[int, int]:
    """``(tokens per segment, segments)`` of the gain kernels for ``BH`` sequence-heads of ``T`` tokens."""
    if isotropic:
        segc, ns = _segments(BH, T, _ISO_BT)
        return segc * _ISO_BT, ns
    return _segments(BH, T, 1, _DIAG_PROGRAMS, _DIAG_MIN_SEG)


def _sequences(k: Tensor, cu_seqlens: Tensor | None) -> tuple[int, int]:
    """``(N, L)``: the number of sequences and the longest one's length. Without ``cu_seqlens`` the batch rows
    (``N = B``, ``L = T``); with it, the packed sequences of ``k [1,T,...]`` at offsets ``cu_seqlens [N+1]``
    (int32/int64 on ``k``'s device; read on the host: one sync)."""
    B, T = k.shape[:2]
    if cu_seqlens is None:
        return B, T
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 \
            or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError("cu_seqlens must be a 1-D int32/int64 tensor [N+1] of sequence offsets, got "
                         f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens).__name__)} of shape "
                         f"{tuple(getattr(cu_seqlens, 'shape', ()))}")
    if cu_seqlens.device != k.device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but k on {k.device}; move it to k's device")
    c = check_cu_seqlens(cu_seqlens, T, B)
    return len(c) - 1, max(b - a for a, b in zip(c, c[1:]))


def _check_gain_shapes(
    k: Tensor, g: Tensor, omega: Tensor, r: Tensor, mu: Tensor, u0: Tensor, isotropic: bool,
    cu_seqlens: Tensor | None,
) -> tuple[int, int]:
    """Check the gain inputs' shapes (the initial uncertainty is per sequence); returns :func:`_sequences`."""
    if k.dim() != 4:
        raise ValueError(f"k must be [B,T,H,K], got shape {tuple(k.shape)}")
    B, T, H, K = k.shape
    want = {"g": (g, (B, T, H, K)), "omega": (omega, (B, T, H) if isotropic else (B, T, H, K)), "r": (r, (B, T, H)),
            "mu": (mu, (H,))}
    for name, (x, shape) in want.items():
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} for k of shape {tuple(k.shape)}, got {tuple(x.shape)}")
    N, L = _sequences(k, cu_seqlens)
    shape = (N, H) if isotropic else (N, H, K)
    if tuple(u0.shape) != shape:
        raise ValueError(f"the initial uncertainty must have shape {shape} ({N} sequences), got {tuple(u0.shape)}")
    return N, L


def _diag_tiles(H: int, K: int, cu_seqlens: Tensor | None) -> dict[str, int | bool]:
    """The Diagonal gain kernels' shared launch parameters."""
    return {"H": H, "K": K, "BK": triton.next_power_of_2(K), "IS_VARLEN": cu_seqlens is not None,
            "num_warps": _DIAG_WARPS}


def _diag_gain_fwd(
    k: Tensor, g: Tensor, omega: Tensor, r: Tensor, mu: Tensor, p0: Tensor, out_dtype: torch.dtype, emit_ab: bool,
    cu_seqlens: Tensor | None, N: int, L: int, omega_softplus: bool, A_log: Tensor | None = None,
) -> tuple[tuple[Tensor, ...], tuple[Tensor | None, ...]]:
    """The Diagonal gain's forward launches: ``((kappa, [a, b,] p_T), saved)``, ``saved`` what
    :func:`_diag_gain_bwd` takes (``k``, FP32 gates, the carries ``[N*H, NS, K]``, ``cu_seqlens``, ``A_log``).
    ``A_log [H]``: ``g`` is the output of KDA's gate with these ``A_log`` (:func:`kdn.triton_gate.kda_gate_fwd`),
    whose backward the gain's takes on (:func:`_diag_gain_bwd`)."""
    B, T, H, K = k.shape
    k = k.contiguous()
    omega = omega.contiguous() if omega_softplus else omega.float().contiguous()
    g, r, mu, p0 = (x.float().contiguous() for x in (g, r, mu, p0))
    SEG, NS = gain_segments(False, N * H, L)
    kappa = k.new_empty(B, T, H, K, dtype=out_dtype)
    a, b = (torch.empty_like(kappa), torch.empty_like(kappa)) if emit_ab else (kappa, kappa)
    seg = p0.new_empty(N * H, NS, 4, K)
    carry = p0.new_empty(N * H, NS, K)
    pT = torch.empty_like(p0)
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
    f_dtype: torch.dtype = torch.float32,
) -> tuple[Tensor | None, ...]:
    """The Diagonal gain's backward launches: ``(dk, dg, domega, dr, dmu, dp0, dgate)`` from ``saved``
    (:func:`_diag_gain_fwd`) and the gradients of its outputs ``grads = (dkappa, [da, db,] dp_T)``.
    ``mem_grads = (dk_mem, dg_mem)``, ``[B,T,H,K]`` each (any float dtype): further gradients of the same ``k``
    and ``g``, added in the last launch (in FP32; ``dk`` is stored in ``k``'s dtype). ``dmu`` is ``None``
    unless ``need_dmu``. When ``g`` came from KDA's gate (``A_log`` saved, :func:`_diag_gain_fwd`), ``dg`` is that of
    the gate's input ``f`` (in ``f_dtype``) and ``dgate = (dA_log [H], ddt_bias [H*K])`` (FP32); ``None`` otherwise."""
    k, g, omega, r, mu, carry, cu_seqlens, A_log = saved
    gate = A_log is not None
    H, K = k.shape[2:]
    SEG, NS = gain_segments(False, N * H, L)
    dkappa, *rest, dpT = (x.contiguous() for x in grads)
    da, db = rest if emit_ab else (dkappa, dkappa)
    dk_mem, dg_mem = (x.contiguous() for x in mem_grads) if mem_grads is not None else (dkappa, dkappa)
    post = torch.empty_like(g)
    seg = carry.new_empty(N * H, NS, 2, K)
    lam = torch.empty_like(carry)
    dk = torch.empty_like(k)
    dg = torch.empty_like(g, dtype=f_dtype if gate else g.dtype)
    dw = torch.empty_like(omega)  # of omega's input when omega_softplus
    dr = torch.empty_like(r)
    dp0 = carry.new_empty(N, H, K)
    dmu = carry.new_empty(N, H, NS)
    dA, dbias = (carry.new_empty(N, H, NS), carry.new_empty(N, H, NS, K)) if gate else (dmu, dmu)
    tiles = _diag_tiles(H, K, cu_seqlens)
    act = {"EMIT_AB": emit_ab, "OMEGA_SOFTPLUS": omega_softplus}
    _diag_seg_bwd_kernel[(N * H, NS)](k, g, omega, r, mu, carry, dkappa, db, post, seg, cu_seqlens, L, NS,
                                      SEG, **tiles, **act)
    _diag_carry_bwd_kernel[(N * H,)](seg, dpT.float(), lam, dp0, cu_seqlens, L, NS, SEG, **tiles)
    _diag_gain_bwd_kernel[(N * H, NS)](k, g, omega, r, mu, A_log if gate else mu, carry, post, lam, dkappa, da, db,
                                       dk_mem, dg_mem, dk, dg, dw, dr, dmu, dA, dbias, cu_seqlens, L, NS, SEG,
                                       ACCUMULATE=mem_grads is not None, GATE=gate, **tiles, **act)
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
        omega_softplus: bool,
    ) -> tuple[Tensor, ...]:
        outs, saved = _diag_gain_fwd(k, g, omega, r, mu, p0, out_dtype, emit_ab, cu_seqlens, N, L, omega_softplus)
        ctx.save_for_backward(*saved)
        ctx.emit_ab, ctx.seqs, ctx.omega_softplus = emit_ab, (N, L), omega_softplus
        return outs

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, *grads: Tensor) -> tuple[Tensor | None, ...]:
        dk, dg, dw, dr, dmu, dp0, _ = _diag_gain_bwd(ctx.saved_tensors, grads, ctx.emit_ab, *ctx.seqs,
                                                     ctx.omega_softplus, ctx.needs_input_grad[4])
        return dk, dg, dw, dr, dmu, dp0, None, None, None, None, None, None


class _IsotropicGain(torch.autograd.Function):
    """``(k, g, omega, r, mu, b0) -> (beta, b_T)``: the fused Isotropic gain, forward and backward.

    Each direction is two launches on a ``(N*H, NS)`` grid: the segments' compositions, then the segments
    (``N``, ``NS`` as in :class:`_DiagonalGain`).
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, k: Tensor, g: Tensor, omega: Tensor, r: Tensor, mu: Tensor,
        b0: Tensor, out_dtype: torch.dtype, cu_seqlens: Tensor | None, N: int, L: int,
    ) -> tuple[Tensor, Tensor]:
        B, T, H, K = k.shape
        k = k.contiguous()
        g, omega, r, mu, b0 = (x.float().contiguous() for x in (g, omega, r, mu, b0))
        SEGC, NS = _segments(N * H, L, _ISO_BT)
        beta = k.new_empty(B, T, H, dtype=out_dtype)
        abar, n = torch.empty_like(r), torch.empty_like(r)
        seg = b0.new_empty(N * H, NS, 4)
        carry = b0.new_empty(N, H, triton.cdiv(L, _ISO_BT))
        bT = torch.empty_like(b0)
        tiles = {"H": H, "K": K, "BT": _ISO_BT, "IS_VARLEN": cu_seqlens is not None}
        _iso_seg_fwd_kernel[(N * H, NS)](k, g, omega, r, mu, abar, n, seg, cu_seqlens, L, NS, SEGC,
                                         BK=triton.next_power_of_2(K), **tiles)
        _iso_gain_fwd_kernel[(N * H, NS)](omega, r, mu, b0, abar, n, seg, beta, carry, bT, cu_seqlens, L, NS, SEGC,
                                          **tiles)
        ctx.save_for_backward(k, g, omega, r, mu, abar, n, carry, cu_seqlens)
        ctx.seqs = (N, L)
        return beta, bT

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, dbeta: Tensor, dbT: Tensor) -> tuple[Tensor | None, ...]:
        k, g, omega, r, mu, abar, n, carry, cu_seqlens = ctx.saved_tensors
        H, K = k.shape[2:]
        N, L = ctx.seqs
        SEGC, NS = _segments(N * H, L, _ISO_BT)
        dbeta = dbeta.contiguous()
        dk, dg = torch.empty_like(k), torch.empty_like(g)
        dw, dr = torch.empty_like(omega), torch.empty_like(r)
        db0 = torch.empty(N, H, device=k.device, dtype=torch.float32)
        dmu = torch.empty(N, H, NS, device=k.device, dtype=torch.float32)
        seg = torch.empty(N * H, NS, 2, device=k.device, dtype=torch.float32)
        scratch = torch.empty(N * H * NS * 4 * _ISO_BT, device=k.device, dtype=torch.float32)
        tiles = {"H": H, "K": K, "BT": _ISO_BT, "IS_VARLEN": cu_seqlens is not None}
        _iso_seg_bwd_kernel[(N * H, NS)](omega, r, mu, abar, n, carry, dbeta, seg, cu_seqlens, L, NS, SEGC, **tiles)
        _iso_gain_bwd_kernel[(N * H, NS)](k, g, omega, r, mu, abar, n, carry, seg, dbeta, dbT.float().contiguous(),
                                          scratch, dk, dg, dw, dr, dmu, db0, cu_seqlens, L, NS, SEGC,
                                          BK=triton.next_power_of_2(K), **tiles)
        dmu = dmu.sum((0, 2)) if ctx.needs_input_grad[4] else None
        return dk, dg, dw, dr, dmu, db0, None, None, None, None


def diagonal_gain(
    k: Tensor, g: Tensor, omega: Tensor, r: Tensor, mu: Tensor, p0: Tensor, out_dtype: torch.dtype = torch.float32,
    *, cu_seqlens: Tensor | None = None, omega_softplus: bool = False,
) -> tuple[Tensor, Tensor]:
    """Fused Triton Diagonal gains: ``kappa [B,T,H,K]`` in ``out_dtype`` and ``p_T [N,H,K]`` (FP32).

    ``k: [B,T,H,K]`` (any float dtype), ``g, omega: [B,T,H,K]``, ``r: [B,T,H]``, ``mu: [H]``, ``p0: [N,H,K]``;
    gates, ``mu`` and ``p0`` are used in FP32. ``N = B``, or with ``cu_seqlens [N+1]`` (int32/int64 offsets of
    packed sequences along T, ``B = 1``) the number of sequences, each with its own ``p0`` and ``p_T``.
    ``omega_softplus``: ``omega`` holds the process noise before its softplus (any float dtype), applied in the
    kernels (FP32), which saves a pass over ``[B,T,H,K]`` each way. Differentiable in every tensor input.
    """
    N, L = _check_gain_shapes(k, g, omega, r, mu, p0, False, cu_seqlens)
    return _DiagonalGain.apply(k, g, omega, r, mu, p0, out_dtype, False, cu_seqlens, N, L, omega_softplus)


def diagonal_gain_dplr(
    k: Tensor, g: Tensor, omega: Tensor, r: Tensor, mu: Tensor, p0: Tensor, out_dtype: torch.dtype = torch.float32,
    *, cu_seqlens: Tensor | None = None, omega_softplus: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`diagonal_gain` plus fla's DPLR operands from the same kernel: ``(kappa, a = exp(g) k, b = -kappa,
    p_T)``, the first three ``[B,T,H,K]`` in ``out_dtype``."""
    N, L = _check_gain_shapes(k, g, omega, r, mu, p0, False, cu_seqlens)
    return _DiagonalGain.apply(k, g, omega, r, mu, p0, out_dtype, True, cu_seqlens, N, L, omega_softplus)


def isotropic_gain(
    k: Tensor, g: Tensor, omega: Tensor, r: Tensor, mu: Tensor, b0: Tensor, out_dtype: torch.dtype = torch.float32,
    *, cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Fused Triton Isotropic gains: ``beta [B,T,H]`` in ``out_dtype`` and ``b_T [N,H]`` (FP32).

    ``k, g: [B,T,H,K]``, ``omega, r: [B,T,H]``, ``mu: [H]``, ``b0: [N,H]``; ``N`` and ``cu_seqlens`` as in
    :func:`diagonal_gain`. Differentiable in every tensor input.
    """
    N, L = _check_gain_shapes(k, g, omega, r, mu, b0, True, cu_seqlens)
    return _IsotropicGain.apply(k, g, omega, r, mu, b0, out_dtype, cu_seqlens, N, L)


# fla's envelope for its tensor-core diagonal blocks (``safe_gate`` with the default shift, 2 nats per token): a
# 16-token sub-chunk whose gates fall by at most 75 nats keeps both factors within exp(+-60) (fla.ops.kda.chunk_intra)
SAFE_GATE_SPREAD = 75.0
SAFE_GATE_STEPS = 15
# How the checks read so far went (True: tensor-core path, False: token loop); train.py's profiler reports them.
SAFE_GATE_READS: Counter[bool] = Counter()


class SafeGate:
    """:func:`safe_gate`'s answer: computed on ``g``'s device when made, fetched when read (``bool``). On CUDA its
    copy to the host is queued behind whatever is launched in between, so reading it does not drain the GPU's queue
    (a plain ``.item()`` before the memory kernel left the GPU idle for 3% of a 750M KDA step)."""

    def __init__(self, ok: Tensor) -> None:
        self._event = None
        if ok.is_cuda:
            self._ok = torch.empty((), dtype=torch.bool, pin_memory=True)
            self._ok.copy_(ok, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._ok = ok

    def __bool__(self) -> bool:
        if self._event is not None:
            self._event.synchronize()
        ok = bool(self._ok)
        SAFE_GATE_READS[ok] += 1
        return ok


@triton.jit
def _steepest_kernel(g_ptr, out_ptr, R, K: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr):
    """``out[r] = -min_k g[r, k]`` for ``BR`` rows of ``g [R, K]`` per program; NaN where a row holds a NaN."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BK)
    m = (rows[:, None] < R) & (cols[None, :] < K)
    x = tl.load(g_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], mask=m, other=0.0).to(tl.float32)
    steep = -tl.min(tl.where(m, x, float("inf")), axis=1)
    nan = tl.max((x != x).to(tl.int32), axis=1) > 0
    tl.store(out_ptr + rows, tl.where(nan, float("nan"), steep), mask=rows < R)


def _steepest_triton(g: Tensor) -> Tensor:
    """``-g.amin(-1)`` in FP32 for ``g [..., K]`` in one pass (torch's ``amin`` over a 128-wide last axis ran at a
    third of the HBM rate on an H200)."""
    g = g.contiguous()
    K = g.shape[-1]
    out = torch.empty(g.shape[:-1], dtype=torch.float32, device=g.device)
    R = out.numel()
    BK = triton.next_power_of_2(K)
    BR = max(1, 4096 // BK)
    _steepest_kernel[(triton.cdiv(R, BR),)](g, out, R, K=K, BR=BR, BK=BK, num_warps=4)
    return out


def safe_gate(g: Tensor) -> SafeGate:
    """Whether fla's ``safe_gate`` path is exact for the log-retention ``g`` (``[B,T,H,K]`` per channel or
    ``[B,T,H]`` per head, ``<= 0``): no key channel falls by more than :data:`SAFE_GATE_SPREAD` nats over any
    :data:`SAFE_GATE_STEPS` consecutive tokens. Read the answer with ``bool()``, as late as possible.

    Conservative: it sums each token's steepest channel, and packed sequences' windows may straddle a boundary.
    Non-finite gates give ``False`` (the exact token loop).
    """
    g = g.detach()
    if g.dim() == 3:
        return safe_steepest(g.float().neg())  # [B, T, H]
    return safe_steepest(_steepest_triton(g) if g.is_cuda and g.numel() else g.amin(-1).float().neg())


def safe_steepest(steep: Tensor) -> SafeGate:
    """:func:`safe_gate` from each token's steepest channel ``steep = -min_K g`` ``[B, T, H]``."""
    if steep.shape[1] == 0:
        return SafeGate(torch.ones((), dtype=torch.bool, device=steep.device))
    w = min(SAFE_GATE_STEPS, steep.shape[1])
    return SafeGate(steep.unfold(1, w, 1).sum(-1).amax() <= SAFE_GATE_SPREAD)


# The Diagonal memory kernel: "asym" (fla's asymmetric chunk-64 delta-rule kernels, ``_AsymmetricMemory``; the
# faster: docs/results.md) or "dplr" (fla's chunk_dplr_delta_rule, chunk DPLR_CHUNK).
DIAG_MEMORY = "asym"
# fla's DPLR chunk size: 16 (fla's default) or 32. fla's kernels at 64 assume a lower bound on the gate; under strong
# forgetting they miss the log-retention gradient tolerance (2.3% against 2% at T = 1000, docs/performance.md)
DPLR_CHUNK = 16
ASYM_CHUNK = 64
# The asymmetric memory's backward needs the forward's WY terms (w, q exp2(gc), kg) and chunk states (h, v_new). False:
# the forward keeps them, five more [B,T,H,K]-sized bf16 tensors per layer (about 0.8 GiB per layer for 32K tokens of
# 16 heads of 128); True: the backward recomputes them, as fla's chunk_kda does (docs/performance.md).
RECOMPUTE_STATES = False


def _asym_intra_fwd(
    q: Tensor, k: Tensor, kappa: Tensor, v: Tensor, gc: Tensor, beta: Tensor, scale: float, safe: bool,
    seqs: dict[str, Tensor | None], output_qg: bool,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor, Tensor, Tensor]:
    """fla's ``chunk_precond_kda_fwd_intra`` (its three launches: the diagonal blocks, the fused inter-block + solve,
    the WY representation), whose last launch also writes ``qg = q exp2(gc)`` when ``output_qg`` (the backward's
    chunk-state gradient reads it; ``None`` otherwise). Returns ``(w, u, qg, kg, Aqk, Akk)``."""
    from fla.ops.precond_kda.chunk_intra import (
        DEFAULT_SOLVE_TRIL_PRECISION,
        chunk_precond_kda_fwd_intra_token_parallel,
        chunk_precond_kda_fwd_kernel_inter_solve_fused,
        chunk_precond_kda_fwd_kernel_intra_sub_chunk,
    )
    from fla.ops.precond_kda.wy_fast import recompute_w_u_fwd
    from fla.ops.utils.constant import RCP_LN2
    from fla.utils import IS_GATHER_SUPPORTED

    C = ASYM_CHUNK
    B, T, H, K = k.shape
    BC = 16
    NT = triton.cdiv(T, C) if seqs["chunk_indices"] is None else len(seqs["chunk_indices"])
    Aqk = torch.empty(B, T, H, C, device=k.device, dtype=k.dtype)
    Akk = torch.zeros(B, T, H, C, device=k.device, dtype=k.dtype)  # the kernels write its lower triangle only
    Akk_diag = torch.empty(B, T, H, BC, device=k.device, dtype=torch.float32)
    if safe:
        chunk_precond_kda_fwd_kernel_intra_sub_chunk[(NT, C // BC, B * H)](
            q=q, k=k, k_precond=kappa, g=gc, beta=beta, Aqk=Aqk, Akk=Akk_diag, scale=scale, **seqs, T=T, H=H, K=K,
            BT=C, BC=BC, BK=triton.next_power_of_2(K), GATE_SHIFT=2.0 * RCP_LN2, USE_GATHER=IS_GATHER_SUPPORTED)
    else:
        chunk_precond_kda_fwd_intra_token_parallel(
            q=q, k=k, k_precond=kappa, gk=gc, beta=beta, Aqk=Aqk, Akk=Akk_diag, scale=scale,
            cu_seqlens=seqs["cu_seqlens"], chunk_size=C, sub_chunk_size=BC)
    chunk_precond_kda_fwd_kernel_inter_solve_fused[(NT, B * H)](
        q=q, k=k, k_precond=kappa, g=gc, beta=beta, Aqk=Aqk, Akk_diag=Akk_diag, Akk=Akk, scale=scale, **seqs, T=T,
        H=H, K=K, BT=C, BC=BC, SOLVE_TRIL_DOT_PRECISION=DEFAULT_SOLVE_TRIL_PRECISION, USE_SAFE_GATE=safe)
    w, u, qg, kg = recompute_w_u_fwd(k=k, k_precond=kappa, v=v, beta=beta, A=Akk, gk=gc, q=q, output_qg=output_qg,
                                     output_kg=True, **seqs)
    return w, u, qg, kg, Aqk, Akk


def _asym_memory_fwd(
    q: Tensor, k: Tensor, kappa: Tensor, v: Tensor, g: Tensor, beta: Tensor | None, S0: Tensor | None, scale: float,
    output_final_state: bool, cu_seqlens: Tensor | None, check: SafeGate, gc: Tensor | None = None,
) -> tuple[Tensor, Tensor | None, tuple[Tensor | None, ...], bool]:
    """The asymmetric memory's forward launches (shapes as :class:`_AsymmetricMemory`): ``(o, S_T, saved, safe)``,
    ``saved`` what :func:`_asym_memory_bwd` takes, ``safe`` the answer of ``check`` (:func:`safe_gate`; read just
    before the first kernel that needs it): whether fla's tensor-core diagonal blocks were taken. Unless
    :data:`RECOMPUTE_STATES`, ``saved`` holds the WY terms and chunk states the backward would otherwise recompute.
    ``gc``: ``g``'s cumulative sums within the chunks in log2 units, when already made (:mod:`kdn.triton_gate`)."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.gla.chunk import chunk_gla_fwd_o_gk
    from fla.ops.utils import chunk_local_cumsum, prepare_chunk_indices
    from fla.ops.utils.constant import RCP_LN2

    C = ASYM_CHUNK
    q, k, kappa, v = (x.contiguous() for x in (q, k, kappa, v))
    seqs = {"cu_seqlens": cu_seqlens,
            "chunk_indices": None if cu_seqlens is None else prepare_chunk_indices(cu_seqlens, C)}
    if gc is None:  # log2, per chunk
        gc = chunk_local_cumsum(g.float().contiguous(), chunk_size=C, scale=RCP_LN2, **seqs)
    beta = q.new_ones(q.shape[:3]) if beta is None else beta.contiguous()
    safe = bool(check)
    keep = not RECOMPUTE_STATES
    w, u, qg, kg, Aqk, Akk = _asym_intra_fwd(q, k, kappa, v, gc, beta, scale, safe, seqs, keep)
    h, v_new, S = chunk_gated_delta_rule_fwd_h(
        k=kg, w=w, u=u, gk=gc, initial_state=S0, output_final_state=output_final_state, chunk_size=C, **seqs)
    o = chunk_gla_fwd_o_gk(q=q, v=v_new, g=gc, A=Aqk, h=h, scale=scale, chunk_size=C, **seqs)
    states = (w, qg, kg, h, v_new) if keep else (None,) * 5
    saved = (q, k, kappa, v, gc, beta, Aqk, Akk, S0, seqs["cu_seqlens"], seqs["chunk_indices"], *states)
    return o.to(q.dtype), S, saved, safe


def _asym_memory_bwd(
    saved: tuple[Tensor | None, ...], scale: float, safe: bool, do: Tensor, dS: Tensor | None
) -> tuple[Tensor | None, ...]:
    """The asymmetric memory's backward launches from ``saved`` (:func:`_asym_memory_fwd`) and the gradients of
    ``o`` and ``S_T``: ``(dq, dk, dkappa, dv, dg, dbeta, dS0)``, the first four in their inputs' dtypes, ``dg``
    (of the raw ``g``) and ``dbeta`` FP32, ``dS0`` FP32 (``None`` without ``S0``)."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu, chunk_gated_delta_rule_fwd_h
    from fla.ops.precond_kda.chunk_bwd import chunk_precond_kda_bwd_dAv
    from fla.ops.precond_kda.chunk_intra import chunk_precond_kda_bwd_intra
    from fla.ops.precond_kda.wy_fast import recompute_w_u_fwd

    from kdn.triton_wy import chunk_asym_bwd_wy_dqkg

    q, k, kappa, v, gc, beta, Aqk, Akk, S0, cu_seqlens, chunk_indices, w, qg, kg, h, v_new = saved
    C = ASYM_CHUNK
    seqs = {"cu_seqlens": cu_seqlens, "chunk_indices": chunk_indices}
    do = do.contiguous()
    if h is None:  # recompute the WY representation and the chunk states (as fla's KDA backward does)
        w, u, qg, kg = recompute_w_u_fwd(k=k, k_precond=kappa, v=v, beta=beta, A=Akk, gk=gc, q=q,
                                         output_qg=True, output_kg=True, **seqs)
        h, v_new, _ = chunk_gated_delta_rule_fwd_h(k=kg, w=w, u=u, gk=gc, initial_state=S0,
                                                   output_final_state=False, chunk_size=C, **seqs)
    dAqk, dv = chunk_precond_kda_bwd_dAv(q=q, k=k, v=v_new, do=do, A=Aqk, scale=scale, chunk_size=C, **seqs)
    dh, dS0, dv = chunk_gated_delta_rule_bwd_dhu(q=qg, k=kg, w=w, gk=gc, h0=S0, dht=dS, do=do, dv=dv,
                                                 scale=scale, chunk_size=C, **seqs)
    dq, dk, dkg, dv, dbeta, dg, dAkk = chunk_asym_bwd_wy_dqkg(
        q=q, k=k, k_precond=kappa, v=v, v_new=v_new, g=gc, beta=beta, A=Akk, h=h, do=do, dh=dh, dv=dv,
        scale=scale, chunk_size=C, **seqs)
    dq, dk, dkappa, dbeta, dg = chunk_precond_kda_bwd_intra(
        q=q, k=k, k_precond=kappa, g=gc, beta=beta, dAqk=dAqk, dAkk=dAkk, dq=dq, dk=dk, dk_precond=dkg,
        db=dbeta, dg=dg, chunk_size=C, safe_gate=safe, **seqs)  # dg: of the raw g (reverse cumsum applied)
    return dq.to(q), dk.to(k), dkappa.to(kappa), dv.to(v), dg, dbeta, dS0


class _AsymmetricMemory(torch.autograd.Function):
    """The asymmetric gated delta rule ``S_t = D_t S_{t-1} + beta_t kappa_t (v_t - k_t^T D_t S_{t-1})^T``,
    ``o_t = scale q_t^T S_t``, through fla's KDA-style chunk-64 kernels with a separate write key (those of
    ``fla.ops.precond_kda`` without its preconditioner: ``kappa`` takes the place of ``beta k_precond``), except the
    inter-chunk + WY backward, ours (:func:`kdn.triton_wy.chunk_asym_bwd_wy_dqkg`: the same values, split over key
    blocks, 2x faster on an H200).

    ``q, k, kappa: [B,T,H,K]`` and ``v [B,T,H,V]`` (bf16 or FP32), ``g [B,T,H,K]`` FP32 log-retention,
    ``beta [B,T,H]`` (``kappa``'s dtype; ``None``: ones, the write key is ``kappa`` alone), ``S0 [N,H,K,V]`` FP32 or
    ``None``; ``N = B``, or with ``cu_seqlens [N+1]`` (packed sequences, ``B = 1``)
    the number of sequences. Returns ``o [B,T,H,V]`` and ``S_T [N,H,K,V]`` (``None`` unless asked).
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, q: Tensor, k: Tensor, kappa: Tensor, v: Tensor, g: Tensor,
        beta: Tensor | None, S0: Tensor | None, scale: float, output_final_state: bool, cu_seqlens: Tensor | None,
        check: SafeGate,
    ) -> tuple[Tensor, Tensor | None]:
        ctx.same_key = kappa is k  # one key on both sides (Isotropic): its two gradients are summed in FP32
        o, S, saved, ctx.safe = _asym_memory_fwd(q, k, kappa, v, g, beta, S0, scale, output_final_state, cu_seqlens,
                                                 check)
        ctx.save_for_backward(*saved)
        ctx.scale = scale
        return o, S

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, do: Tensor, dS: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        saved = ctx.saved_tensors
        dq, dk, dkappa, dv, dg, dbeta, dS0 = _asym_memory_bwd(saved, ctx.scale, ctx.safe, do, dS)
        dbeta = dbeta.to(saved[5]) if ctx.needs_input_grad[5] else None  # saved[5]: beta
        if ctx.same_key:
            dk, dkappa = dk + dkappa, None
        return dq, dk, dkappa, dv, dg, dbeta, dS0, None, None, None, None


class _DiagonalKDN(torch.autograd.Function):
    """``(q, k, v, g, omega, r, mu, p0, S0, [A_log, dt_bias]) -> (o, S_T, p_T)``: the fused Diagonal gain feeding the
    asymmetric memory (``kappa`` its write key), one autograd node. Its backward runs the memory's, then the gain's,
    whose last launch adds the memory's gradients of ``k`` and ``g`` to the gain's own (no separate ``[B,T,H,K]``
    sums) and, with KDA's gate in the kernels, takes them through the gate.

    ``q, v`` in the memory's dtype (``kappa``'s too; the memory reads ``k`` in it), ``k`` any float dtype, the rest
    as :func:`diagonal_kdn` (``S0`` FP32 or ``None``, ``N, L`` from :func:`_sequences`, ``check`` :func:`safe_gate`).
    With ``A_log, dt_bias``, ``g`` is the input of KDA's gate: one pass makes the gate's output, its chunk sums and
    the check (:func:`kdn.triton_gate.kda_gate_fwd`; ``check`` is then ``None``).
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, q: Tensor, k: Tensor, v: Tensor, g: Tensor, omega: Tensor,
        r: Tensor, mu: Tensor, p0: Tensor, S0: Tensor | None, scale: float, output_final_state: bool,
        cu_seqlens: Tensor | None, N: int, L: int, omega_softplus: bool, check: SafeGate, A_log: Tensor | None,
        dt_bias: Tensor | None,
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        gc = None
        ctx.f_dtype = g.dtype
        if A_log is not None:
            from kdn.triton_gate import kda_gate_fwd

            g, gc, steep = kda_gate_fwd(g, A_log, dt_bias, cu_seqlens)
            check = safe_steepest(steep)  # read after the gain's kernels are queued
        (kappa, pT), gain = _diag_gain_fwd(k, g, omega, r, mu, p0, q.dtype, False, cu_seqlens, N, L, omega_softplus,
                                           A_log)
        o, S, mem, ctx.safe = _asym_memory_fwd(q, k.to(q.dtype), kappa, v, g, None, S0, scale, output_final_state,
                                               cu_seqlens, check, gc)
        ctx.save_for_backward(*gain, *mem)
        ctx.n_gain, ctx.seqs, ctx.omega_softplus, ctx.scale = len(gain), (N, L), omega_softplus, scale
        return o, S, pT

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, do: Tensor, dS: Tensor | None, dpT: Tensor
    ) -> tuple[Tensor | None, ...]:
        saved, n = ctx.saved_tensors, ctx.n_gain
        dq, dk_mem, dkappa, dv, dg_mem, _, dS0 = _asym_memory_bwd(saved[n:], ctx.scale, ctx.safe, do, dS)
        dk, dg, dw, dr, dmu, dp0, dgate = _diag_gain_bwd(saved[:n], (dkappa, dpT), False, *ctx.seqs,
                                                         ctx.omega_softplus, ctx.needs_input_grad[6], (dk_mem, dg_mem),
                                                         ctx.f_dtype)
        dA, dbias = dgate if dgate is not None else (None, None)
        return dq, dk, dv, dg, dw, dr, dmu, dp0, dS0, None, None, None, None, None, None, None, dA, dbias


def _mem_dtype(x: Tensor) -> torch.dtype:
    return torch.bfloat16 if x.dtype in (torch.bfloat16, torch.float16) else torch.float32


def diagonal_kdn(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, omega: Tensor, r: Tensor, mu: Tensor,
    state: tuple[Tensor | None, Tensor], scale: float = 1.0, output_final_state: bool = True,
    cu_seqlens: Tensor | None = None, omega_softplus: bool = False, gate: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, tuple[Tensor | None, Tensor]]:
    """Diagonal KDN on CUDA: the fused Triton gain (which also emits DPLR's ``a, b``) + fla's DPLR chunk kernel
    (``DIAG_MEMORY = "dplr"``), or the gain + fla's asymmetric chunk-64 kernels (``"asym"``).

    Shapes as :func:`diagonal_gain` plus ``q [B,T,H,K]``, ``v [B,T,H,V]``; ``state = (S0 [N,H,K,V] or None
    (zero memory), p0 [N,H,K])``; ``scale`` multiplies ``q``; ``cu_seqlens [N+1]``: packed sequences (``B = 1``,
    ``"asym"`` only), else ``N = B``; ``omega_softplus`` as in :func:`diagonal_gain`. ``gate = (A_log [H],
    dt_bias [H*K])``: ``g`` holds the input of KDA's gate (:func:`kdn.modules.kda_gate`), applied inside the
    ``"asym"`` kernels (before the ``"dplr"`` ones). Returns ``o [B,T,H,V]`` and ``(S_T, p_T)`` (``S_T`` is ``None``
    unless ``output_final_state``).
    """
    from fla.ops.generalized_delta_rule.dplr import chunk_dplr_delta_rule

    S0, p0 = state
    dt = _mem_dtype(v)
    if DIAG_MEMORY not in ("dplr", "asym"):
        raise ValueError(f"kdn.triton_ops.DIAG_MEMORY must be 'dplr' or 'asym', got {DIAG_MEMORY!r}")
    if DIAG_MEMORY == "dplr" and DPLR_CHUNK not in (16, 32):
        raise ValueError(f"kdn.triton_ops.DPLR_CHUNK must be 16 or 32, got {DPLR_CHUNK!r}: fla's DPLR kernels at chunk "
                         "64 assume a gate lower bound and lose gradient accuracy under strong forgetting")
    if DIAG_MEMORY == "asym":
        check = None if gate is not None else safe_gate(g)  # read after the gain's kernels are queued
        N, L = _check_gain_shapes(k, g, omega, r, mu, p0, False, cu_seqlens)
        o, S, pT = _DiagonalKDN.apply(q.to(dt), k, v.to(dt), g, omega, r, mu, p0, None if S0 is None else S0.float(),
                                      float(scale), output_final_state, cu_seqlens, N, L, omega_softplus, check,
                                      *(gate if gate is not None else (None, None)))
        return o, (S, pT)
    if gate is not None:
        g = kda_gate(g, *gate)
    if cu_seqlens is not None:
        raise NotImplementedError("triton_ops.diagonal_kdn takes cu_seqlens only with DIAG_MEMORY = 'asym'; packed "
                                  "sequences go through kdn.api's unpacking for the DPLR memory")
    kappa, a, b, pT = diagonal_gain_dplr(k, g, omega, r, mu, p0, dt, omega_softplus=omega_softplus)
    o, S = chunk_dplr_delta_rule(
        q=q.to(dt), k=kappa, v=v.to(dt), a=a, b=b, gk=g.float(), scale=scale, chunk_size=DPLR_CHUNK,
        initial_state=None if S0 is None else S0.float(), output_final_state=output_final_state,
    )
    return o, (S, pT)


def isotropic_kdn(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, omega: Tensor, r: Tensor, mu: Tensor,
    state: tuple[Tensor | None, Tensor], scale: float = 1.0, output_final_state: bool = True,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, tuple[Tensor | None, Tensor]]:
    """Isotropic KDN on CUDA: the fused Triton gain + KDA's rule with ``beta`` = the KDN gain (:func:`kda`: the
    asymmetric memory with ``kappa = k``, whose kernels train faster than fla's ``chunk_kda``; docs/performance.md).

    Shapes as :func:`isotropic_gain` plus ``q [B,T,H,K]``, ``v [B,T,H,V]``; ``state = (S0 [N,H,K,V] or None,
    b0 [N,H])``; ``cu_seqlens [N+1]``: packed sequences (``B = 1``), else ``N = B``.
    """
    S0, b0 = state
    dt = _mem_dtype(v)
    check = safe_gate(g)  # read after the gain's kernels are queued
    beta, bT = isotropic_gain(k, g, omega, r, mu, b0, dt, cu_seqlens=cu_seqlens)
    o, S = kda(q.to(dt), k.to(dt), v.to(dt), g, beta, scale, S0, output_final_state, cu_seqlens, check)
    return o, (S, bT)


def kda(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float, initial_state: Tensor | None = None,
    output_final_state: bool = False, cu_seqlens: Tensor | None = None, check: SafeGate | None = None,
) -> tuple[Tensor, Tensor | None]:
    """KDA's rule (fla's ``chunk_kda``: ``S_t = D_t S_{t-1} + beta_t k_t (v_t - k_t^T D_t S_{t-1})^T``, ``o_t = scale
    q_t^T S_t``) through the asymmetric memory with ``kappa = k`` (:class:`_AsymmetricMemory`), whose backward is
    faster than ``chunk_kda``'s (docs/performance.md), as Isotropic KDN runs it.

    ``q, k: [B,T,H,K]``, ``v [B,T,H,V]`` (one dtype), ``g [B,T,H,K]`` log-retention, ``beta [B,T,H]`` (``q``'s dtype),
    ``initial_state [N,H,K,V]`` FP32 or ``None``; ``cu_seqlens [N+1]``: packed sequences (``B = 1``), else ``N = B``;
    ``check``: :func:`safe_gate` of ``g`` (made here when ``None``). Returns ``o [B,T,H,V]`` and ``S_T`` (``None``
    unless ``output_final_state``).
    """
    check = safe_gate(g) if check is None else check
    S0 = None if initial_state is None else initial_state.float()
    return _AsymmetricMemory.apply(q, k, k, v, g, beta, S0, float(scale), output_final_state, cu_seqlens, check)
