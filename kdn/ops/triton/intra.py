"""The intra-chunk backward of fla's asymmetric chunk-64 delta rule, one program per chunk: a faster drop-in for fla
0.6.0's ``chunk_precond_kda_bwd_kernel_intra`` when the gates are inside fla's safe envelope
(:mod:`kdn.ops.triton.safe_gate`), with the reverse cumulative sum of ``dg`` within each chunk fused.

Within a chunk of 64 rows (``g`` the gate's cumulative sum in log2 units, row ``t >= s`` column):
``Aqk[t,s] = sum_k q[t,k] kp[s,k] 2^(g[t,k] - g[s,k])`` and
``Akk[t,s] = beta[t] sum_k k[t,k] kp[s,k] 2^(g[t,k] - g[s,k])``. Their gradients ``dAqk, dAkk [B,T,H,64]`` give
the intra-chunk terms added to ``dq, dk`` (row side), ``dkp`` (column side), ``db`` and the per-token ``dg``.

Design. fla runs one program per 16-row block and key block of 32, which reloads the earlier blocks' ``kp, g`` and
the later ones' ``q, k, g``, and walks the diagonal block token by token or through a second, bf16x3 dot. Here one
program takes a whole chunk and key block and loads each input once. A decay is split at the reference of the
16-row block ``j`` on the far side of the pair, ``r_j = g[16 j] - 7.5 SHIFT`` (fla's reference for its safe-gate
diagonal blocks): ``2^(g[t] - g[s]) = 2^(g[t] - r_j) 2^(r_j - g[s])``. The factor on block ``j``'s own rows stays
within ``2^(+-87)`` inside the envelope (a 16-token block whose gates fall by at most 75 nats, ``SHIFT`` the 2-nat
step in log2 units), so block ``j``'s operand of ``[16, BK]`` is a plain dot operand, and each block costs one
``[64, 16] x [16, BK]`` dot per output and ``dA`` (wgmma on Hopper): the dots do ``64 x 64 x BK`` per output, no
more than the dense product. The factor on the other side varies by row, so the accumulator is kept, row by row,
in the frame of the last block it took from, and moved to the next block's frame by the vector ``2^(r_j - r_j')``
(at most 1: the gates only fall); a row leaves the loop in its own block's frame, which one ``[64, BK]`` factor
turns back. ``dq, dk`` take the column blocks first to last, ``dkp`` the row blocks last to first. ``dg``'s
reverse sum within the chunk is a scan over the program's rows instead of a second pass over an FP32
``[B,T,H,K]`` tensor.

Dots whose precision is not named run at TF32 (fla's off-diagonal blocks do too) and at TF32x3 in the FP32 route's
copy (:mod:`kdn.ops.triton.precision`). Outside the envelope the caller keeps fla's kernel, whose token loop is exact
for any gate.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdn.ops.fla_internals import RCP_LN2, autotune_cache_kwargs, exp2


@triton.jit
def _block(g, j, n, H: tl.constexpr, K: tl.constexpr, o_j, o_k, m_k, BC: tl.constexpr, SHIFT: tl.constexpr):
    """Block ``j`` of a chunk of ``n`` valid rows (``g`` at the chunk's first row): its reference
    ``g[16 j] - 7.5 SHIFT`` ``[BK]`` (from the last valid row for a block past the end, whose terms are all masked),
    its gates ``[BC, BK]`` with their offsets and mask, its rows within the chunk and their mask."""
    o_s = j * BC + o_j
    m_s = o_s < n
    m_sk = m_s[:, None] & m_k[None, :]
    p_sk = o_s[:, None] * (H * K) + o_k[None, :]
    b_ref = tl.load(g + tl.minimum(j * BC, n - 1) * (H * K) + o_k, mask=m_k, other=0.) - 0.5 * (BC - 1) * SHIFT
    return b_ref, tl.load(g + p_sk, mask=m_sk, other=0.), p_sk, m_sk, o_s, m_s


@triton.autotune(
    configs=[triton.Config({}, num_warps=w, num_stages=s) for w in (4, 8) for s in (1, 2, 3)],
    key=["H", "K", "BK", "REVERSE_SUM"],
    **autotune_cache_kwargs,
)
@triton.jit(do_not_specialize=["T", "NROWS"])
def _intra_bwd_kernel(q, k, k_precond, g, beta, dAqk, dAkk, dq, dk, dkp, dg, dq2, dk2, dkp2, dg2, db, cu_seqlens,
                      chunk_indices, T, NROWS, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                      BK: tl.constexpr, SHIFT: tl.constexpr, IS_VARLEN: tl.constexpr, REVERSE_SUM: tl.constexpr):
    """One chunk, head and key block: ``dq2, dk2, dkp2, dg2`` of the block and its share of ``db`` (``NROWS``: the
    rows of all sequences, ``B * T``). Pointers move to the chunk's first row; offsets within it are int32."""
    NC: tl.constexpr = BT // BC
    i_k, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_t * 2).to(tl.int32)
        i_t = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int32)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
    else:
        bos = i_b.to(tl.int64) * T
    n = T - i_t * BT  # valid rows of the chunk (more than BT in all but the last)
    row0 = (bos + i_t * BT) * H + i_h
    q, k, k_precond, g = q + row0 * K, k + row0 * K, k_precond + row0 * K, g + row0 * K
    dq, dk, dkp, dg = dq + row0 * K, dk + row0 * K, dkp + row0 * K, dg + row0 * K
    dq2, dk2, dkp2, dg2 = dq2 + row0 * K, dk2 + row0 * K, dkp2 + row0 * K, dg2 + row0 * K
    dAqk, dAkk, beta, db = dAqk + row0 * BT, dAkk + row0 * BT, beta + row0, db + i_k.to(tl.int64) * NROWS * H + row0

    o_c = tl.arange(0, BT)
    o_j = tl.arange(0, BC)
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    m_t = o_c < n
    m_tk = m_t[:, None] & m_k[None, :]
    p_tk = o_c[:, None] * (H * K) + o_k[None, :]

    # columns s of block j, ascending; rows t >= s: dq, dk in the frame of block j's reference (module docstring)
    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    b_prev = tl.full([BK], float("inf"), dtype=tl.float32)
    for j in range(NC):
        b_ref, b_gs, p_sk, m_sk, o_s, m_s = _block(g, j, n, H, K, o_j, o_k, m_k, BC, SHIFT)
        b_x = tl.where(m_sk, tl.load(k_precond + p_sk, mask=m_sk, other=0.).to(tl.float32)
                       * exp2(b_ref[None, :] - b_gs), 0.)
        m_a = m_t[:, None] & m_s[None, :] & (o_c[:, None] >= o_s[None, :])
        p_a = o_c[:, None] * (H * BT) + o_s[None, :]
        m_open = (o_c >= j * BC)[:, None]  # rows not yet complete move to this block's frame
        b_r = exp2(b_ref - b_prev)[None, :]
        b_dq = tl.dot(tl.load(dAqk + p_a, mask=m_a, other=0.).to(tl.float32), b_x, tl.where(m_open, b_dq * b_r, b_dq))
        b_dk = tl.dot(tl.load(dAkk + p_a, mask=m_a, other=0.).to(tl.float32), b_x, tl.where(m_open, b_dk * b_r, b_dk))
        b_prev = b_ref

    # rows t of block i, descending; columns s <= t: dkp in the frame of block i's reference
    b_dkp = tl.zeros([BT, BK], dtype=tl.float32)
    b_next = tl.full([BK], float("-inf"), dtype=tl.float32)
    for m in range(NC):
        i = NC - 1 - m
        b_ref, b_gs, p_sk, m_sk, o_s, m_s = _block(g, i, n, H, K, o_j, o_k, m_k, BC, SHIFT)
        b_e = exp2(b_gs - b_ref[None, :])
        b_yq = tl.where(m_sk, tl.load(q + p_sk, mask=m_sk, other=0.).to(tl.float32) * b_e, 0.)
        b_yk = tl.where(m_sk, tl.load(k + p_sk, mask=m_sk, other=0.).to(tl.float32) * b_e
                        * tl.load(beta + o_s * H, mask=m_s, other=0.).to(tl.float32)[:, None], 0.)
        # block i's rows of dA, read along the rows (coalesced) and transposed in registers: [BT(s), BC(t)]
        m_a = m_s[:, None] & m_t[None, :] & (o_c[None, :] <= o_s[:, None])
        p_a = o_s[:, None] * (H * BT) + o_c[None, :]
        m_open = (o_c < i * BC + BC)[:, None]
        b_dkp = tl.where(m_open, b_dkp * exp2(b_next - b_ref)[None, :], b_dkp)
        b_dkp = tl.dot(tl.trans(tl.load(dAqk + p_a, mask=m_a, other=0.).to(tl.float32)), b_yq, b_dkp)
        b_dkp = tl.dot(tl.trans(tl.load(dAkk + p_a, mask=m_a, other=0.).to(tl.float32)), b_yk, b_dkp)
        b_next = b_ref

    # each row ends in its own block's frame: back to true scale
    p_ref = tl.minimum(o_c // BC * BC, n - 1)[:, None] * (H * K) + o_k[None, :]
    b_d = tl.load(g + p_tk, mask=m_tk, other=0.) - tl.load(g + p_ref, mask=m_tk, other=0.) + 0.5 * (BC - 1) * SHIFT
    b_up = tl.where(m_tk, exp2(b_d), 0.)
    b_dq *= b_up
    b_dk *= b_up
    b_dkp *= tl.where(m_tk, exp2(-b_d), 0.)

    # one output at a time, each tile dead once stored
    b_dg = tl.load(dg + p_tk, mask=m_tk, other=0.) + tl.load(q + p_tk, mask=m_tk, other=0.).to(tl.float32) * b_dq
    tl.store(dq2 + p_tk, (b_dq + tl.load(dq + p_tk, mask=m_tk, other=0.)).to(dq2.dtype.element_ty), mask=m_tk)
    b_k = tl.load(k + p_tk, mask=m_tk, other=0.).to(tl.float32)
    tl.store(db + o_c * H, tl.sum(b_dk * b_k, 1), mask=m_t)
    b_dk *= tl.load(beta + o_c * H, mask=m_t, other=0.).to(tl.float32)[:, None]
    b_dg += b_k * b_dk
    tl.store(dk2 + p_tk, (b_dk + tl.load(dk + p_tk, mask=m_tk, other=0.)).to(dk2.dtype.element_ty), mask=m_tk)
    b_dg -= tl.load(k_precond + p_tk, mask=m_tk, other=0.).to(tl.float32) * b_dkp
    tl.store(dkp2 + p_tk, (b_dkp + tl.load(dkp + p_tk, mask=m_tk, other=0.)).to(dkp2.dtype.element_ty), mask=m_tk)
    if REVERSE_SUM:
        b_dg = tl.cumsum(b_dg, 0, reverse=True)
    tl.store(dg2 + p_tk, b_dg, mask=m_tk)


def launch_sizes(K: int, T: int, chunk_size: int, block_k: int, cu_seqlens: torch.Tensor | None,
                 chunk_indices: torch.Tensor | None) -> tuple[int, int, int]:
    """The key block, key blocks and chunks of an intra-chunk backward launch ``(BK, NK, NT)``; refuses chunks other
    than 64 and packed sequences without ``chunk_indices`` in one line."""
    if chunk_size != 64:
        raise ValueError(f"the intra-chunk backward is written for chunks of 64 rows, got {chunk_size}: "
                         "pass chunk_size=64")
    if cu_seqlens is not None and chunk_indices is None:
        raise ValueError("packed sequences need chunk_indices: pass prepare_chunk_indices(cu_seqlens, 64) "
                         "(fla.ops.utils)")
    BK = min(block_k, max(16, triton.next_power_of_2(K)))
    return BK, triton.cdiv(K, BK), triton.cdiv(T, chunk_size) if cu_seqlens is None else len(chunk_indices)


def new_outputs(q: torch.Tensor, k: torch.Tensor, k_precond: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                NK: int) -> tuple[torch.Tensor, ...]:
    """The launch's outputs ``(dq2, dk2, dkp2, dg2, db2)``: the first three like their inputs, ``dg2`` FP32 like
    ``g``, ``db2`` FP32 ``[NK, *beta.shape]`` (one share per key block, summed after the launch)."""
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(k_precond),
            torch.empty_like(g, dtype=torch.float), beta.new_empty(NK, *beta.shape, dtype=torch.float))


