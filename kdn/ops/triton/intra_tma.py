"""The intra-chunk backward of :mod:`kdn.ops.triton.intra` with its tiles moved by tensor descriptors (TMA on Hopper).

Same math, loops and outputs as :func:`kdn.ops.triton.intra.chunk_asym_bwd_intra` (its module docstring has the
design). What differs, and why: ``intra.py`` gathers every tile through a tensor of pointers, and its sm_90 build
keeps those offsets and masks live (255 registers with spills at ``BK = 64`` and 4 warps, 199 at 8 warps). Here the
tiles come through host-made descriptors (:class:`triton.tools.tensor_descriptor.TensorDescriptor`, kernel
parameters: no register holds them) over a ``[B, H, T, K]`` view of each ``[B, T, H, K]`` tensor, so a tile is one
box ``[1, 1, rows, BK]`` at ``(b, h, t, k)``. TMA zero-fills what lies past ``T`` or ``K`` and drops it on a store,
so an unpacked batch needs no mask but the rows past the chunk's ``n`` valid ones, kept as row vectors
(``tl.where``). Packed sequences' rows past ``n`` are the next sequence's: a partial chunk stores through a
descriptor made in the kernel (``tl.make_tensor_descriptor``) over its own ``n`` rows. The epilogue also runs in
another order (``dk, dkp, dq``; ``dkp``'s factor the reciprocal of ``dq``'s), which keeps fewer tiles live at once.
Its sm_90 build has no spills at any tuned setting (128 registers at ``BK = 64``, 8 warps, 1 stage; 254 at the
4 warps, 3 stages the autotuner picks on an H100); there (Triton 3.6; 8 x 4096 tokens, 16 heads, K = 128) 1.66 ms
against intra.py's 1.99 ms and fla's 2.14 ms (``python -m bench.intra_throughput --tma``).

Limits: descriptors need 16-byte aligned bases and row strides, so ``K`` times each input's element size must be a
multiple of 16 (``K % 8 == 0`` for bf16); the in-kernel descriptors of packed sequences need a global scratch,
for which :func:`chunk_asym_bwd_intra_tma` sets a torch allocator when Triton has none.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime import _allocation
from triton.tools.tensor_descriptor import TensorDescriptor

from kdn.ops.fla_internals import RCP_LN2, autotune_cache_kwargs, exp2
from kdn.ops.triton.intra import launch_sizes, new_outputs


@triton.jit
def _ld(d, i_b, i_h, row, col, R: tl.constexpr, C: tl.constexpr):
    """The ``[R, C]`` tile at ``(i_b, i_h, row, col)`` of ``d`` (``[B, H, T, *]`` in boxes ``[1, 1, R, C]``)."""
    return d.load([i_b, i_h, row, col]).reshape(R, C)


@triton.jit
def _st(d, ptr, val, i_b, i_h, row, col, n, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
        IS_VARLEN: tl.constexpr):
    """Store the ``[BT, BK]`` tile ``val`` at ``(i_b, i_h, row, col)`` through ``d``; a packed chunk of ``n < BT``
    rows through a descriptor of its own ``n`` rows at ``ptr`` (``[1, T, H, K]``), which drops the rest."""
    val = val.to(ptr.dtype.element_ty)
    if IS_VARLEN and n < BT:
        d_n = tl.make_tensor_descriptor(ptr + (row.to(tl.int64) * H + i_h) * K, shape=[n, K], strides=[H * K, 1],
                                        block_shape=[BT, BK])
        d_n.store([0, col], val)
    else:
        d.store([i_b, i_h, row, col], val.reshape(1, 1, BT, BK))


@triton.autotune(
    configs=[triton.Config({}, num_warps=w, num_stages=s) for w in (4, 8) for s in (1, 2, 3)],
    key=["H", "K", "BK", "IS_VARLEN", "REVERSE_SUM"],
    **autotune_cache_kwargs,
)
@triton.jit(do_not_specialize=["T", "NROWS"])
def _intra_bwd_tma_kernel(t_q, t_k, t_kp, t_g, t_dq, t_dk, t_dkp, t_dg, t_dq2, t_dk2, t_dkp2, t_dg2, s_q, s_k, s_kp,
                          s_g, c_aqk, c_akk, r_aqk, r_akk, g, beta, dq2, dk2, dkp2, dg2, db, cu_seqlens, chunk_indices,
                          T, NROWS, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                          BK: tl.constexpr, SHIFT: tl.constexpr, IS_VARLEN: tl.constexpr, REVERSE_SUM: tl.constexpr):
    """``intra.py``'s ``_intra_bwd_kernel`` on descriptors: ``t_*`` in boxes ``[1, 1, BT, BK]``, ``s_*``
    ``[1, 1, BC, BK]``, ``c_*, r_*`` (``dA``) ``[1, 1, BT, BC], [1, 1, BC, BT]``; ``g, beta, db`` and the outputs as
    pointers too."""
    NC: tl.constexpr = BT // BC
    i_k, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_t * 2).to(tl.int32)
        i_t = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int32)
        bos = tl.load(cu_seqlens + i_n).to(tl.int32)
        T = tl.load(cu_seqlens + i_n + 1).to(tl.int32) - bos
        r0 = bos + i_t * BT  # the chunk's first row in the descriptors' T (one batch element)
        row0 = r0.to(tl.int64) * H + i_h
    else:
        r0 = i_t * BT
        row0 = (i_b.to(tl.int64) * T + r0) * H + i_h
    n = T - i_t * BT  # valid rows of the chunk (more than BT in all but the last)
    ok = i_k * BK
    g, beta, db = g + row0 * K, beta + row0, db + i_k.to(tl.int64) * NROWS * H + row0

    o_c = tl.arange(0, BT)
    o_j = tl.arange(0, BC)
    o_k = ok + tl.arange(0, BK)
    m_k = o_k < K
    m_t = o_c < n

    # columns s of block j, ascending; rows t >= s: dq, dk in the frame of block j's reference (intra.py)
    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    b_prev = tl.full([BK], float("inf"), dtype=tl.float32)
    for j in range(NC):
        b_ref = tl.load(g + tl.minimum(j * BC, n - 1) * (H * K) + o_k, mask=m_k, other=0.) - 0.5 * (BC - 1) * SHIFT
        m_s = (j * BC + o_j) < n
        b_x = tl.where(m_s[:, None], _ld(s_kp, i_b, i_h, r0 + j * BC, ok, BC, BK).to(tl.float32)
                       * exp2(b_ref[None, :] - _ld(s_g, i_b, i_h, r0 + j * BC, ok, BC, BK)), 0.)
        m_a = o_c[:, None] >= (j * BC + o_j)[None, :]
        m_open = (o_c >= j * BC)[:, None]  # rows not yet complete move to this block's frame
        b_r = exp2(b_ref - b_prev)[None, :]
        b_dq = tl.dot(tl.where(m_a, _ld(c_aqk, i_b, i_h, r0, j * BC, BT, BC).to(tl.float32), 0.), b_x,
                      tl.where(m_open, b_dq * b_r, b_dq))
        b_dk = tl.dot(tl.where(m_a, _ld(c_akk, i_b, i_h, r0, j * BC, BT, BC).to(tl.float32), 0.), b_x,
                      tl.where(m_open, b_dk * b_r, b_dk))
        b_prev = b_ref

    # rows t of block i, descending; columns s <= t: dkp in the frame of block i's reference
    b_dkp = tl.zeros([BT, BK], dtype=tl.float32)
    b_next = tl.full([BK], float("-inf"), dtype=tl.float32)
    for m in range(NC):
        i = NC - 1 - m
        b_ref = tl.load(g + tl.minimum(i * BC, n - 1) * (H * K) + o_k, mask=m_k, other=0.) - 0.5 * (BC - 1) * SHIFT
        o_s = i * BC + o_j
        m_s = o_s < n
        b_e = tl.where(m_s[:, None], exp2(_ld(s_g, i_b, i_h, r0 + i * BC, ok, BC, BK) - b_ref[None, :]), 0.)
        b_yq = _ld(s_q, i_b, i_h, r0 + i * BC, ok, BC, BK).to(tl.float32) * b_e
        b_yk = _ld(s_k, i_b, i_h, r0 + i * BC, ok, BC, BK).to(tl.float32) * b_e \
            * tl.load(beta + o_s * H, mask=m_s, other=0.).to(tl.float32)[:, None]
        m_a = o_c[None, :] <= o_s[:, None]  # block i's rows of dA, transposed in registers: [BT(s), BC(t)]
        m_open = (o_c < i * BC + BC)[:, None]
        b_dkp = tl.where(m_open, b_dkp * exp2(b_next - b_ref)[None, :], b_dkp)
        b_dkp = tl.dot(tl.trans(tl.where(m_a, _ld(r_aqk, i_b, i_h, r0 + i * BC, 0, BC, BT).to(tl.float32), 0.)),
                       b_yq, b_dkp)
        b_dkp = tl.dot(tl.trans(tl.where(m_a, _ld(r_akk, i_b, i_h, r0 + i * BC, 0, BC, BT).to(tl.float32), 0.)),
                       b_yk, b_dkp)
        b_next = b_ref

    # each row ends in its own block's frame: back to true scale (the blocks' references as row vectors); the rows
    # past n (zeros past T, the next sequence's in a packed chunk) to zero
    b_rr = tl.zeros([BT, BK], dtype=tl.float32)
    for j in range(NC):
        b_ref = tl.load(g + tl.minimum(j * BC, n - 1) * (H * K) + o_k, mask=m_k, other=0.)
        b_rr = tl.where((o_c // BC == j)[:, None], b_ref[None, :], b_rr)
    b_d = _ld(t_g, i_b, i_h, r0, ok, BT, BK) - b_rr + 0.5 * (BC - 1) * SHIFT
    b_up = tl.where(m_t[:, None], exp2(b_d), 0.)
    b_dq *= b_up
    b_dk *= b_up
    b_dkp = tl.where(m_t[:, None], b_dkp / b_up, 0.)

    # one output at a time, each tile dead once stored
    b_t = b_dk * _ld(t_k, i_b, i_h, r0, ok, BT, BK).to(tl.float32)
    tl.store(db + o_c * H, tl.sum(b_t, 1), mask=m_t)
    b_b = tl.load(beta + o_c * H, mask=m_t, other=0.).to(tl.float32)[:, None]
    b_dg = _ld(t_dg, i_b, i_h, r0, ok, BT, BK) + b_t * b_b
    _st(t_dk2, dk2, b_dk * b_b + _ld(t_dk, i_b, i_h, r0, ok, BT, BK), i_b, i_h, r0, ok, n, H, K, BT, BK, IS_VARLEN)
    b_dg -= _ld(t_kp, i_b, i_h, r0, ok, BT, BK).to(tl.float32) * b_dkp
    _st(t_dkp2, dkp2, b_dkp + _ld(t_dkp, i_b, i_h, r0, ok, BT, BK), i_b, i_h, r0, ok, n, H, K, BT, BK, IS_VARLEN)
    b_dg += _ld(t_q, i_b, i_h, r0, ok, BT, BK).to(tl.float32) * b_dq
    _st(t_dq2, dq2, b_dq + _ld(t_dq, i_b, i_h, r0, ok, BT, BK), i_b, i_h, r0, ok, n, H, K, BT, BK, IS_VARLEN)
    b_dg = tl.where(m_t[:, None], b_dg, 0.)  # the rows past n, out of the sum
    if REVERSE_SUM:
        b_dg = tl.cumsum(b_dg, 0, reverse=True)
    _st(t_dg2, dg2, b_dg, i_b, i_h, r0, ok, n, H, K, BT, BK, IS_VARLEN)


def _desc(x: torch.Tensor, rows: int, cols: int) -> TensorDescriptor:
    """A descriptor over ``x`` ``[B, T, H, C]`` seen as ``[B, H, T, C]``, in boxes of ``rows x cols``."""
    B, T, H, C = x.shape
    return TensorDescriptor(x, [B, H, T, C], [x.stride(0), x.stride(2), x.stride(1), 1], [1, 1, rows, cols])


def tma_supported(*tensors: torch.Tensor) -> bool:
    """Whether :func:`chunk_asym_bwd_intra_tma` takes ``tensors`` on their GPU without copies: CUDA tensors on sm_90 or
    later (where the descriptors are TMA; measured there), 16-byte aligned, unit last stride, 16-byte multiples for
    every other stride. False for no tensors."""
    if not tensors or not all(t.is_cuda for t in tensors):
        return False
    if torch.cuda.get_device_capability(tensors[0].device)[0] < 9:
        return False
    return all(map(_descriptor_ready, tensors))


def _descriptor_ready(t: torch.Tensor) -> bool:
    """Whether a descriptor can move ``t``'s tiles: a 16-byte aligned base, unit last stride, 16-byte multiples for
    every other stride."""
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 \
        and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1])


def _torch_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global scratch for in-kernel descriptors (Triton's allocator protocol)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def chunk_asym_bwd_intra_tma(
    q: torch.Tensor, k: torch.Tensor, k_precond: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    dAqk: torch.Tensor, dAkk: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dk_precond: torch.Tensor,
    db: torch.Tensor, dg: torch.Tensor, cu_seqlens: torch.LongTensor | None = None,
    chunk_indices: torch.LongTensor | None = None, chunk_size: int = 64, dg_chunk_sums: bool = True,
    block_k: int = 64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`kdn.ops.triton.intra.chunk_asym_bwd_intra` (same arguments, shapes and outputs: ``(dq, dk, dk_precond,
    db, dg)``) with its tiles moved by tensor descriptors; contiguous ``[B,T,H,K]`` inputs whose rows of ``K``
    elements are a multiple of 16 bytes.

    Examples:
        >>> dq2, dk2, dkp2, db2, dg2 = chunk_asym_bwd_intra_tma(q, k, kp, gc, beta, dAqk, dAkk, dq, dk, dkp, db, dg)
    """
    B, T, H, K = k.shape
    BT, BC = chunk_size, 16
    BK, NK, NT = launch_sizes(K, T, chunk_size, block_k, cu_seqlens, chunk_indices)
    dq2, dk2, dkp2, dg2, db2 = new_outputs(q, k, k_precond, g, beta, NK)
    tiles = (q, k, k_precond, g, dq, dk, dk_precond, dg, dq2, dk2, dkp2, dg2)
    bad = sorted({str(t.dtype).removeprefix("torch.") for t in tiles if K * t.element_size() % 16})
    if bad:
        raise ValueError(f"TMA needs rows of 16-byte multiples, and K={K} in {', '.join(bad)} is not: pad K to a "
                         f"multiple of {16 // min(t.element_size() for t in tiles)} or use chunk_asym_bwd_intra")
    loaded = {"q": q, "k": k, "k_precond": k_precond, "g": g, "dAqk": dAqk, "dAkk": dAkk, "dq": dq, "dk": dk,
              "dk_precond": dk_precond, "dg": dg}  # every tensor read through a descriptor
    bad = [name for name, t in loaded.items() if not _descriptor_ready(t)]
    if bad:
        raise ValueError(f"TMA needs 16-byte aligned tensors with a unit last stride and 16-byte multiples for the "
                         f"others, and {', '.join(bad)} are not: pass contiguous copies (.contiguous() of a fresh "
                         "tensor) or use chunk_asym_bwd_intra")
    if cu_seqlens is not None and not triton.knobs.runtime.interpret \
            and isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_torch_scratch)  # the partial chunks' in-kernel descriptors
    t_desc = [_desc(x, BT, BK) for x in tiles]
    s_desc = [_desc(x, BC, BK) for x in (q, k, k_precond, g)]
    a_desc = [_desc(dAqk, BT, BC), _desc(dAkk, BT, BC), _desc(dAqk, BC, BT), _desc(dAkk, BC, BT)]
    _intra_bwd_tma_kernel[(NK, NT, B * H)](
        *t_desc, *s_desc, *a_desc, g, beta, dq2, dk2, dkp2, dg2, db2, cu_seqlens, chunk_indices, T, B * T, H=H, K=K,
        BT=BT, BC=BC, BK=BK, SHIFT=2.0 * RCP_LN2, IS_VARLEN=cu_seqlens is not None, REVERSE_SUM=dg_chunk_sums)
    return dq2, dk2, dkp2, db2.sum(0).add_(db), dg2
