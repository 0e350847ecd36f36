"""KDA's gate for the KDN kernels in one pass (docs/math.md §5): ``g``, its chunk sums, the steepest channel.

``g = -exp(A_log) softplus(f + dt_bias)`` feeds three consumers. The gain kernels read ``g`` itself; fla's asymmetric
memory reads its cumulative sums within chunks of 64 tokens, in log2 units; and the check of fla's tensor-core
path (:func:`kdn.ops.triton.safe_gate.safe_gate`) reads each token's steepest channel. fla computes these in three
passes over ``[B,T,H,K]`` FP32 tensors (its gate, ``chunk_local_cumsum`` and our check's row minimum); here one
program (one warp) walks a chunk of one head token by token, the running sum in registers, and writes all three
(:func:`kda_gate_fwd`). The backward of the gate is folded into the gains' last backward launches (``GATE`` in
:func:`kdn.ops.triton.gain_diagonal._diag_gain_bwd` and :func:`kdn.ops.triton.gain_isotropic._iso_gain_bwd`). Given
``g`` itself, the same pass makes the sums and the steepest channel (:func:`chunk_sums_steepest`).

Packed sequences: with ``cu_seqlens [N+1]`` (``B = 1``) the programs walk fla's chunk indices
(``prepare_chunk_indices``), so that no chunk straddles two sequences.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kdn.ops.triton.utils import _chan, _softplus
from kdn.ops.validate import ASYM_CHUNK

LOG2_E = 1.4426950408889634


@triton.jit
def _kda_gate_fwd_kernel(
    f_ptr, A_ptr, bias_ptr, g_ptr, gc_ptr, steep_ptr, cu_ptr, idx_ptr, T, scale,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr,
    GATE: tl.constexpr,
):
    # one chunk of BT tokens of one (sequence, head), token by token (the next row loaded ahead): g (FP32), its running
    # sum in the chunk times `scale`, and -min_K g per token (NaN where a row holds a NaN); without GATE, f is g
    # itself and only the sums and the steepest channel are written
    i_t = tl.program_id(0).to(tl.int64)
    i_bh = tl.program_id(1).to(tl.int64)
    h = i_bh % H
    if IS_VARLEN:
        n = tl.load(idx_ptr + 2 * i_t).to(tl.int64)
        i_t = tl.load(idx_ptr + 2 * i_t + 1).to(tl.int64)
        bos = tl.load(cu_ptr + n).to(tl.int64)
        Tn = tl.load(cu_ptr + n + 1).to(tl.int64) - bos
    else:
        bos = (i_bh // H) * T
        Tn = T
    cols = tl.arange(0, BK)
    mk = cols < K
    if GATE:
        gA = tl.exp(tl.load(A_ptr + h).to(tl.float32))
        bias = tl.load(bias_ptr + h * K + cols, mask=mk, other=0.0).to(tl.float32)
    t0 = i_t * BT
    t1 = tl.minimum(t0 + BT, Tn)
    acc = tl.zeros([BK], tl.float32)
    row = ((bos + t0) * H + h) * K
    x = tl.load(f_ptr + row + cols, mask=_chan(cols, K, t0 < t1), other=0.0)
    for t in range(t0, t1):
        xn = tl.load(f_ptr + row + H * K + cols, mask=_chan(cols, K, t + 1 < t1), other=0.0)
        if GATE:
            g = tl.where(mk, -gA * _softplus(x.to(tl.float32) + bias), 0.0)
            tl.store(g_ptr + row + cols, g, mask=mk)
        else:
            g = x.to(tl.float32)
        acc += g
        tl.store(gc_ptr + row + cols, acc * scale, mask=mk)
        steep = -tl.min(tl.where(mk, g, float("inf")), axis=0)
        nan = tl.max((g != g).to(tl.int32), axis=0) > 0
        tl.store(steep_ptr + (bos + t) * H + h, tl.where(nan, float("nan"), steep))
        row += H * K
        x = xn


def kda_gate_fwd(
    f: Tensor, A_log: Tensor, dt_bias: Tensor, cu_seqlens: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """KDA's gate on CUDA (or under Triton's interpreter): ``(g, gc, steep)``, all FP32.

    ``f: [B,T,H,K]`` (any float dtype), ``A_log: [H]``, ``dt_bias: [H*K]``; ``cu_seqlens [N+1]``: packed sequences
    (``B = 1``). ``g = -exp(A_log) softplus(f + dt_bias)`` ``[B,T,H,K]``; ``gc`` its inclusive cumulative sums within
    each sequence's chunks of :data:`kdn.ops.validate.ASYM_CHUNK` tokens, in log2 units (what fla's
    ``chunk_local_cumsum(g, scale=1/ln 2)`` gives); ``steep = -min_K g`` ``[B,T,H]``. No gradient: the gain's
    backward takes the gate's (:class:`kdn.ops.chunk._DiagonalKDN`)."""
    B, T, H, K = f.shape
    if tuple(A_log.shape) != (H,) or tuple(dt_bias.shape) != (H * K,):
        raise ValueError(f"A_log must be [{H}] and dt_bias [{H * K}] for f of shape {tuple(f.shape)}, got "
                         f"{tuple(A_log.shape)} and {tuple(dt_bias.shape)}")
    g = torch.empty(f.shape, dtype=torch.float32, device=f.device)
    gc, steep = _launch(f, (A_log.detach().float().contiguous(), dt_bias.detach().float().contiguous()), g, cu_seqlens)
    return g, gc, steep


def chunk_sums_steepest(g: Tensor, cu_seqlens: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``g``'s chunk sums and steepest channel in one pass (fla's ``chunk_local_cumsum`` and
    :func:`kdn.ops.triton.safe_gate.safe_gate`'s row minimum were two): ``(gc, steep)`` as :func:`kda_gate_fwd`'s,
    for a log-retention ``g [B,T,H,K]`` given as it is (any float dtype; no gradient)."""
    return _launch(g, None, None, cu_seqlens)


def _launch(
    f: Tensor, gate: tuple[Tensor, Tensor] | None, g: Tensor | None, cu_seqlens: Tensor | None
) -> tuple[Tensor, Tensor]:
    """One pass over ``f [B,T,H,K]``: ``(gc, steep)``, and ``g`` written with ``gate = (A_log, dt_bias)`` (FP32)."""
    B, T, H, K = f.shape
    f = f.detach().contiguous()
    gc = torch.empty(f.shape, dtype=torch.float32, device=f.device)
    steep = torch.empty(f.shape[:3], dtype=torch.float32, device=f.device)
    C = ASYM_CHUNK
    if cu_seqlens is None:
        idx, grid = None, (triton.cdiv(T, C), B * H)
    else:
        from kdn.ops.fla_internals import prepare_chunk_indices

        idx = prepare_chunk_indices(cu_seqlens, C)
        grid = (len(idx), H)
    A_log, dt_bias = gate if gate is not None else (gc, gc)  # not read without GATE
    _kda_gate_fwd_kernel[grid](f, A_log, dt_bias, gc if g is None else g, gc, steep, cu_seqlens, idx, T, LOG2_E,
                               H=H, K=K, BT=C, BK=triton.next_power_of_2(K), IS_VARLEN=cu_seqlens is not None,
                               GATE=gate is not None, num_warps=1)
    return gc, steep
