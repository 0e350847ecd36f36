"""SwiGLU on the joint output of the FFN's stacked gate and up projections, one Triton pass each way.

``y [..., 2I]`` holds the gate in ``y[..., :I]`` and the up projection in ``y[..., I:]`` (one GEMM computes both);
:func:`swiglu_joint` returns ``silu(gate) * up [..., I]``. Its backward writes the gradient of ``y`` as one
``[..., 2I]`` tensor, so the joint GEMM's input gradient is one GEMM with no split to undo (two projections would
need two GEMMs and an add; views of one output would need a ``cat`` of their gradients).

The grid is 2-D (row blocks x column blocks), so no element's row and column come from an integer division: fla's
``swiglu`` kernels index a flat range with ``offs // D`` and ``offs % D`` in int64, which held them to about 60% of
HBM bandwidth at the 750M model's width (docs/performance.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BM, BN = 8, 512  # rows x columns per program


@triton.jit
def _swiglu_joint_fwd_kernel(y, z, M, I, BM: tl.constexpr, BN: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    m = (rows < M)[:, None] & (cols < I)[None, :]
    p = y + rows[:, None] * (2 * I) + cols[None, :]
    gate = tl.load(p, mask=m, other=0.0).to(tl.float32)
    up = tl.load(p + I, mask=m, other=0.0).to(tl.float32)
    tl.store(z + rows[:, None] * I + cols[None, :], (gate * tl.sigmoid(gate) * up).to(z.dtype.element_ty), mask=m)


@triton.jit
def _swiglu_joint_bwd_kernel(y, dz, dy, M, I, BM: tl.constexpr, BN: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    m = (rows < M)[:, None] & (cols < I)[None, :]
    p = rows[:, None] * (2 * I) + cols[None, :]
    gate = tl.load(y + p, mask=m, other=0.0).to(tl.float32)
    up = tl.load(y + p + I, mask=m, other=0.0).to(tl.float32)
    b_dz = tl.load(dz + rows[:, None] * I + cols[None, :], mask=m, other=0.0).to(tl.float32)
    s = tl.sigmoid(gate)
    tl.store(dy + p, (b_dz * up * s * (1.0 + gate * (1.0 - s))).to(dy.dtype.element_ty), mask=m)
    tl.store(dy + p + I, (b_dz * gate * s).to(dy.dtype.element_ty), mask=m)


class _SwiGLUJoint(torch.autograd.Function):
    """``y [M, 2I] -> silu(y[:, :I]) * y[:, I:]  [M, I]``; saves ``y``."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, y: Tensor) -> Tensor:
        M, I = y.shape[0], y.shape[1] // 2
        z = y.new_empty(M, I)
        if M:
            _swiglu_joint_fwd_kernel[(triton.cdiv(M, BM), triton.cdiv(I, BN))](y, z, M, I, BM=BM, BN=BN, num_warps=4)
        ctx.save_for_backward(y)
        return z

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, dz: Tensor) -> Tensor:
        (y,) = ctx.saved_tensors
        M, I = y.shape[0], y.shape[1] // 2
        dy = torch.empty_like(y)
        if M:
            _swiglu_joint_bwd_kernel[(triton.cdiv(M, BM), triton.cdiv(I, BN))](y, dz.contiguous(), dy, M, I, BM=BM,
                                                                               BN=BN, num_warps=4)
        return dy


def swiglu_joint(y: Tensor) -> Tensor:
    """``silu(y[..., :I]) * y[..., I:]`` for ``y [..., 2I]`` (CUDA, or the CPU under Triton's interpreter), in
    ``y``'s dtype, computed in FP32. Returns ``[..., I]``; differentiable in ``y``."""
    if y.shape[-1] % 2:
        raise ValueError(f"swiglu_joint needs an even last dimension (gate and up stacked), got {tuple(y.shape)}")
    shape = y.shape
    return _SwiGLUJoint.apply(y.reshape(-1, shape[-1]).contiguous()).view(*shape[:-1], shape[-1] // 2)
