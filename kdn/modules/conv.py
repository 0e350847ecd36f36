"""The front end's short convolutions on CUDA, fused: causal depthwise conv (width 4) + SiLU over ``q, k, v`` and
the L2 norm of ``q`` and ``k`` per head, one Triton pass each way, read from and written to the joint projection
(:func:`front_conv`, the CUDA path of :meth:`kdn.modules.DeltaFrontEnd.inputs`; :func:`front_conv_step`, one
decoding token over the conv windows, updated in place).

The three streams are the first ``C = 2HK + HV`` columns of the joint projection ``y [B, T, N]`` (one GEMM computes
every projection of the layer input). A program holds ``G`` heads of one stream (a warp each, the head's channels
across its lanes) and walks ``L`` tokens one by one, loading each row a token ahead. Forward, oldest first: ``z_t =
sum_m w[:, W-1-m] x_{t-m}`` from the last four inputs kept in registers (taps before the sequence's first token are
zero), ``s = silu(z)``, and for ``q, k`` ``s / sqrt(||s||^2 + eps)``, in FP32; only the input is saved. When every
program lies inside one sequence (batch rows, ``T`` a multiple of ``L``), the rows outside its sequence read as
zeros and no tap is masked; otherwise (packed sequences, ``MASKED``) each tap is masked by the token's position.
Backward, latest first: the gradient reaching ``z_u`` (through the norm and the SiLU, recomputed from the same four
inputs) is kept for three tokens, since ``dx_t = sum_l w[:, W-1-l] dz_{t+l}``; a program first walks the three rows
after its own. ``dx`` is written into the joint gradient's first ``C`` columns and the other columns get the
gradients of the projections passed through (``rest``), so the GEMM's input gradient reads one tensor and no ``cat``
assembles it. The weights' gradient is a per-program partial ``[NB, C, W]`` summed in torch.

fla's kernels for the same work (``causal_conv1d`` per stream, then ``l2norm`` on ``q`` and ``k``) take three
convolutions and two norms each way, store the convolutions' bf16 outputs for the norms, and split the joint
gradient with a ``cat``. Packed sequences: ``pos [B*T]`` holds each token's index in its own sequence.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

L_FWD, L_BWD = 64, 64  # default tokens per program in each direction
HEADS = 1  # default heads per program at most (one warp each); the largest power of two dividing H up to it is taken


@triton.jit
def _setup(w_ptr, j0, H, K, V, W: tl.constexpr, G: tl.constexpr, BD: tl.constexpr):
    # the program's G heads (all of q, all of k, or all of v): their columns in the joint projection, in their own
    # stream, each element's channel and the channel mask, whether they are normalised (q, k) and the taps
    # w[:, W-1-m] for m = 0..3 (m: the lag)
    stream = j0 // H
    is_qk = stream < 2
    width = tl.where(is_qk, K, V)
    c = tl.arange(0, BD)[None, :] + tl.zeros([G, BD], tl.int32)
    own = ((j0 % H) + tl.arange(0, G))[:, None] * width + c
    col = tl.where(is_qk, stream * H * K, 2 * H * K) + own
    mc = c < width
    w0 = tl.load(w_ptr + col * W + (W - 1), mask=mc, other=0.0).to(tl.float32)
    w1 = tl.load(w_ptr + col * W + (W - 2), mask=mc, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + col * W + (W - 3), mask=mc, other=0.0).to(tl.float32)
    w3 = tl.load(w_ptr + col * W + (W - 4), mask=mc, other=0.0).to(tl.float32)
    return stream, is_qk, width, own, col, c, mc, w0, w1, w2, w3


@triton.jit
def _stream(stream, q_ptr, k_ptr, v_ptr, H, K, V):
    # the tensor of the program's stream (q, k or v: their outputs, or their outputs' gradients) and its row stride
    if stream == 0:
        ptr = q_ptr
    elif stream == 1:
        ptr = k_ptr
    else:
        ptr = v_ptr
    return ptr, tl.where(stream < 2, H * K, H * V)


@triton.jit
def _row(ptr, t, stride, col, c, width, lo, hi):
    # row t of a [rows, stride] tensor at the columns col [G, BD] (channels c < width) in FP32, zeros unless
    # lo <= t < hi (a comparison: the interpreter rejects a vector & a scalar mask)
    ok = (t >= lo) & (t < hi)
    return tl.load(ptr + t * stride + col, mask=c < tl.where(ok, width, 0), other=0.0).to(tl.float32)


@triton.jit
def _pos(pos_ptr, t, T, M, IS_VARLEN: tl.constexpr):
    # row t's index in its own sequence (packed rows outside [0, M) give 0)
    if IS_VARLEN:
        return tl.load(pos_ptr + t, mask=(t >= 0) & (t < M), other=0).to(tl.int64)
    return t % T


@triton.jit
def _next_pos(pos_ptr, t, p, T, M, BACKWARD: tl.constexpr, IS_VARLEN: tl.constexpr, MASKED: tl.constexpr):
    # the position of row t, the row after (BACKWARD: before) the one at position p: loaded when packed, p moved by
    # one (modulo T) when MASKED, else not needed (p)
    if IS_VARLEN:
        return _pos(pos_ptr, t, T, M, IS_VARLEN)
    if MASKED:
        if BACKWARD:
            return tl.where(p == 0, T - 1, p - 1)
        return tl.where(p + 1 == T, 0, p + 1)
    return p


@triton.jit
def _bounds(t0, t1, T, M, MASKED: tl.constexpr):
    # the rows a program [t0, t1) may read around its own: with MASKED the positions mask each tap (packed
    # sequences, or programs across a sequence's boundary), so all of [0, M); else its sequence's rows (programs
    # inside one sequence: rows before a sequence's start and after its end read as zeros)
    if MASKED:
        return t0 * 0, t1 * 0 + M
    return tl.where(t0 % T == 0, t0, 0), tl.where(t1 % T == 0, t1, M)


@triton.jit
def _taps(a0, a1, a2, a3, p, w0, w1, w2, w3, MASKED: tl.constexpr):
    # sum_m w_m a_m in FP32; with MASKED the terms m > p are left out (p: a position in the sequence)
    if MASKED:
        return (w0 * a0 + tl.where(p >= 1, w1 * a1, 0.0) + tl.where(p >= 2, w2 * a2, 0.0)
                + tl.where(p >= 3, w3 * a3, 0.0))
    return w0 * a0 + w1 * a1 + w2 * a2 + w3 * a3


@triton.jit
def _act(z, is_qk, eps):
    # sigmoid(z) and the output: silu(z), divided by its L2 norm per head (row) for q and k
    sg = tl.sigmoid(z)
    s = z * sg
    rstd = tl.where(is_qk, 1.0 / tl.sqrt(tl.sum(s * s, 1) + eps), 1.0)
    return sg, s * rstd[:, None], rstd


@triton.jit
def _front_conv1d_fwd_kernel(y_ptr, w_ptr, pos_ptr, q_ptr, k_ptr, v_ptr, M, T, stride_y, H, K, V, eps, L,
                             W: tl.constexpr, G: tl.constexpr, BD: tl.constexpr, IS_VARLEN: tl.constexpr,
                             MASKED: tl.constexpr):
    # rows [t0, t0 + L) of G heads, oldest first: z_t = sum_m w[:, W-1-m] x_{t-m} from the last four inputs, kept in
    # registers; the next row is loaded a token ahead
    j0 = tl.program_id(1) * G
    stream, is_qk, width, own, col, c, mc, w0, w1, w2, w3 = _setup(w_ptr, j0, H, K, V, W, G, BD)
    out_ptr, out_stride = _stream(stream, q_ptr, k_ptr, v_ptr, H, K, V)
    t0 = tl.program_id(0).to(tl.int64) * L
    t1 = tl.minimum(t0 + L, M)
    lo = _bounds(t0, t1, T, M, MASKED)[0]
    x3 = _row(y_ptr, t0 - 3, stride_y, col, c, width, lo, M)
    x2 = _row(y_ptr, t0 - 2, stride_y, col, c, width, lo, M)
    x1 = _row(y_ptr, t0 - 1, stride_y, col, c, width, lo, M)
    x0 = _row(y_ptr, t0, stride_y, col, c, width, lo, M)
    p = _pos(pos_ptr, t0, T, M, IS_VARLEN)
    for t in range(t0, t1):
        xn = _row(y_ptr, t + 1, stride_y, col, c, width, 0, t1)
        pn = _next_pos(pos_ptr, t + 1, p, T, M, False, IS_VARLEN, MASKED)
        o = _act(_taps(x0, x1, x2, x3, p, w0, w1, w2, w3, MASKED), is_qk, eps)[1]
        tl.store(out_ptr + t * out_stride + own, o.to(out_ptr.dtype.element_ty), mask=mc)
        x3, x2, x1, x0, p = x2, x1, x0, xn, pn


@triton.jit
def _dz(x0, x1, x2, x3, do, p, w0, w1, w2, w3, is_qk, eps, MASKED: tl.constexpr):
    # the gradient reaching the pre-activation z_u from the output's, do (through the L2 norm and the SiLU, z_u
    # recomputed from its inputs x_u .. x_{u-3}; p: u's position in its sequence)
    z = _taps(x0, x1, x2, x3, p, w0, w1, w2, w3, MASKED)
    sg, o, rstd = _act(z, is_qk, eps)
    ds = tl.where(is_qk, (do - o * tl.sum(o * do, 1)[:, None]) * rstd[:, None], do)
    return ds * sg * (1.0 + z * (1.0 - sg))


@triton.jit
def _front_conv1d_bwd_kernel(y_ptr, w_ptr, pos_ptr, dq_ptr, dk_ptr, dv_ptr, dy_ptr, dw_ptr, M, T, stride_y, H, K, V,
                             eps, L, W: tl.constexpr, G: tl.constexpr, BD: tl.constexpr, IS_VARLEN: tl.constexpr,
                             MASKED: tl.constexpr):
    # rows [t0, t1) of G heads, latest first: dx_u = sum_l w[:, W-1-l] dz_{u+l} needs the gradient reaching the
    # next three pre-activations, kept in registers (as are the four inputs z_u reads); the next row's input and
    # output gradient are loaded a token ahead
    j0 = tl.program_id(1) * G
    stream, is_qk, width, own, col, c, mc, w0, w1, w2, w3 = _setup(w_ptr, j0, H, K, V, W, G, BD)
    do_ptr, do_stride = _stream(stream, dq_ptr, dk_ptr, dv_ptr, H, K, V)
    i_t = tl.program_id(0).to(tl.int64)
    t0 = i_t * L
    t1 = tl.minimum(t0 + L, M)
    lo, hi = _bounds(t0, t1, T, M, MASKED)
    u = t1 + 2
    x0 = _row(y_ptr, u, stride_y, col, c, width, lo, M)
    x1 = _row(y_ptr, u - 1, stride_y, col, c, width, lo, M)
    x2 = _row(y_ptr, u - 2, stride_y, col, c, width, lo, M)
    x3 = _row(y_ptr, u - 3, stride_y, col, c, width, lo, M)
    do = _row(do_ptr, u, do_stride, own, c, width, t0, hi)
    p = _pos(pos_ptr, u, T, M, IS_VARLEN)
    dz1 = tl.zeros([G, BD], tl.float32)
    dz2 = tl.zeros([G, BD], tl.float32)
    dz3 = tl.zeros([G, BD], tl.float32)
    p1 = p  # the positions of rows u + 1, u + 2, u + 3 (their dz are zero until computed)
    p2 = p
    p3 = p
    # rows t1 + 2 .. t1 first (zero past M or, unless MASKED, past the sequence's end; with MASKED the positions
    # leave out those of another sequence), unrolled: with a branch on the row inside one loop over all rows, the
    # gradients came out wrong on an H200 (Triton 3.6) though right in the interpreter
    for _i in tl.static_range(3):
        xn = _row(y_ptr, u - 4, stride_y, col, c, width, lo, M)
        don = _row(do_ptr, u - 1, do_stride, own, c, width, t0, hi)
        pn = _next_pos(pos_ptr, u - 1, p, T, M, True, IS_VARLEN, MASKED)
        dz = _dz(x0, x1, x2, x3, do, p, w0, w1, w2, w3, is_qk, eps, MASKED)
        dz3, dz2, dz1, p3, p2, p1 = dz2, dz1, dz, p2, p1, p
        x0, x1, x2, x3, do, p, u = x1, x2, x3, xn, don, pn, u - 1
    dw0 = tl.zeros([G, BD], tl.float32)
    dw1 = tl.zeros([G, BD], tl.float32)
    dw2 = tl.zeros([G, BD], tl.float32)
    dw3 = tl.zeros([G, BD], tl.float32)
    for i in range(t1 - t0):
        u = t1 - 1 - i
        xn = _row(y_ptr, u - 4, stride_y, col, c, width, lo, M)
        don = _row(do_ptr, u - 1, do_stride, own, c, width, t0, hi)
        pn = _next_pos(pos_ptr, u - 1, p, T, M, True, IS_VARLEN, MASKED)
        dz = _dz(x0, x1, x2, x3, do, p, w0, w1, w2, w3, is_qk, eps, MASKED)
        if MASKED:
            dx = w0 * dz + tl.where(p1 >= 1, w1 * dz1, 0.0) + tl.where(p2 >= 2, w2 * dz2, 0.0) \
                + tl.where(p3 >= 3, w3 * dz3, 0.0)
        else:
            dx = w0 * dz + w1 * dz1 + w2 * dz2 + w3 * dz3
        tl.store(dy_ptr + u * stride_y + col, dx.to(dy_ptr.dtype.element_ty), mask=mc)
        dw0 += dz * x0
        if MASKED:
            dw1 += tl.where(p >= 1, dz * x1, 0.0)
            dw2 += tl.where(p >= 2, dz * x2, 0.0)
            dw3 += tl.where(p >= 3, dz * x3, 0.0)
        else:
            dw1 += dz * x1
            dw2 += dz * x2
            dw3 += dz * x3
        dz3, dz2, dz1, p3, p2, p1 = dz2, dz1, dz, p2, p1, p
        x0, x1, x2, x3, do, p = x1, x2, x3, xn, don, pn
    base = dw_ptr + (i_t * (2 * H * K + H * V) + col) * W
    tl.store(base + (W - 1), dw0, mask=mc)
    tl.store(base + (W - 2), dw1, mask=mc)
    tl.store(base + (W - 3), dw2, mask=mc)
    tl.store(base + (W - 4), dw3, mask=mc)


@triton.jit
def _front_conv1d_step_kernel(y_ptr, w_ptr, sq_ptr, sk_ptr, sv_ptr, q_ptr, k_ptr, v_ptr, stride_y, H, K, V, eps,
                              W: tl.constexpr, G: tl.constexpr, BD: tl.constexpr):
    # one token of G heads of row b: z = w[:, W-1] x + sum_m w[:, W-1-m] s_{W-1-m} over the conv window s (the last
    # three inputs, oldest first), which then shifts by one and takes x (in place, in its own dtype)
    b = tl.program_id(0).to(tl.int64)
    stream, is_qk, width, own, col, c, mc, w0, w1, w2, w3 = _setup(w_ptr, tl.program_id(1) * G, H, K, V, W, G, BD)
    out_ptr, out_stride = _stream(stream, q_ptr, k_ptr, v_ptr, H, K, V)
    s_ptr = _stream(stream, sq_ptr, sk_ptr, sv_ptr, H, K, V)[0] + (b * out_stride + own) * (W - 1)
    x = tl.load(y_ptr + b * stride_y + col, mask=mc, other=0.0)
    s0 = tl.load(s_ptr, mask=mc, other=0.0)
    s1 = tl.load(s_ptr + 1, mask=mc, other=0.0)
    s2 = tl.load(s_ptr + 2, mask=mc, other=0.0)
    z = w0 * x.to(tl.float32) + w1 * s2.to(tl.float32) + w2 * s1.to(tl.float32) + w3 * s0.to(tl.float32)
    o = _act(z, is_qk, eps)[1]
    tl.store(out_ptr + b * out_stride + own, o.to(out_ptr.dtype.element_ty), mask=mc)
    tl.store(s_ptr, s1, mask=mc)
    tl.store(s_ptr + 1, s2, mask=mc)
    tl.store(s_ptr + 2, x.to(s_ptr.dtype.element_ty), mask=mc)


def _positions(M: int, cu_seqlens: Tensor | None, device: torch.device) -> Tensor | None:
    """Each packed token's index in its own sequence, int32 ``[M]`` (``None`` without ``cu_seqlens``)."""
    if cu_seqlens is None:
        return None
    t = torch.arange(M, device=device)
    seq = torch.searchsorted(cu_seqlens[1:].to(device), t, right=True)
    return (t - cu_seqlens.to(device)[seq]).to(torch.int32)


