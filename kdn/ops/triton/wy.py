"""The inter-chunk + WY backward of fla's asymmetric chunk-64 delta rule, split over K-blocks: a faster drop-in for
fla 0.6.0's ``chunk_precond_kda_bwd_wy_dqkg`` (``transpose_state_layout=False``), same values, dtypes and order.

Shapes (``B = 1`` with ``cu_seqlens``; ``NT``: chunks of ``BT`` rows in all, ``[B, NT/B]`` when not packed):
``q, k, k_precond [B,T,H,K]``, ``v, v_new, do, dv [B,T,H,V]``, ``g [B,T,H,K]`` the gate's cumulative sum within
each chunk (log2 space), ``beta [B,T,H]``, ``A [B,T,H,BT]`` (the WY inverse), ``h, dh [B,NT/B,H,K,V]`` (the chunk
states and their gradients). Returns ``dq, dk, dkg [B,T,H,K]`` (FP32), ``dv2 [B,T,H,V]`` (v's dtype), ``db [B,T,H]``,
``dg [B,T,H,K]``, ``dA [B,T,H,BT]`` (FP32).

Design. fla runs one program per chunk and head that walks every K-block and, inside, every V-block with four FP32
accumulators live and a barrier in the inner loop: at the training shape 8192 long serial programs, bound by
latency rather than by memory. Here two kernels:

1. ``_dqkg_kernel``, grid ``(NK * NT, B*H)``, ``NK = cdiv(K, BK)`` (the K-blocks of one chunk in neighbouring programs,
   so that they share ``v_new, do, dv`` in L2): one K-block per program; it loops over the V-blocks for
   ``dq, dkg, dw [BT,BK]`` and ``dgk [BK]``, stores ``dq, dk, dkg, dg`` of its block and writes its share of
   ``dA`` (``dw kg^T [BT,BT]``) and of ``db [BT]`` to FP32 scratch ``[NK, NT, H, ...]``.
2. ``_dA_kernel``, grid ``(NT, B*H)``: the part that does not depend on K (``dv2 = (A^T dv) beta``, the ``dv v^T``
   term of ``dA``, the ``sum(A^T dv * v)`` term of ``db``), plus the sum of the K-blocks' shares, then fla's
   strictly lower, beta-scaled sandwich ``dA = -A^T (dA beta) A^T`` (``A^T``: ``A``'s chunk block as fla loads it).

The K-independent part sits in the second kernel rather than in the ``i_k == 0`` programs: every program of the
first kernel then does the same work, and the second loads ``A``'s block once for both of its uses. ``BK`` is
64 (less for K < 64), not tuned: on an H200 at K = 128 the first kernel takes the same time at BK = 32 and 64, but 32
doubles the shares that the second kernel reads (and the autotuner, timing the first alone, cannot see that).

The first kernel also exists as a TileLang program for Hopper (sm_90; asynchronous copies and wgmma,
:mod:`kdn.ops.tilelang.wy`), for 16-bit inputs with ``K`` and ``V`` multiples of 64. ``kernel`` (or the environment
variable ``KDN_WY_KERNEL``) chooses: ``"triton"``, ``"tilelang"``, or ``"auto"`` (the default): TileLang's where it
applies, else Triton's, the portable path (other GPUs, FP32 operands, Triton's interpreter).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdn.ops.fla_internals import autotune_cache_kwargs, exp2, prepare_chunk_indices
from kdn.ops.triton.utils import kernel_choice


@triton.jit
def _locate(i_t, i_b, T, cu_seqlens, chunk_indices, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """The chunk's index among all chunks (that of ``h`` and the scratch), its index within its sequence, the
    sequence's first row and its length."""
    if IS_VARLEN:
        i_tg = i_t
        i_n = tl.load(chunk_indices + i_t * 2).to(tl.int32)
        i_t = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int64)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
    else:
        i_tg = i_b * tl.cdiv(T, BT) + i_t
        bos = i_b * T
    return i_tg, i_t, bos, T


