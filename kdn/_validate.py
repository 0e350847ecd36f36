"""Input validation shared by every KDN entry point.

Every check raises a ``ValueError`` that names the argument and the expected shape or range.
Range and finiteness checks are fused into one reduction so that a CUDA call syncs once.
"""
from __future__ import annotations

import torch
from torch import Tensor


def _shape_str(shape: tuple[int | str, ...]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def check_shape(name: str, x: Tensor, expected: tuple[int, ...], names: str) -> None:
    """Raise if ``x.shape != expected``; ``names`` spells the dims, e.g. ``"B,T,H,K"``."""
    if not isinstance(x, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape [{names}], got {type(x).__name__}")
    if tuple(x.shape) != tuple(expected):
        raise ValueError(
            f"{name} has shape {list(x.shape)}, expected [{names}] = {_shape_str(expected)}"
        )


def check_values(
    tensors: dict[str, Tensor | None],
    *,
    nonpositive: tuple[str, ...] = (),
    nonnegative: tuple[str, ...] = (),
    positive: tuple[str, ...] = (),
) -> None:
    """Check finiteness of every tensor and the named ranges, with a single host sync.

    ``nonpositive`` names tensors that must be <= 0 (log-retention ``g``), ``nonnegative`` those
    that must be >= 0 (process noise), ``positive`` those that must be > 0 (``r``, ``mu``, ``p0``).
    """
    present = {k: v for k, v in tensors.items() if v is not None}
    flags = []
    for name, x in present.items():
        bad = ~torch.isfinite(x).all()
        if name in nonpositive:
            bad = bad | (x > 0).any()
        if name in nonnegative:
            bad = bad | (x < 0).any()
        if name in positive:
            bad = bad | (x <= 0).any()
        flags.append(bad)
    if not flags or not bool(torch.stack(flags).any()):
        return
    for name, x in present.items():
        if not bool(torch.isfinite(x).all()):
            raise ValueError(f"{name} contains NaN or Inf values; every entry must be finite")
        if name in nonpositive and bool((x > 0).any()):
            raise ValueError(
                f"{name} (log-retention) must be <= 0, got max {x.max().item():.4g}; "
                "pass g = log(alpha) with alpha in (0, 1]"
            )
        if name in nonnegative and bool((x < 0).any()):
            raise ValueError(f"{name} must be >= 0, got min {x.min().item():.4g}")
        if name in positive and bool((x <= 0).any()):
            raise ValueError(f"{name} must be > 0, got min {x.min().item():.4g}")


def check_cu_seqlens(cu_seqlens: Tensor, total: int, batch: int) -> list[int]:
    """``cu_seqlens`` must be int, 1-D, start at 0, be non-decreasing and end at ``total`` (B = 1).

    Returns the offsets as a list (read on the host once)."""
    if batch != 1:
        raise ValueError(f"cu_seqlens requires batch size 1 (packed sequences), got B={batch}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
        raise ValueError("cu_seqlens must be a 1-D integer tensor [N+1] of sequence offsets")
    c = cu_seqlens.tolist()
    if c[0] != 0 or c[-1] != total or any(b < a for a, b in zip(c, c[1:])):
        raise ValueError(
            f"cu_seqlens must start at 0, be non-decreasing and end at T={total}, got {c}"
        )
    return c
