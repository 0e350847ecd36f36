"""The fused Isotropic gain (docs/math.md §4, §6): Triton kernels, their launches and the autograd node.

A program holds one (sequence, head) segment and walks it in chunks of ``BT`` tokens; inside a chunk the scalar
Möbius matrices are composed with ``tl.associative_scan`` (renormalised, FP32), pairing each prediction with the
previous token's update, ``N_t = [[a_t + w_t u_{t-1}, w_t], [u_{t-1}, 1]]``, so the scan emits ``b^_t`` directly. The
first launch composes the segments and stores the per-token ``abar = mean_K exp(2g)`` and ``||k||^2``; the second
applies the earlier segments' maps to ``b0`` and runs the segment's chunks. The backward keeps one carry per chunk;
each chunk recomputes ``b^`` in time order, passes it through a per-program scratch buffer to read it back reversed
(``tl.associative_scan(reverse=True)`` is avoided: triton-lang/triton#4362), and runs the affine adjoint as a forward
scan over the reversed rows.

Packed sequences (``cu_seqlens``): as the Diagonal gain's; the segment holding a sequence's last token writes its
final state (segment 0 for an empty sequence, whose state passes through).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kdn.ops.triton.utils import (
    _ISO_BT,
    _adjoint_combine,
    _affine_combine,
    _check_gain_shapes,
    _last_segment,
    _mobius_combine,
    _seg_chunks,
    _segments,
    _sequence,
    _softplus_grad,
)


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
    k_ptr, g_ptr, w_ptr, r_ptr, mu_ptr, A_ptr, abar_ptr, n_ptr, carry_ptr, seg_ptr, dbeta_ptr, dbT_ptr, scratch_ptr,
    dk_mem_ptr, dkappa_mem_ptr, dg_mem_ptr, dk_ptr, dg_ptr, dw_ptr, dr_ptr, dmu_ptr, db0_ptr, dA_ptr, dbias_ptr,
    cu_ptr, T, NS, SEGC, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
    IS_VARLEN: tl.constexpr, ACCUMULATE: tl.constexpr, DG_CHUNK: tl.constexpr, GATE: tl.constexpr,
):
    # one (sequence*head, segment): the later segments' adjoint maps give lambda at the segment's last token,
    # then its chunks, latest first; ACCUMULATE: dk adds the memory's gradients of the same k on both of its sides
    # (dk_mem, dkappa_mem [B,T,H,K]) and dg the memory's, dg_mem [B,T,H,K] holding per-token terms whose reverse
    # cumulative sums within chunks of DG_CHUNK tokens (a multiple of BT) are that gradient: a cumulative sum over
    # the reversed rows plus a carry from the chunk's later tokens, started after the segment's end; GATE: dg_ptr
    # takes the gradient of KDA's gate input f (g = -exp(A_log) softplus(f + dt_bias)), and the program's partial
    # sums of those of A_log and dt_bias go to dA [N*H, NS] and dbias [N*H, NS, K]
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
    gA = tl.exp(tl.load(A_ptr + h).to(tl.float32)) if GATE else 1.0
    dA = tl.zeros([BK], tl.float32)
    dbias = tl.zeros([BK], tl.float32)
    sc = scratch_ptr + (bh * NS + s) * (4 * BT)
    one = tl.full([BT], 1.0, tl.float32)
    zero = tl.zeros([BT], tl.float32)
    first = ar == BT - 1
    c0, c1 = _seg_chunks(s, SEGC, Tn, BT)
    NT = tl.cdiv(T, BT)
    dgc = tl.zeros([BK], tl.float32)
    if ACCUMULATE:
        for t in range(c1 * BT, tl.minimum(tl.cdiv(c1 * BT, DG_CHUNK) * DG_CHUNK, Tn), BT):
            rt = t + ar
            mt = rt < Tn
            idx = ((bos + rt) * H + h)[:, None] * K + offs_k[None, :]
            dgc += tl.sum(tl.load(dg_mem_ptr + idx, mask=mt[:, None] & mk[None, :], other=0.0), axis=0)
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
        g = tl.load(g_ptr + idx, mask=m, other=0.0)
        a = tl.exp(2.0 * g)
        dk = 2.0 * kf * dn[:, None]
        dg = (2.0 / K) * a * (b_prev * dbh)[:, None]
        if ACCUMULATE:
            dk += tl.load(dk_mem_ptr + idx, mask=m, other=0.0).to(tl.float32)
            dk += tl.load(dkappa_mem_ptr + idx, mask=m, other=0.0).to(tl.float32)
            dgm = tl.load(dg_mem_ptr + idx, mask=m, other=0.0).to(tl.float32)
            dg += tl.cumsum(dgm, axis=0) + dgc[None, :]
            dgc = tl.where(t0 % DG_CHUNK == 0, 0.0, dgc + tl.sum(dgm, axis=0))
        tl.store(dk_ptr + idx, dk.to(dk_ptr.dtype.element_ty), mask=m)
        if GATE:  # dg/df = -gA sigmoid(f + dt_bias), the sigmoid from softplus(f + dt_bias) = -g / gA
            dA += tl.sum(tl.where(m, dg * g, 0.0), axis=0)
            dg = tl.where(m, -gA * dg * _softplus_grad(-g / gA), 0.0)
            dbias += tl.sum(dg, axis=0)
        tl.store(dg_ptr + idx, dg.to(dg_ptr.dtype.element_ty), mask=m)
        tl.store(dw_ptr + tok, dbh, mask=mt)
        tl.store(dr_ptr + tok, -dbeta * bhat / (s_row * s_row) - du * u / r, mask=mt)
        dmu += du * n / (K * r)
        lam = tl.sum(tl.where(first, P * lam + Q, 0.0), axis=0)  # lambda_{t0-1}
    if s == 0:
        tl.store(db0_ptr + bh, lam)
    tl.store(dmu_ptr + bh * NS + s, tl.sum(dmu, axis=0))
    if GATE:
        tl.store(dA_ptr + bh * NS + s, tl.sum(dA, axis=0))
        tl.store(dbias_ptr + (bh * NS + s) * K + offs_k, dbias, mask=mk)


def _iso_gain_fwd(
    k: Tensor, g: Tensor, omega: Tensor, r: Tensor, mu: Tensor, b0: Tensor, out_dtype: torch.dtype,
    cu_seqlens: Tensor | None, N: int, L: int, segment_size: int | None, A_log: Tensor | None = None,
) -> tuple[tuple[Tensor, Tensor], tuple[Tensor | None, ...]]:
    """The Isotropic gain's forward launches: ``((beta, b_T), saved)``, ``saved`` what :func:`_iso_gain_bwd` takes
    (``k``, FP32 gates, the per-token ``abar`` and ``||k||^2``, the chunks' carries, ``cu_seqlens``, ``A_log``).
    ``A_log [H]``: ``g`` is the output of KDA's gate with these ``A_log`` (:func:`kdn.ops.triton.gate.kda_gate_fwd`),
    whose backward the gain's takes on."""
    B, T, H, K = k.shape
    k = k.contiguous()
    g, omega, r, mu, b0 = (x.float().contiguous() for x in (g, omega, r, mu, b0))
    SEGC, NS = _segments(N * H, L, _ISO_BT, segment_size=segment_size)
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
    A_log = None if A_log is None else A_log.detach().float().contiguous()
    return (beta, bT), (k, g, omega, r, mu, abar, n, carry, cu_seqlens, A_log)


def _iso_gain_bwd(
    saved: tuple[Tensor | None, ...], dbeta: Tensor, dbT: Tensor, N: int, L: int, need_dmu: bool,
    segment_size: int | None, mem_grads: tuple[Tensor, Tensor, Tensor] | None = None, mem_dg_chunk: int = 0,
    f_dtype: torch.dtype = torch.float32,
) -> tuple[Tensor | None, ...]:
    """The Isotropic gain's backward launches: ``(dk, dg, domega, dr, dmu, db0)`` from ``saved``
    (:func:`_iso_gain_fwd`) and the gradients of ``beta`` (any float dtype) and ``b_T``. ``mem_grads = (dk_mem,
    dkappa_mem, dg_mem)``, ``[B,T,H,K]`` each: the memory's gradients of the same ``k`` (read and write key) and
    ``g``, added in the last launch in FP32, ``dg_mem`` given before its reverse cumulative sums within chunks of
    ``mem_dg_chunk`` tokens, which that launch takes. ``dmu`` is ``None`` unless ``need_dmu``. When ``g`` came from
    KDA's gate (``A_log`` saved), ``dg`` is that of the gate's input ``f`` (in ``f_dtype``) and a seventh output
    ``dgate = (dA_log [H], ddt_bias [H*K])`` (FP32) follows; ``None`` otherwise."""
    k, g, omega, r, mu, abar, n, carry, cu_seqlens, A_log = saved
    gate = A_log is not None
    if mem_grads is not None and (mem_dg_chunk <= 0 or mem_dg_chunk % _ISO_BT):
        raise ValueError(f"mem_dg_chunk must be a positive multiple of {_ISO_BT} (the gain's tile), got {mem_dg_chunk}")
    H, K = k.shape[2:]
    SEGC, NS = _segments(N * H, L, _ISO_BT, segment_size=segment_size)
    dbeta = dbeta.contiguous()
    dk_mem, dkappa_mem, dg_mem = (x.contiguous() for x in mem_grads) if mem_grads is not None else (dbeta,) * 3
    dk, dg = torch.empty_like(k), torch.empty_like(g, dtype=f_dtype if gate else g.dtype)
    dw, dr = torch.empty_like(omega), torch.empty_like(r)
    db0 = torch.empty(N, H, device=k.device, dtype=torch.float32)
    dmu = torch.empty(N, H, NS, device=k.device, dtype=torch.float32)
    seg = torch.empty(N * H, NS, 2, device=k.device, dtype=torch.float32)
    scratch = torch.empty(N * H * NS * 4 * _ISO_BT, device=k.device, dtype=torch.float32)
    dA, dbias = (seg.new_empty(N, H, NS), seg.new_empty(N, H, NS, K)) if gate else (dmu, dmu)
    tiles = {"H": H, "K": K, "BT": _ISO_BT, "IS_VARLEN": cu_seqlens is not None}
    _iso_seg_bwd_kernel[(N * H, NS)](omega, r, mu, abar, n, carry, dbeta, seg, cu_seqlens, L, NS, SEGC, **tiles)
    _iso_gain_bwd_kernel[(N * H, NS)](k, g, omega, r, mu, A_log if gate else mu, abar, n, carry, seg, dbeta,
                                      dbT.float().contiguous(), scratch, dk_mem, dkappa_mem, dg_mem, dk, dg, dw, dr,
                                      dmu, db0, dA, dbias, cu_seqlens, L, NS, SEGC, BK=triton.next_power_of_2(K),
                                      ACCUMULATE=mem_grads is not None,
                                      DG_CHUNK=mem_dg_chunk if mem_grads is not None else _ISO_BT, GATE=gate, **tiles)
    dgate = (dA.sum((0, 2)), dbias.sum((0, 2)).view(-1)) if gate else None
    return dk, dg, dw, dr, dmu.sum((0, 2)) if need_dmu else None, db0, dgate


class _IsotropicGain(torch.autograd.Function):
    """``(k, g, omega, r, mu, b0) -> (beta, b_T)``: the fused Isotropic gain, forward and backward.

    Each direction is two launches on a ``(N*H, NS)`` grid: the segments' compositions, then the segments
    (``N``, ``NS`` as in :class:`kdn.ops.triton.gain_diagonal._DiagonalGain`).
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, k: Tensor, g: Tensor, omega: Tensor, r: Tensor, mu: Tensor,
        b0: Tensor, out_dtype: torch.dtype, cu_seqlens: Tensor | None, N: int, L: int, segment_size: int | None,
    ) -> tuple[Tensor, Tensor]:
        outs, saved = _iso_gain_fwd(k, g, omega, r, mu, b0, out_dtype, cu_seqlens, N, L, segment_size)
        ctx.save_for_backward(*saved)
        ctx.seqs, ctx.segment_size = (N, L), segment_size
        return outs

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, dbeta: Tensor, dbT: Tensor) -> tuple[Tensor | None, ...]:
        grads = _iso_gain_bwd(ctx.saved_tensors, dbeta, dbT, *ctx.seqs, ctx.needs_input_grad[4], ctx.segment_size)
        return *grads[:-1], None, None, None, None, None


def isotropic_gain(
    k: Tensor, g: Tensor, omega: Tensor, r: Tensor, mu: Tensor, b0: Tensor, out_dtype: torch.dtype = torch.float32,
    *, cu_seqlens: Tensor | None = None, segment_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Fused Triton Isotropic gains: ``beta [B,T,H]`` in ``out_dtype`` and ``b_T [N,H]`` (FP32).

    ``k, g: [B,T,H,K]``, ``omega, r: [B,T,H]``, ``mu: [H]``, ``b0: [N,H]``; ``N`` and ``cu_seqlens`` as in
    :func:`kdn.ops.triton.gain_diagonal.diagonal_gain`; ``segment_size``: tokens per segment (a multiple of 32)
    instead of :func:`kdn.ops.triton.utils.gain_segments`' rule. Differentiable in every tensor input.

    Example::

        beta, bT = isotropic_gain(k, g, omega, r, mu, b0, torch.bfloat16)  # CUDA tensors
    """
    N, L = _check_gain_shapes(k, g, omega, r, mu, b0, True, cu_seqlens)
    return _IsotropicGain.apply(k, g, omega, r, mu, b0, out_dtype, cu_seqlens, N, L, segment_size)
