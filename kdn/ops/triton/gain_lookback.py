"""The Diagonal gain in one launch per direction (docs/math.md §3, §6): each input is read once.

The three-launch gain (:mod:`kdn.ops.triton.gain_diagonal`) reads ``k``, ``g`` and ``omega`` twice each way and keeps
every token's ``p`` in FP32 for its backward. Here a program holds one (sequence, head) segment of ``SEG`` tokens as
``[SEG, K]`` tiles in registers and takes its entering carry from the segments before it while it runs:

- **Forward.** Each token's map from the previous prediction to its own, ``G_t = A_t U_{t-1}`` with
  ``A = [[a, w], [0, 1]]`` (the prediction ``p^ = a p + w``) and ``U = [[1, 0], [u, 1]]`` (the update
  ``p = p^ / (1 + u p^)``, ``u = mu k^2 / r``; ``U = I`` on a segment's first token), is formed divided by
  ``(1 + w)(1 + u)``: entries in ``[0, 1]`` from ``1 / (1 + u) = r / (r + mu k^2)``. ``tl.associative_scan`` composes
  them (renormalised by the largest entry), so ``p^_t`` of every token follows from the carry ``p_{t0-1}`` at once.
  The segment's posterior map (the last token's update after the composition) is published for the later
  segments; then the program takes its carry, applies it and writes ``kappa``.
- **Carries, deterministic.** Segments form groups of ``GROUP``. A program composes the maps of its group's earlier
  segments, latest first, and applies them to the value entering the group, which the group's last segment
  publishes after applying its own map to its carry. The result does not depend on which programs ran first (bitwise
  the same from run to run), and the serial chain is one link per group. Programs take their segment from an atomic
  ticket in launch order, so a program only waits for programs that started before it; tickets run over every
  (sequence, head) before the next segment, so the programs resident at once span all the chains.
- **Backward.** From the saved carries, each program recomputes ``p^`` by the same scan and ``p_{t-1}`` (the
  previous row through its update, gathered), forms the adjoint steps ``lambda_{t-1} = a (e + lambda_t / d^2)``
  (``d = 1 + u p^``, ``e`` the direct gradient of ``p^``), composes them over the reversed rows
  (``tl.flip``; ``tl.associative_scan(reverse=True)`` is avoided: triton-lang/triton#4362) and takes ``lambda`` at its
  last token from the later segments the same way, latest groups first. Then every gradient, as the three-launch
  gain's last backward launch: the memory's gradients of ``k`` and ``g`` added (``dg``'s reverse sums within chunks
  of ``DG_CHUNK`` tokens, which segments divide), KDA's gate's backward, fla's DPLR operands.

Publishing: a segment's values are stored, the program's threads meet (``tl.debug_barrier``) and one release
exchange sets its flag (1: its map, 2: its group's value); readers spin on an acquire read of the flag, then read
the values with volatile loads. Flags and the ticket counter are one zeroed int32 buffer per launch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kdn.ops.triton.utils import (
    _adjoint_combine,
    _affine_combine,
    _mobius_combine,
    _sequence,
    _softplus,
    _softplus_grad,
)

LOOKBACK_SEGMENT = 16  # tokens a program: [16, K] FP32 tiles (the fastest of 16, 32 and 64 measured, both directions)
LOOKBACK_GROUP = 8  # segments whose maps a program may compose before the value entering their group
LOOKBACK_WARPS = 4


@triton.jit
def _lb_wait(flag_ptr, at, level):
    # spin until the flag at `at` reaches `level` (acquire: the values published before it are visible)
    f = tl.atomic_add(flag_ptr + at, 0, sem="acquire")
    while f < level:
        f = tl.atomic_add(flag_ptr + at, 0, sem="acquire")


@triton.jit
def _lb_signal(flag_ptr, at, level):
    # every thread's stores before the flag (release)
    tl.debug_barrier()
    tl.atomic_xchg(flag_ptr + at, level, sem="release")


@triton.jit
def _lb_rows(k_ptr, g_ptr, w_ptr, r_ptr, bos, h, t0, Tn, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
             SEG: tl.constexpr, OMEGA_SOFTPLUS: tl.constexpr):
    # rows t0 + [0, SEG) of the sequence at row bos (Tn tokens) in time order: k (FP32), g, omega (after its
    # softplus when OMEGA_SOFTPLUS), r, the previous row's k and r (zero and one on the segment's first row and past
    # the end), the element and row offsets and the masks; rows past the end are identity steps (k = g = omega = 0,
    # r = 1)
    ar = tl.arange(0, SEG)
    rows = t0 + ar
    mt = rows < Tn
    offs_k = tl.arange(0, BK)
    mk = offs_k < K
    tok = (bos + rows) * H + h
    m = mt[:, None] & mk[None, :]
    idx = tok[:, None] * K + offs_k[None, :]
    kf = tl.load(k_ptr + idx, mask=m, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + idx, mask=m, other=0.0)
    w = tl.load(w_ptr + idx, mask=m, other=0.0).to(tl.float32)
    if OMEGA_SOFTPLUS:
        w = tl.where(m, _softplus(w), 0.0)
    r = tl.load(r_ptr + tok, mask=mt, other=1.0)
    mp = (ar > 0) & mt
    kp = tl.load(k_ptr + idx - H * K, mask=mp[:, None] & mk[None, :], other=0.0).to(tl.float32)
    rp = tl.load(r_ptr + tok - H, mask=mp, other=1.0)
    return kf, g, w, r, kp, rp, idx, tok, m, mt


@triton.jit
def _lb_scan(g, w, kp, rp, mu):
    # the composed maps p_{t0-1} -> p^_t of every row: G_t = A_t U_{t-1} / ((1 + w)(1 + u_{t-1})), scanned
    xp = mu * kp * kp
    den = rp[:, None] + xp
    rho = rp[:, None] / den
    sig = xp / den
    tau = 1.0 / (1.0 + w)
    wt = w * tau
    return tl.associative_scan((tl.exp(2.0 * g) * tau * rho + wt * sig, wt * rho, sig * tau, rho * tau), 0,
                               _mobius_combine)


@triton.jit
def _lb_apply(m11, m12, m21, m22, p):
    return (m11 * p + m12) / (m21 * p + m22)


@triton.jit
def _lb_row(x, sel):
    # the row of x [SEG, BK] where sel [SEG] holds
    return tl.sum(tl.where(sel[:, None], x, 0.0), axis=0)


@triton.jit
def _lb_segment_map(P11, P12, P21, P22, kf, r, mu, sel):
    # the segment's posterior map p_{t0-1} -> p_{t1-1}: the last row's composition, then its update
    # U / (1 + u) = [[rho, 0], [u rho, rho]] (rho = 1 / (1 + u)), renormalised
    rl = tl.sum(tl.where(sel, r, 0.0), axis=0)
    kl = _lb_row(kf, sel)
    xl = mu * kl * kl
    rho = rl / (rl + xl)
    l11, l12 = _lb_row(P11, sel), _lb_row(P12, sel)
    l21, l22 = _lb_row(P21, sel), _lb_row(P22, sel)
    return _mobius_combine(l11, l12, l21, l22, rho, 0.0, xl / (rl + xl), rho)


@triton.jit
def _lb_program(flag_ptr, cu_ptr, NS, NHS, T, SEG: tl.constexpr, H: tl.constexpr, IS_VARLEN: tl.constexpr,
                REVERSE: tl.constexpr):
    # this program's (sequence*head, segment) from its ticket: segments in time order (latest first when REVERSE),
    # so that a program waits only for programs that took their tickets before it; every sequence*head's segment
    # before any one's next, so that the programs running at once advance all the carry chains together rather than
    # a few chains link by link
    ticket = tl.atomic_add(flag_ptr + NHS, 1).to(tl.int64)
    NH = NHS // NS
    bh = ticket % NH
    s = ticket // NH
    if REVERSE:
        s = NS - 1 - s
    bos, Tn = _sequence(cu_ptr, bh // H, T, IS_VARLEN)
    return bh, s, bh % H, bos, Tn, s * SEG


@triton.jit
def _lb_fwd_kernel(
    k_ptr, g_ptr, w_ptr, r_ptr, mu_ptr, p0_ptr, map_ptr, grp_ptr, flag_ptr, carry_ptr, kappa_ptr, a_ptr, b_ptr,
    pT_ptr, cu_ptr, T, NS, NHS, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, SEG: tl.constexpr,
    GROUP: tl.constexpr, EMIT_AB: tl.constexpr, IS_VARLEN: tl.constexpr, OMEGA_SOFTPLUS: tl.constexpr,
):
    # one (sequence*head, segment): map [NHS, 4, K] (its posterior map), grp [NHS, K] (the value leaving its group,
    # from a group's last segment), carry [NHS, K] (the value entering it, kept for the backward), kappa (and
    # DPLR's a = exp(g) k, b = -kappa) and p_T from the sequence's last segment
    bh, s, h, bos, Tn, t0 = _lb_program(flag_ptr, cu_ptr, NS, NHS, T, SEG, H, IS_VARLEN, False)
    offs_k = tl.arange(0, BK)
    mk = offs_k < K
    sid = bh * NS + s
    if t0 < Tn:
        mu = tl.load(mu_ptr + h)
        kf, g, w, r, kp, rp, idx, _, m, _ = _lb_rows(k_ptr, g_ptr, w_ptr, r_ptr, bos, h, t0, Tn, H, K, BK, SEG,
                                                        OMEGA_SOFTPLUS)
        P11, P12, P21, P22 = _lb_scan(g, w, kp, rp, mu)
        ar = tl.arange(0, SEG)
        last = t0 + SEG >= Tn
        m11, m12, m21, m22 = _lb_segment_map(P11, P12, P21, P22, kf, r, mu, ar == tl.minimum(Tn - t0, SEG) - 1)
        mp = map_ptr + sid * 4 * K + offs_k
        tl.store(mp, m11, mask=mk)
        tl.store(mp + K, m12, mask=mk)
        tl.store(mp + 2 * K, m21, mask=mk)
        tl.store(mp + 3 * K, m22, mask=mk)
        _lb_signal(flag_ptr, sid, 1)
        # the group's earlier segments' maps, latest first, then the value entering the group
        first = s - s % GROUP
        c11 = tl.full([BK], 1.0, tl.float32)
        c12 = tl.zeros([BK], tl.float32)
        c21 = tl.zeros([BK], tl.float32)
        c22 = tl.full([BK], 1.0, tl.float32)
        for j in range(s - first):
            at = sid - 1 - j
            _lb_wait(flag_ptr, at, 1)
            jp = map_ptr + at * 4 * K + offs_k
            c11, c12, c21, c22 = _mobius_combine(
                tl.load(jp, mask=mk, other=1.0, volatile=True), tl.load(jp + K, mask=mk, other=0.0, volatile=True),
                tl.load(jp + 2 * K, mask=mk, other=0.0, volatile=True),
                tl.load(jp + 3 * K, mask=mk, other=1.0, volatile=True), c11, c12, c21, c22)
        if first == 0:
            p_in = tl.load(p0_ptr + bh * K + offs_k, mask=mk, other=1.0)
        else:
            _lb_wait(flag_ptr, bh * NS + first - 1, 2)
            p_in = tl.load(grp_ptr + (bh * NS + first - 1) * K + offs_k, mask=mk, other=1.0, volatile=True)
        carry = _lb_apply(c11, c12, c21, c22, p_in)
        tl.store(carry_ptr + sid * K + offs_k, carry, mask=mk)
        if last:
            tl.store(pT_ptr + bh * K + offs_k, _lb_apply(m11, m12, m21, m22, carry), mask=mk)
        elif s % GROUP == GROUP - 1:
            tl.store(grp_ptr + sid * K + offs_k, _lb_apply(m11, m12, m21, m22, carry), mask=mk)
            _lb_signal(flag_ptr, sid, 2)
        ph = _lb_apply(P11, P12, P21, P22, carry[None, :])
        kappa = ph * kf / (r + tl.sum(ph * kf * kf, axis=1))[:, None]
        tl.store(kappa_ptr + idx, kappa.to(kappa_ptr.dtype.element_ty), mask=m)
        if EMIT_AB:
            tl.store(a_ptr + idx, (tl.exp(g) * kf).to(a_ptr.dtype.element_ty), mask=m)
            tl.store(b_ptr + idx, (-kappa).to(b_ptr.dtype.element_ty), mask=m)
    elif s == 0:  # an empty sequence keeps p0
        p0 = tl.load(p0_ptr + bh * K + offs_k, mask=mk, other=1.0)
        tl.store(carry_ptr + sid * K + offs_k, p0, mask=mk)
        tl.store(pT_ptr + bh * K + offs_k, p0, mask=mk)


@triton.jit
def _lb_bwd_kernel(
    k_ptr, g_ptr, w_ptr, r_ptr, mu_ptr, A_ptr, carry_ptr, dkappa_ptr, da_ptr, db_ptr, dpT_ptr, dk_mem_ptr,
    dg_mem_ptr, map_ptr, grp_ptr, flag_ptr, dk_ptr, dg_ptr, dw_ptr, dr_ptr, dmu_ptr, dp0_ptr, dA_ptr, dbias_ptr,
    cu_ptr, T, NS, NHS, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, SEG: tl.constexpr, GROUP: tl.constexpr,
    EMIT_AB: tl.constexpr, IS_VARLEN: tl.constexpr, OMEGA_SOFTPLUS: tl.constexpr, GATE: tl.constexpr,
    ACCUMULATE: tl.constexpr, DG_CHUNK: tl.constexpr,
):
    # one (sequence*head, segment), latest segments first: map [NHS, 2, K] (its adjoint map lambda_{t1-1} ->
    # lambda_{t0-1}), grp [NHS, K] (lambda before its group, from a group's first segment), then every gradient;
    # ACCUMULATE, DG_CHUNK, GATE as in kdn.ops.triton.gain_diagonal._diag_gain_bwd_kernel (DG_CHUNK a multiple of
    # SEG); the program's partial sums of dmu (and of the gate's dA_log, ddt_bias) go to dmu [NHS] (dA [NHS],
    # dbias [NHS, K]), zeros past the sequence's end
    bh, s, h, bos, Tn, t0 = _lb_program(flag_ptr, cu_ptr, NS, NHS, T, SEG, H, IS_VARLEN, True)
    offs_k = tl.arange(0, BK)
    mk = offs_k < K
    sid = bh * NS + s
    dmu = tl.zeros([BK], tl.float32)
    dA = tl.zeros([BK], tl.float32)
    dbias = tl.zeros([BK], tl.float32)
    if t0 < Tn:
        mu = tl.load(mu_ptr + h)
        kf, g, w, r, kp, rp, idx, tok, m, mt = _lb_rows(k_ptr, g_ptr, w_ptr, r_ptr, bos, h, t0, Tn, H, K, BK,
                                                            SEG, OMEGA_SOFTPLUS)
        carry = tl.load(carry_ptr + sid * K + offs_k, mask=mk, other=1.0)
        P11, P12, P21, P22 = _lb_scan(g, w, kp, rp, mu)
        ph = _lb_apply(P11, P12, P21, P22, carry[None, :])
        ar = tl.arange(0, SEG)
        # p_{t-1}: the previous row's prediction through its update (the carry on the first row)
        php = tl.gather(ph, tl.maximum(ar - 1, 0)[:, None] + tl.zeros([SEG, BK], tl.int32), 0)
        p_prev = tl.where((ar == 0)[:, None], carry[None, :], php / (1.0 + mu * kp * kp / rp[:, None] * php))
        a = tl.exp(2.0 * g)
        k2 = kf * kf
        u = mu / r[:, None] * k2
        d = 1.0 + u * ph
        cc = 1.0 / (d * d)
        srow = r + tl.sum(ph * k2, axis=1)
        dkap = tl.load(dkappa_ptr + idx, mask=m, other=0.0).to(tl.float32)
        if EMIT_AB:
            dkap -= tl.load(db_ptr + idx, mask=m, other=0.0).to(tl.float32)
        c = tl.sum(dkap * ph * kf, axis=1) / srow
        e = (dkap * kf - c[:, None] * k2) / srow[:, None]
        # the adjoint steps over the reversed rows: (P, Q) lambda_{t1-1} -> lambda_{t-1}, (R, S) -> lambda_t
        one = tl.full([SEG, BK], 1.0, tl.float32)
        aP, aQ, aR, aS = tl.associative_scan((tl.flip(a * cc, 0), tl.flip(a * e, 0), one, one - 1.0), 0,
                                             _adjoint_combine)
        top = ar == SEG - 1  # the reversed rows' last: the segment's first token
        mP, mQ = _lb_row(aP, top), _lb_row(aQ, top)
        s_last = tl.cdiv(Tn, SEG) - 1
        if s > 0:
            tl.store(map_ptr + sid * 2 * K + offs_k, mP, mask=mk)
            tl.store(map_ptr + sid * 2 * K + K + offs_k, mQ, mask=mk)
            _lb_signal(flag_ptr, sid, 1)
        # lambda at the segment's last token: the group's later segments' maps, earliest first, then the value
        # entering the group from after it (dp_T after the sequence's last segment)
        end = tl.minimum(s - s % GROUP + GROUP, s_last + 1)
        cP = tl.full([BK], 1.0, tl.float32)
        cQ = tl.zeros([BK], tl.float32)
        for j in range(end - 1 - s):
            at = sid + 1 + j
            _lb_wait(flag_ptr, at, 1)
            cP, cQ = _affine_combine(cP, cQ, tl.load(map_ptr + at * 2 * K + offs_k, mask=mk, other=1.0, volatile=True),
                                     tl.load(map_ptr + at * 2 * K + K + offs_k, mask=mk, other=0.0, volatile=True))
        if end > s_last:
            lam_in = tl.load(dpT_ptr + bh * K + offs_k, mask=mk, other=0.0)
        else:
            _lb_wait(flag_ptr, bh * NS + end, 2)
            lam_in = tl.load(grp_ptr + (bh * NS + end) * K + offs_k, mask=mk, other=0.0, volatile=True)
        lam_end = cP * lam_in + cQ
        lam_first = mP * lam_end + mQ  # lambda_{t0-1}
        if s == 0:
            tl.store(dp0_ptr + bh * K + offs_k, lam_first, mask=mk)
        elif s % GROUP == 0:
            tl.store(grp_ptr + sid * K + offs_k, lam_first, mask=mk)
            _lb_signal(flag_ptr, sid, 2)
        lam = tl.flip(aR * lam_end[None, :] + aS, 0)
        dph = e + cc * lam
        du = -lam * ph * ph * cc
        dk = (dkap * ph - 2.0 * c[:, None] * ph * kf) / srow[:, None] + 2.0 * mu / r[:, None] * du * kf
        dg = 2.0 * a * p_prev * dph
        if EMIT_AB:
            da = tl.load(da_ptr + idx, mask=m, other=0.0).to(tl.float32) * tl.exp(g)
            dk += da
            dg += da * kf
        if ACCUMULATE:
            dk += tl.load(dk_mem_ptr + idx, mask=m, other=0.0).to(tl.float32)
            dgm = tl.load(dg_mem_ptr + idx, mask=m, other=0.0).to(tl.float32)
            if DG_CHUNK > 0:
                # reverse sums within the chunk: this segment's rows, then the chunk's rows after the segment
                dgm = tl.flip(tl.cumsum(tl.flip(dgm, 0), 0), 0)
                tail = tl.zeros([BK], tl.float32)
                for tt in range(t0 + SEG, tl.minimum((t0 // DG_CHUNK + 1) * DG_CHUNK, Tn), SEG):
                    mt2 = tt + ar < Tn
                    idx2 = ((bos + tt + ar) * H + h)[:, None] * K + offs_k[None, :]
                    rest = tl.load(dg_mem_ptr + idx2, mask=mt2[:, None] & mk[None, :], other=0.0)
                    tail += tl.sum(rest.to(tl.float32), axis=0)
                dgm += tail[None, :]
            dg += dgm
        dg = tl.where(m, dg, 0.0)
        tl.store(dk_ptr + idx, dk.to(dk_ptr.dtype.element_ty), mask=m)
        if GATE:  # g = -gA softplus(x), x = f + dt_bias: dg/dx = -gA sigmoid(x), sigmoid(x) from softplus(x) = -g / gA
            gA = tl.exp(tl.load(A_ptr + h).to(tl.float32))
            dA = tl.sum(dg * g, axis=0)
            dg = -gA * dg * _softplus_grad(-g / gA)
            dbias = tl.sum(dg, axis=0)
        tl.store(dg_ptr + idx, dg.to(dg_ptr.dtype.element_ty), mask=m)
        dw = dph * _softplus_grad(w) if OMEGA_SOFTPLUS else dph
        tl.store(dw_ptr + idx, dw.to(dw_ptr.dtype.element_ty), mask=m)
        tl.store(dr_ptr + tok, -c / srow - tl.sum(du * u, axis=1) / r, mask=mt)
        dmu = tl.sum(du * k2 / r[:, None], axis=0)
    elif s == 0:  # an empty sequence passes dp_T through
        tl.store(dp0_ptr + bh * K + offs_k, tl.load(dpT_ptr + bh * K + offs_k, mask=mk, other=0.0), mask=mk)
    tl.store(dmu_ptr + sid, tl.sum(dmu, axis=0))
    if GATE:
        tl.store(dA_ptr + sid, tl.sum(dA, axis=0))
        tl.store(dbias_ptr + sid * K + offs_k, dbias, mask=mk)


def lookback_segments(L: int, segment_size: int | None) -> tuple[int, int]:
    """``(tokens per segment, segments)`` of the one-launch gain for sequences of at most ``L`` tokens:
    ``segment_size`` (a power of two from 16 to 64) or :data:`LOOKBACK_SEGMENT`."""
    seg = LOOKBACK_SEGMENT if segment_size is None else segment_size
    if seg not in (16, 32, 64):
        raise ValueError(f"the one-launch Diagonal gain takes segment_size 16, 32 or 64 (a divisor of the memory's "
                         f"chunk, held in registers), got {segment_size!r}")
    return seg, max(triton.cdiv(L, seg), 1)


def _tiles(H: int, K: int, seg: int, cu_seqlens: Tensor | None) -> dict[str, int | bool]:
    return {"H": H, "K": K, "BK": triton.next_power_of_2(K), "SEG": seg, "GROUP": LOOKBACK_GROUP,
            "IS_VARLEN": cu_seqlens is not None, "num_warps": LOOKBACK_WARPS}


def lookback_fwd_launch(
    k: Tensor, g: Tensor, omega: Tensor, r: Tensor, mu: Tensor, p0: Tensor, carry: Tensor, kappa: Tensor, a: Tensor,
    b: Tensor, pT: Tensor, cu_seqlens: Tensor | None, L: int, seg: int, emit_ab: bool, omega_softplus: bool,
) -> None:
    """The one-launch forward into the buffers that :func:`kdn.ops.triton.gain_diagonal._diag_gain_fwd` prepared
    (contiguous inputs, FP32 gates): ``carry [N*H, NS, K]`` (:func:`lookback_segments`' segments), ``kappa`` (and
    ``a, b`` when ``emit_ab``), ``p_T``."""
    H, K = k.shape[2:]
    NHS = carry.shape[0] * carry.shape[1]
    maps = carry.new_empty(NHS, 4, K)
    grp = carry.new_empty(NHS, K)
    flags = torch.zeros(NHS + 1, dtype=torch.int32, device=k.device)
    _lb_fwd_kernel[(NHS,)](k, g, omega, r, mu, p0, maps, grp, flags, carry, kappa, a, b, pT, cu_seqlens, L,
                           carry.shape[1], NHS, EMIT_AB=emit_ab, OMEGA_SOFTPLUS=omega_softplus,
                           **_tiles(H, K, seg, cu_seqlens))


def lookback_bwd_launch(
    saved: tuple[Tensor | None, ...], grads: tuple[Tensor, ...], outs: tuple[Tensor, ...], L: int, seg: int,
    flags: dict[str, bool | int],
) -> None:
    """The one-launch backward into the buffers that :func:`kdn.ops.triton.gain_diagonal._diag_gain_bwd` prepared:
    ``saved`` from the forward, ``grads = (dkappa, da, db, dp_T, dk_mem, dg_mem)`` (stand-ins where unused),
    ``outs = (dk, dg, domega, dr, dmu, dp0, dA, dbias)`` (``dmu, dA [N, H, NS]``, ``dbias [N, H, NS, K]``: each
    program's partial sums), ``flags`` the kernel's ``EMIT_AB, OMEGA_SOFTPLUS, GATE, ACCUMULATE, DG_CHUNK`` (a
    multiple of ``seg``)."""
    k, g, omega, r, mu, carry, cu_seqlens, A_log = saved
    if flags["DG_CHUNK"] % seg:
        raise ValueError(f"the memory's chunk of {flags['DG_CHUNK']} tokens must be a multiple of the gain's segment "
                         f"of {seg}")
    H, K = k.shape[2:]
    NS = carry.shape[1]
    NHS = carry.shape[0] * NS
    maps = carry.new_empty(NHS, 2, K)
    grp = carry.new_empty(NHS, K)
    ready = torch.zeros(NHS + 1, dtype=torch.int32, device=k.device)
    _lb_bwd_kernel[(NHS,)](k, g, omega, r, mu, A_log if flags["GATE"] else mu, carry, *grads, maps,
                           grp, ready, *outs, cu_seqlens, L, NS, NHS, **flags, **_tiles(H, K, seg, cu_seqlens))