@triton.autotune(
    configs=[triton.Config({"BV": bv}, num_warps=w, num_stages=s) for bv in (32, 64, 128) for w in (4, 8)
             for s in (2, 3)],
    key=["K", "V", "BT", "BK"],
    **autotune_cache_kwargs,
)
@triton.jit(do_not_specialize=["T"])
def _dqkg_kernel(q, k, k_precond, v_new, g, beta, A, h, do, dh, dv, dq, dk, dkg, dg, dA_part, db_part,
                 cu_seqlens, chunk_indices, scale, T, NTG, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr):
    """One K-block of one chunk and head: ``dq, dk, dkg, dg`` of the block, its shares of ``dA`` and ``db``."""
    NK: tl.constexpr = (K + BK - 1) // BK
    i_kt, i_bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_k, i_t = i_kt % NK, i_kt // NK
    i_b, i_h = i_bh // H, i_bh % H
    i_tg, i_t, bos, T = _locate(i_t, i_b, T, cu_seqlens, chunk_indices, BT, IS_VARLEN)

    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    i_last = tl.minimum(T, i_t * BT + BT) - 1
    m_last = o_t == i_last
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]

    h += (i_tg * H + i_h) * K * V
    dh += (i_tg * H + i_h) * K * V
    o_tv = (bos * H + i_h) * V + o_t[:, None] * (H * V)
    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dkg_raw = tl.zeros([BT, BK], dtype=tl.float32)
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)
    b_dgk = tl.zeros([BK], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        m_vk = m_v[:, None] & m_k[None, :]
        # [BT, BV]
        b_v_new = tl.load(v_new + o_tv + o_v[None, :], mask=m_tv, other=0.0)
        b_do = tl.load(do + o_tv + o_v[None, :], mask=m_tv, other=0.0)
        b_dv = tl.load(dv + o_tv + o_v[None, :], mask=m_tv, other=0.0)
        # [BV, BK]: the states' [K, V] blocks, transposed
        b_h = tl.load(h + o_v[:, None] + o_k[None, :] * V, mask=m_vk, other=0.0)
        b_dh = tl.load(dh + o_v[:, None] + o_k[None, :] * V, mask=m_vk, other=0.0)
        b_dgk += tl.sum(b_h * b_dh, axis=0)
        b_dq = tl.dot(b_do, b_h.to(b_do.dtype), b_dq)
        b_dkg_raw = tl.dot(b_v_new, b_dh.to(b_v_new.dtype), b_dkg_raw)
        b_dw = tl.dot(b_dv.to(b_v_new.dtype), b_h.to(b_v_new.dtype), b_dw)

    o_tk = (bos * H + i_h) * K + o_t[:, None] * (H * K) + o_k[None, :]
    o_r = tl.arange(0, BT)
    b_beta = tl.load(beta + bos * H + i_h + o_t * H, mask=m_t, other=0.0)
    b_A = tl.load(A + (bos * H + i_h) * BT + o_r[:, None] + o_t[None, :] * (H * BT), mask=m_t[None, :], other=0.0)
    b_k = tl.load(k + o_tk, mask=m_tk, other=0.0)
    b_kp = tl.load(k_precond + o_tk, mask=m_tk, other=0.0)
    b_g = tl.load(g + o_tk, mask=m_tk, other=0.0).to(tl.float32)
    b_gn = tl.load(g + (bos * H + i_h) * K + i_last.to(tl.int64) * (H * K) + o_k, mask=m_k, other=0).to(tl.float32)

    b_gk_exp = exp2(b_g)
    b_gb = b_gk_exp * b_beta[:, None]
    b_dgk *= exp2(b_gn)
    b_dq = b_dq * b_gk_exp * scale
    # WY backward, through the original k
    b_kg_orig = b_k * b_gk_exp
    b_dw = -b_dw.to(b_A.dtype)
    b_dA = tl.dot(b_dw, tl.trans(b_kg_orig.to(b_A.dtype)))
    b_dkgb = tl.dot(b_A, b_dw)
    b_db = tl.sum(b_dkgb * b_kg_orig, 1)
    b_dk = b_dkgb * b_gb
    # inter-chunk backward, through k_precond
    b_gn_g = tl.where(m_t[:, None], exp2(b_gn[None, :] - b_g), 0)
    b_dkg = b_dkg_raw * b_gn_g
    b_kg_precond = b_kp * b_gn_g
    b_kp_dkg = b_kg_precond * b_dkg_raw
    b_dgk += tl.sum(b_kp_dkg, axis=0)
    b_q = tl.load(q + o_tk, mask=m_tk, other=0.0)
    b_dg = (b_q * b_dq - b_kp_dkg + m_last[:, None] * b_dgk + b_kg_orig * b_dkgb * b_beta[:, None])

    tl.store(dq + o_tk, b_dq.to(dq.dtype.element_ty), mask=m_tk)
    tl.store(dk + o_tk, b_dk.to(dk.dtype.element_ty), mask=m_tk)
    tl.store(dkg + o_tk, b_dkg.to(dkg.dtype.element_ty), mask=m_tk)
    tl.store(dg + o_tk, b_dg.to(dg.dtype.element_ty), mask=m_tk)
    o_part = ((i_k * NTG + i_tg) * H + i_h) * BT
    tl.store(dA_part + o_part * BT + o_r[:, None] * BT + o_r[None, :], b_dA)
    tl.store(db_part + o_part + o_r, b_db)


@triton.autotune(
    configs=[triton.Config({"BV": bv}, num_warps=w, num_stages=s) for bv in (32, 64, 128) for w in (4, 8)
             for s in (2, 3)],
    key=["V", "BT", "NK"],
    **autotune_cache_kwargs,
)
@triton.jit(do_not_specialize=["T"])
def _dA_kernel(v, beta, A, dv, dv2, db, dA, dA_part, db_part, cu_seqlens, chunk_indices, T, NTG,
               H: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, NK: tl.constexpr, BV: tl.constexpr,
               IS_VARLEN: tl.constexpr):
    """One chunk and head: ``dv2``, then ``db`` and ``dA`` from the V terms and the K-blocks' shares."""
    i_t, i_bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    i_tg, i_t, bos, T = _locate(i_t, i_b, T, cu_seqlens, chunk_indices, BT, IS_VARLEN)

    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    o_r = tl.arange(0, BT)
    b_beta = tl.load(beta + bos * H + i_h + o_t * H, mask=m_t, other=0.0)
    b_A = tl.load(A + (bos * H + i_h) * BT + o_r[:, None] + o_t[None, :] * (H * BT), mask=m_t[None, :], other=0.0)

    o_tv = (bos * H + i_h) * V + o_t[:, None] * (H * V)
    b_dA = tl.zeros([BT, BT], dtype=tl.float32)
    b_db = tl.zeros([BT], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        b_v = tl.load(v + o_tv + o_v[None, :], mask=m_tv, other=0.0)
        b_dv = tl.load(dv + o_tv + o_v[None, :], mask=m_tv, other=0.0)
        b_dA = tl.dot(b_dv, tl.trans(b_v), b_dA)
        b_dvb = tl.dot(b_A, b_dv)
        b_db += tl.sum(b_dvb * b_v, 1)
        tl.store(dv2 + o_tv + o_v[None, :], (b_dvb * b_beta[:, None]).to(dv2.dtype.element_ty), mask=m_tv)
    for i_k in range(NK):
        o_part = ((i_k * NTG + i_tg) * H + i_h) * BT
        b_dA += tl.load(dA_part + o_part * BT + o_r[:, None] * BT + o_r[None, :])
        b_db += tl.load(db_part + o_part + o_r)

    m_A = (o_t[:, None] > o_t[None, :]) & (m_t[:, None] & m_t)
    b_dA = tl.where(m_A, b_dA * b_beta[None, :], 0)
    b_dA = tl.dot(b_dA.to(b_A.dtype), b_A)
    b_dA = tl.dot(b_A, b_dA.to(b_A.dtype))
    b_dA = tl.where(m_A, -b_dA, 0)
    tl.store(dA + (bos * H + i_h) * BT + o_t[:, None] * (H * BT) + o_r[None, :], b_dA.to(dA.dtype.element_ty),
             mask=m_t[:, None])
    tl.store(db + bos * H + i_h + o_t * H, b_db.to(db.dtype.element_ty), mask=m_t)


KERNELS = ("auto", "triton", "tilelang")


def use_tilelang(tensors: tuple[torch.Tensor, ...], beta: torch.Tensor, kernel: str | None) -> bool:
    """Whether the key-block kernel runs as TileLang's (module docstring) on ``tensors`` (``k``, ``v`` and the other
    16-bit inputs); ``kernel`` None reads ``KDN_WY_KERNEL``."""
    kernel = kernel_choice(kernel, "KDN_WY_KERNEL", KERNELS, "WY backward kernel")
    if kernel == "triton" or triton.knobs.runtime.interpret:
        return False
    from kdn.ops.tilelang.wy import supports

    ok = supports(*tensors, beta=beta)
    if kernel == "tilelang" and not ok:
        raise ValueError("the TileLang WY backward needs an sm_90 GPU, TileLang, 16-bit k, v and states of one dtype "
                         "and K, V multiples of 64: set KDN_WY_KERNEL=triton (or auto)")
    return ok


def chunk_asym_bwd_wy_dqkg(
    q: torch.Tensor, k: torch.Tensor, k_precond: torch.Tensor, v: torch.Tensor, v_new: torch.Tensor,
    g: torch.Tensor, beta: torch.Tensor, A: torch.Tensor, h: torch.Tensor, do: torch.Tensor, dh: torch.Tensor,
    dv: torch.Tensor, scale: float, cu_seqlens: torch.LongTensor | None = None, chunk_size: int = 64,
    chunk_indices: torch.LongTensor | None = None, kernel: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """fla's ``chunk_precond_kda_bwd_wy_dqkg`` (state layout ``[K, V]``): ``dq, dk, dkg, dv2, db, dg, dA``
    (shapes and dtypes in the module's docstring); ``kernel``: ``"auto"``, ``"triton"`` or ``"tilelang"`` (None:
    ``KDN_WY_KERNEL``, else ``"auto"``)."""
    B, T, H, K, V = *k.shape, v.shape[-1]
    BT = chunk_size
    if chunk_indices is None and cu_seqlens is not None:
        chunk_indices = prepare_chunk_indices(cu_seqlens, BT)
    NT = triton.cdiv(T, BT) if cu_seqlens is None else len(chunk_indices)
    NTG = B * NT  # every chunk (B = 1 when packed)
    varlen = cu_seqlens is not None

    dv2 = torch.empty_like(v)
    db = torch.empty_like(beta, dtype=torch.float)
    dA = torch.empty_like(A, dtype=torch.float)
    if BT == 64 and use_tilelang((k, v, q, k_precond, v_new, A, h, do, dh, dv), beta, kernel):
        from kdn.ops.tilelang.wy import wy_dqkg_tilelang

        dq, dk, dkg, dg, dA_part, db_part = wy_dqkg_tilelang(q, k, k_precond, v_new, g, beta, A, h, do, dh, dv,
                                                             scale, cu_seqlens, chunk_indices)
        NK = dA_part.shape[0]
    else:
        dq = torch.empty_like(q, dtype=torch.float)
        dk = torch.empty_like(k, dtype=torch.float)
        dkg = torch.empty_like(k_precond, dtype=torch.float)
        dg = torch.empty_like(g, dtype=torch.float)
        BK = min(64, max(16, triton.next_power_of_2(K)))
        NK = triton.cdiv(K, BK)
        dA_part = q.new_empty(NK, NTG, H, BT, BT, dtype=torch.float)
        db_part = q.new_empty(NK, NTG, H, BT, dtype=torch.float)
        _dqkg_kernel[(NK * NT, B * H)](
            q, k, k_precond, v_new, g, beta, A, h, do, dh, dv, dq, dk, dkg, dg, dA_part, db_part, cu_seqlens,
            chunk_indices, scale, T, NTG, H=H, K=K, V=V, BT=BT, BK=BK, IS_VARLEN=varlen)
    _dA_kernel[(NT, B * H)](v, beta, A, dv, dv2, db, dA, dA_part, db_part, cu_seqlens, chunk_indices, T, NTG,
                            H=H, V=V, BT=BT, NK=NK, IS_VARLEN=varlen)
    return dq, dk, dkg, dv2, db, dg, dA