class _FrontConv(torch.autograd.Function):
    """``(y [M, N], w [C, W]) -> (q [M, HK], k [M, HK], v [M, HV], rest [M, N - C])``, ``C = 2HK + HV``."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, y: Tensor, w: Tensor, pos: Tensor | None, T: int, H: int,
                K: int, V: int, eps: float, tiles: tuple[int, int, int]) -> tuple[Tensor, ...]:
        M, N = y.shape
        C = H * (2 * K + V)
        q, k = (y.new_empty(M, H * K) for _ in range(2))
        v = y.new_empty(M, H * V)
        L_fwd, _, heads = tiles
        # Triton's interpreter (CPU tensors) runs the programs one by one: there, fewer and wider ones are faster
        G = max(g for g in (1, 2, 4, 8, 16) if g <= (heads if y.is_cuda else 16) and H % g == 0)
        meta = {"W": w.shape[1], "G": G, "BD": triton.next_power_of_2(max(K, V)), "IS_VARLEN": pos is not None,
                "num_warps": G}
        if M:
            grid = (triton.cdiv(M, L_fwd), 3 * H // G)
            _front_conv1d_fwd_kernel[grid](y, w, pos, q, k, v, M, T, N, H, K, V, eps, L_fwd,
                                           MASKED=pos is not None or T % L_fwd != 0, **meta)
        ctx.save_for_backward(y, w, pos)
        ctx.dims, ctx.meta, ctx.L_bwd = (T, H, K, V, eps), meta, tiles[1]
        return q, k, v, y[:, C:].contiguous()

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, dq: Tensor | None, dk: Tensor | None, dv: Tensor | None,
                 drest: Tensor | None) -> tuple[Tensor | None, ...]:
        y, w, pos = ctx.saved_tensors
        T, H, K, V, eps = ctx.dims
        M, N = y.shape
        C = H * (2 * K + V)
        dq, dk, dv = (y.new_zeros(s) if d is None else d.to(y.dtype).contiguous()
                      for d, s in ((dq, (M, H * K)), (dk, (M, H * K)), (dv, (M, H * V))))
        dy = torch.empty_like(y)
        if drest is None:
            dy[:, C:].zero_()
        else:
            dy[:, C:] = drest
        L_bwd = ctx.L_bwd
        NB = triton.cdiv(M, L_bwd)
        dw = w.new_empty(NB, C, w.shape[1], dtype=torch.float32)
        if M:
            grid = (NB, 3 * H // ctx.meta["G"])
            _front_conv1d_bwd_kernel[grid](y, w, pos, dq, dk, dv, dy, dw, M, T, N, H, K, V, eps, L_bwd,
                                           MASKED=pos is not None or T % L_bwd != 0, **ctx.meta)
        return dy, dw.sum(0).to(w.dtype), None, None, None, None, None, None, None


def front_conv(y: Tensor, weight: Tensor, num_heads: int, head_dim: int, value_dim: int, eps: float = 1e-6,
               cu_seqlens: Tensor | None = None, *, tokens_fwd: int = L_FWD, tokens_bwd: int = L_BWD,
               heads: int = HEADS) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The short convolutions of the joint projection ``y [B, T, N]`` (CUDA, or the CPU under Triton's interpreter).

    ``y[..., :C]`` (``C = H(2K + V)``) holds the ``q, k, v`` projections; ``weight [C, 4]`` their depthwise taps
    (``weight[:, 3]`` multiplies the current token). Returns ``q, k [B, T, H, K]`` (conv, SiLU, L2 norm per head
    with ``eps`` under the root), ``v [B, T, H, V]`` (conv, SiLU), in ``y``'s dtype, and ``rest = y[..., C:]``
    (a contiguous copy: the other projections, whose gradients this function passes back into ``y``'s).
    ``cu_seqlens [S+1]`` (``B = 1``): packed sequences, no tap crosses their boundaries. Launch tiles: ``tokens_fwd``,
    ``tokens_bwd`` tokens per program each way, at most ``heads`` heads per program (CUDA). Differentiable in ``y``
    and ``weight``."""
    for name, n in (("tokens_fwd", tokens_fwd), ("tokens_bwd", tokens_bwd), ("heads", heads)):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} must be a positive int, got {n!r}")
    B, T, N = y.shape
    H, K, V = num_heads, head_dim, value_dim
    C = H * (2 * K + V)
    if N < C or weight.dim() != 2 or weight.shape != (C, 4):
        raise ValueError(f"front_conv needs y [B, T, >= {C}] and weight [{C}, 4] for H={H}, K={K}, V={V}; got "
                         f"y {tuple(y.shape)}, weight {tuple(weight.shape)}")
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"packed sequences (cu_seqlens) need B = 1, got B = {B}")
    pos = _positions(B * T, cu_seqlens, y.device)
    q, k, v, rest = _FrontConv.apply(y.reshape(B * T, N).contiguous(), weight.contiguous(), pos, T, H, K, V, eps,
                                     (tokens_fwd, tokens_bwd, heads))
    return q.view(B, T, H, K), k.view(B, T, H, K), v.view(B, T, H, V), rest.view(B, T, N - C)


