"""KDA's per-channel retention gate (docs/math.md §5), the functional form that the ops and the modules call."""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from kdn.ops.utils import fla_fused, upcast


def kda_gate(f: Tensor, A_log: Tensor, dt_bias: Tensor, *, fused: bool = True) -> Tensor:
    """KDA's log-retention ``g = -exp(A_log) softplus(f + dt_bias)`` in FP32 (float64 stays float64).

    Args:
        f: ``[B, T, H, K]``; ``A_log``: ``[H]``; ``dt_bias``: ``[H*K]``.
        fused: on CUDA, fla's fused gate kernel (else PyTorch).

    Returns:
        ``g [B, T, H, K]``, ``<= 0``; differentiable in all three inputs.
    """
    H, K = f.shape[-2:]
    if fla_fused(f, fused):
        from kdn.ops.fla_internals import fused_kda_gate

        return fused_kda_gate(f, A_log, dt_bias)
    return -upcast(A_log).exp()[:, None] * F.softplus(upcast(f) + upcast(dt_bias).view(H, K))