def chunk_asym_bwd_intra(
    q: torch.Tensor, k: torch.Tensor, k_precond: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    dAqk: torch.Tensor, dAkk: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dk_precond: torch.Tensor,
    db: torch.Tensor, dg: torch.Tensor, cu_seqlens: torch.LongTensor | None = None,
    chunk_indices: torch.LongTensor | None = None, chunk_size: int = 64, dg_chunk_sums: bool = True,
    block_k: int = 64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The intra-chunk backward for gates inside fla's safe envelope: what fla's ``chunk_precond_kda_bwd_intra``
    returns, with ``dg``'s reverse cumulative sum within each chunk fused (``dg_chunk_sums``).

    Args:
        q, k, k_precond: ``[B,T,H,K]``. g: ``[B,T,H,K]`` FP32, the gate's cumulative sum within each chunk (log2).
        beta: ``[B,T,H]``. dAqk, dAkk: ``[B,T,H,64]``, the gradients of the chunk blocks of ``Aqk`` and ``Akk``.
        dq, dk, dk_precond, dg: ``[B,T,H,K]``, the inter-chunk terms the intra-chunk ones are added to (``dg``
            per token). db: ``[B,T,H]`` FP32, likewise. cu_seqlens: ``[N+1]`` (``B = 1``) or None. chunk_indices:
            ``[NT, 2]`` (sequence, chunk) of the packed chunks, required with ``cu_seqlens``. chunk_size: 64.
        dg_chunk_sums: ``dg`` summed from each token to its chunk's end (the gradient of the raw gate); False: per
            token. block_k: key columns per program (a power of two, at least 16).

    Returns:
        ``(dq, dk, dk_precond, db, dg)``: the first three in ``q, k, k_precond``'s dtypes, ``db`` and ``dg`` FP32.

    Examples:
        >>> dq2, dk2, dkp2, db2, dg2 = chunk_asym_bwd_intra(q, k, kp, gc, beta, dAqk, dAkk, dq, dk, dkp, db, dg)
    """
    B, T, H, K = k.shape
    BT, BC = chunk_size, 16
    BK, NK, NT = launch_sizes(K, T, chunk_size, block_k, cu_seqlens, chunk_indices)
    dq2, dk2, dkp2, dg2, db2 = new_outputs(q, k, k_precond, g, beta, NK)
    _intra_bwd_kernel[(NK, NT, B * H)](
        q, k, k_precond, g, beta, dAqk, dAkk, dq, dk, dk_precond, dg, dq2, dk2, dkp2, dg2, db2, cu_seqlens,
        chunk_indices, T, B * T, H=H, K=K, BT=BT, BC=BC, BK=BK, SHIFT=2.0 * RCP_LN2, IS_VARLEN=cu_seqlens is not None,
        REVERSE_SUM=dg_chunk_sums)
    return dq2, dk2, dkp2, db2.sum(0).add_(db), dg2