def front_conv_step(y: Tensor, weight: Tensor, state: tuple[Tensor, Tensor, Tensor], num_heads: int, head_dim: int,
                    value_dim: int, eps: float = 1e-6) -> tuple[Tensor, Tensor, Tensor]:
    """One decoding token of :func:`front_conv`, one Triton program per (row, head), no autograd (CUDA, or the CPU
    under Triton's interpreter).

    Args:
        y: ``[B, 1, N]``, the joint projection of the token; ``y[..., :C]`` (``C = H(2K + V)``) holds ``q, k, v``.
        weight: ``[C, 4]``, the depthwise taps (``weight[:, 3]`` multiplies the current token).
        state: the conv windows ``(q [B, HK, 3], k [B, HK, 3], v [B, HV, 3])``, contiguous, the last three inputs
            oldest first (:class:`kdn.modules.ShortConv`'s cache); updated in place to end with this token.

    Returns:
        ``q, k [B, 1, H, K]`` (conv, SiLU, L2 norm per head with ``eps`` under the root) and ``v [B, 1, H, V]``
        (conv, SiLU), in ``y``'s dtype, computed in FP32.
    """
    B, T, N = y.shape
    H, K, V = num_heads, head_dim, value_dim
    C = H * (2 * K + V)
    widths = (H * K, H * K, H * V)
    if T != 1 or N < C or weight.shape != (C, 4):
        raise ValueError(f"front_conv_step needs y [B, 1, >= {C}] and weight [{C}, 4] for H={H}, K={K}, V={V}; "
                         f"got y {tuple(y.shape)}, weight {tuple(weight.shape)}")
    if any(s.shape != (B, d, 3) or not s.is_contiguous() or s.dtype != state[0].dtype
           for s, d in zip(state, widths)):
        raise ValueError("front_conv_step needs contiguous conv windows of one dtype, shaped "
                         f"{[(B, d, 3) for d in widths]}; got {[(tuple(s.shape), s.dtype) for s in state]}")
    y = y.reshape(B, N).contiguous()
    q, k = (y.new_empty(B, H * K) for _ in range(2))
    v = y.new_empty(B, H * V)
    if B:
        _front_conv1d_step_kernel[(B, 3 * H)](y, weight.contiguous(), *state, q, k, v, N, H, K, V, eps, W=4, G=1,
                                              BD=triton.next_power_of_2(max(K, V)), num_warps=1)
    return q.view(B, 1, H, K), k.view(B, 1, H, K), v.view(B, 1, H, V)
