"""The LM head and its chunked linear cross-entropy.

``LMHead`` is an ``nn.Linear(d, V)``; called with ``target`` it returns the mean next-token cross-entropy without
holding the ``[N, V]`` logits: the forward computes them chunk by chunk, turns each chunk into its gradients and
drops it. Called through the module (not by reading ``weight``), so FSDP2's hooks see the head run.

The matmuls run in the activations' dtype (bf16 under autocast), and the weight gradient accumulates over the
chunks in FP32. fla's fused linear cross-entropy gets the same FP32 sums by upcasting both operands, which puts its
weight-gradient GEMMs on TF32, about 3x slower than bf16 at 750M on an H200 (docs/performance.md, "LM head"). On CUDA
the per-chunk softmax and its gradient are fla's Triton cross-entropy kernels; elsewhere the same maths in PyTorch.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch import Tensor

from kdn.modules import fla_fused

IGNORE = -100


def _chunk_ce(logits: Tensor, target: Tensor, scale: Tensor, fused: bool) -> Tensor:
    """Summed cross-entropy of one chunk, ``logits [C, V]``, ``target [C]`` (``IGNORE`` skipped); overwrites
    ``logits`` with ``scale * dloss/dlogits`` (in its dtype). Computed in at least FP32; ``fused``: fla's kernels
    on CUDA."""
    if fla_fused(logits, fused):
        from kdn.ops.fla_internals import cross_entropy_bwd, cross_entropy_fwd

        loss, _, lse, _, _ = cross_entropy_fwd(logits, target, ignore_index=IGNORE)
        cross_entropy_bwd(logits, target, lse, scale.expand(target.shape[0]), ignore_index=IGNORE,
                          inplace_backward=True)
        return loss.sum()
    lf = logits.to(torch.promote_types(logits.dtype, torch.float32))
    valid = target != IGNORE
    safe = target.clamp_min(0)[:, None]
    lse = torch.logsumexp(lf, -1)
    loss = ((lse - lf.gather(1, safe)[:, 0]) * valid).sum()
    grad = torch.softmax(lf, -1)
    grad.scatter_add_(1, safe, -torch.ones_like(safe, dtype=grad.dtype))
    logits.copy_(grad * (scale * valid)[:, None])
    return loss


class _LinearCrossEntropy(torch.autograd.Function):
    """``mean_n CE(x_n W^T, target_n)`` over the non-ignored ``n``; ``x [N, d]``, ``target [N]``, ``W [V, d]``."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, target: Tensor, weight: Tensor,
                num_chunks: int, fused: bool) -> Tensor:
        N = x.shape[0]
        with torch.autocast(x.device.type, enabled=False):
            w = weight.to(x.dtype)
            acc = torch.promote_types(x.dtype, torch.float32)
            total = (target != IGNORE).sum().clamp_min(1)
            scale = total.to(acc).reciprocal()
            dx = torch.empty_like(x)
            dw = torch.zeros(weight.shape, dtype=acc, device=x.device)
            loss = torch.zeros((), dtype=acc, device=x.device)
            size = -(-N // max(1, min(num_chunks, N)))
            for start in range(0, N, size):
                cx = x[start:start + size]
                logits = cx @ w.t()  # [C, V], overwritten with its gradient
                loss += _chunk_ce(logits, target[start:start + size], scale, fused)
                dx[start:start + size] = logits @ w
                if acc != x.dtype and x.is_cuda:  # bf16 operands, FP32 sums and output
                    dw = torch.addmm(dw, logits.t(), cx, out_dtype=acc)
                else:
                    dw.addmm_(logits.t().to(acc), cx.to(acc))
        ctx.save_for_backward(dx, dw)
        ctx.weight_dtype = weight.dtype
        return loss * scale

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, dloss: Tensor) -> tuple[Tensor | None, ...]:
        dx, dw = ctx.saved_tensors
        return (dx * dloss).to(dx.dtype), None, (dw * dloss).to(ctx.weight_dtype), None, None


@torch.compiler.disable  # a Python loop over chunks around Triton kernels: run eagerly inside compiled models
def linear_cross_entropy(x: Tensor, target: Tensor, weight: Tensor, num_chunks: int = 8, fused: bool = True) -> Tensor:
    """Mean cross-entropy of ``x @ weight.T`` against ``target``, never holding all the logits.

    ``x [..., d]``, ``target [...]`` (class ids, ``-100`` ignored), ``weight [V, d]``; ``num_chunks`` chunks of
    tokens; ``fused``: fla's cross-entropy kernels on CUDA. Returns an FP32 (FP64 for FP64 inputs) scalar, 0 when
    every target is ignored."""
    if x.shape[:-1] != target.shape or x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"linear_cross_entropy needs x [..., d], target [...] and weight [V, d]; got x "
                         f"{list(x.shape)}, target {list(target.shape)}, weight {list(weight.shape)}")
    return _LinearCrossEntropy.apply(x.reshape(-1, x.shape[-1]), target.reshape(-1), weight, num_chunks, fused)


class LMHead(nn.Linear):
    """``nn.Linear(hidden_size, vocab_size, bias=False)``: ``head(h)`` gives logits ``[..., V]`` in ``h``'s dtype;
    ``head(h, target)`` gives :func:`linear_cross_entropy` without the logits (``fused``: fla's kernels on CUDA)."""

    def __init__(self, hidden_size: int, vocab_size: int, *, fused: bool = True) -> None:
        super().__init__(hidden_size, vocab_size, bias=False)
        self.fused = fused

    def forward(self, x: Tensor, target: Tensor | None = None) -> Tensor:  # type: ignore[override]
        if target is None:
            return super().forward(x)
        return linear_cross_entropy(x, target, self.weight, fused=self.fused)
