"""The pre-norm residual step on CUDA: ``residual' = residual + x`` (FP32) and ``RMSNorm(residual')``, one Triton
pass each way (:func:`add_rms_norm`, the CUDA path of :meth:`kdn.modules.RMSNorm.add_norm`).

Forward: a program per row. Backward: ``ROWS`` consecutive rows per program, one row at a time, the weight's
gradient summed in registers and the programs' partial sums added in torch. fla's row kernel (``rms_norm(...,
prenorm=True)``) gives each SM one program that walks 1/132 of the rows; with a few programs per SM the loads of
neighbouring programs overlap (bench/norm_throughput.py, docs/results/README.md). The stream's gradient is stored in
FP32; fla's kernel rounds it to the sublayer output's dtype (bf16) first.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

ROWS = 32  # default rows per backward program (16-64 measured alike on an H200, 128 slower: docs/results/README.md)


@triton.jit
def _add_rms_norm_fwd_kernel(x, res, w, y, res_out, rstd, D, eps, HAS_RES: tl.constexpr, BD: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    o = tl.arange(0, BD)
    m = o < D
    r = tl.load(x + i * D + o, mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        r += tl.load(res + i * D + o, mask=m, other=0.0).to(tl.float32)
    tl.store(res_out + i * D + o, r, mask=m)
    s = 1.0 / tl.sqrt(tl.sum(r * r, 0) / D + eps)
    tl.store(rstd + i, s)
    b_w = tl.load(w + o, mask=m, other=0.0).to(tl.float32)
    tl.store(y + i * D + o, (r * s * b_w).to(y.dtype.element_ty), mask=m)


@triton.jit
def _add_rms_norm_bwd_kernel(res_out, rstd, w, dy, dres_out, dx, dres, dw, T, D, HAS_DRES_OUT: tl.constexpr,
                             HAS_RES: tl.constexpr, ROWS: tl.constexpr, BD: tl.constexpr):
    i_p = tl.program_id(0).to(tl.int64)
    o = tl.arange(0, BD)
    m = o < D
    b_w = tl.load(w + o, mask=m, other=0.0).to(tl.float32)
    b_dw = tl.zeros([BD], dtype=tl.float32)
    for i in range(i_p * ROWS, min(i_p * ROWS + ROWS, T)):
        s = tl.load(rstd + i)
        xhat = tl.load(res_out + i * D + o, mask=m, other=0.0).to(tl.float32) * s
        b_dy = tl.load(dy + i * D + o, mask=m, other=0.0).to(tl.float32)
        b_dw += b_dy * xhat
        wdy = b_dy * b_w
        d = (wdy - xhat * (tl.sum(xhat * wdy, 0) / D)) * s
        if HAS_DRES_OUT:
            d += tl.load(dres_out + i * D + o, mask=m, other=0.0).to(tl.float32)
        tl.store(dx + i * D + o, d.to(dx.dtype.element_ty), mask=m)
        if HAS_RES:
            tl.store(dres + i * D + o, d.to(dres.dtype.element_ty), mask=m)
    tl.store(dw + i_p * D + o, b_dw, mask=m)


class _AddRMSNorm(torch.autograd.Function):
    """``(x, residual | None, weight) -> (normed, residual')``; saves the FP32 ``residual'`` and ``rstd [rows]``."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, x: Tensor, residual: Tensor | None, weight: Tensor, eps: float,
        rows: int,
    ) -> tuple[Tensor, Tensor]:
        shape, D = x.shape, x.shape[-1]
        x2 = x.reshape(-1, D).contiguous()
        res2 = residual.reshape(-1, D).contiguous() if residual is not None else None
        T = x2.shape[0]
        y = torch.empty_like(x2)
        res_out = torch.empty(T, D, device=x.device, dtype=torch.float32)
        rstd = torch.empty(T, device=x.device, dtype=torch.float32)
        BD = triton.next_power_of_2(D)
        if T:
            _add_rms_norm_fwd_kernel[(T,)](x2, res2, weight, y, res_out, rstd, D, eps, HAS_RES=res2 is not None,
                                           BD=BD, num_warps=min(max(BD // 256, 1), 16))
        ctx.save_for_backward(res_out, rstd, weight)
        ctx.x_dtype, ctx.has_res, ctx.rows = x.dtype, residual is not None, rows
        return y.view(shape), res_out.view(shape)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, dy: Tensor, dres_out: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        res_out, rstd, weight = ctx.saved_tensors
        shape, (T, D) = dy.shape, res_out.shape
        dy2 = dy.reshape(T, D).contiguous()
        dres_out2 = dres_out.reshape(T, D).contiguous() if dres_out is not None else None
        dx = torch.empty(T, D, device=dy.device, dtype=ctx.x_dtype)
        dres = torch.empty(T, D, device=dy.device, dtype=torch.float32) if ctx.has_res else None
        P = triton.cdiv(T, ctx.rows)
        dw = torch.zeros(max(P, 1), D, device=dy.device, dtype=torch.float32)
        BD = triton.next_power_of_2(D)
        if T:
            _add_rms_norm_bwd_kernel[(P,)](res_out, rstd, weight, dy2, dres_out2, dx, dres, dw, T, D,
                                           HAS_DRES_OUT=dres_out2 is not None, HAS_RES=dres is not None, ROWS=ctx.rows,
                                           BD=BD, num_warps=min(max(BD // 256, 1), 16))
        return (dx.view(shape), None if dres is None else dres.view(shape), dw.sum(0).to(weight.dtype), None, None)


def add_rms_norm(
    x: Tensor, residual: Tensor | None, weight: Tensor, eps: float, *, rows: int = ROWS
) -> tuple[Tensor, Tensor]:
    """``residual' = residual + x`` in FP32 (``x`` alone when ``residual`` is ``None``) and ``RMSNorm(residual')
    * weight`` in ``x``'s dtype. ``x, residual: [..., D]`` (``residual`` FP32), ``weight [D]``; ``rows``: rows per
    backward program. Returns ``(normed, residual')``; differentiable in ``x``, ``residual`` and ``weight``."""
    if not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows must be a positive int (rows per backward program), got {rows!r}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != torch.float32):
        raise ValueError(f"residual must be FP32 with x's shape {tuple(x.shape)}, got {residual.dtype} "
                         f"{tuple(residual.shape)}")
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight must have shape ({x.shape[-1]},), got {tuple(weight.shape)}")
    return _AddRMSNorm.apply(x, residual, weight, eps, rows)
