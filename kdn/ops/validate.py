"""Input validation shared by every KDN entry point, and the memory's settings (:func:`check_memory`,
:func:`check_precision`).

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


# fla's asymmetric (KDA-style) memory kernels run chunks of ASYM_CHUNK tokens; KDA's gate pass sums over them
MEMORIES = ("asym", "dplr")
DPLR_CHUNKS = (16, 32)
ASYM_CHUNK = 64


def check_memory(memory: str, chunk_size: int | None) -> int:
    """The Diagonal memory route on CUDA and its chunk size; returns the chunk size.

    ``memory="asym"``: fla's asymmetric chunk-64 kernels (``chunk_size`` None or 64). ``"dplr"``: fla's DPLR
    kernels at ``chunk_size`` 16 (the default) or 32: at 64 they assume a lower bound on the gate and under strong
    forgetting miss the log-retention gradient tolerance (2.3% against 2% at T = 1000, docs/performance.md)."""
    if memory not in MEMORIES:
        raise ValueError(f"memory must be one of {MEMORIES}, got {memory!r}")
    if memory == "asym":
        if chunk_size not in (None, ASYM_CHUNK):
            raise ValueError(f"memory='asym' runs chunks of {ASYM_CHUNK} tokens; pass chunk_size=None or "
                             f"{ASYM_CHUNK}, got {chunk_size!r}")
        return ASYM_CHUNK
    if chunk_size is None:
        return DPLR_CHUNKS[0]
    if chunk_size not in DPLR_CHUNKS or isinstance(chunk_size, bool):
        raise ValueError(f"memory='dplr' takes chunk_size 16 or 32, got {chunk_size!r}: fla's DPLR kernels at chunk "
                         "64 assume a gate lower bound and lose gradient accuracy under strong forgetting")
    return chunk_size


PRECISIONS = ("bf16", "fp32")


def check_precision(precision: str, memory: str = "asym") -> str:
    """The CUDA memory's precision (docs/kernels.md, "Precision"); returns it.

    ``"bf16"``: the memory's operands (``q, k, v`` and the gain) in the inputs' dtype, bf16 from the layers, with the
    tensor cores' default precision (TF32 for FP32 operands). ``"fp32"``: FP32 operands and gain, TF32x3 dots (the
    asymmetric memory only). The PyTorch backend computes in FP32 (float64) either way."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "fp32" and memory != "asym":
        raise ValueError(f"precision='fp32' runs the asymmetric memory; pass memory='asym', got memory={memory!r}")
    return precision
