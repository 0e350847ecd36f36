"""What the CUDA kernels share: ``@triton.jit`` helpers, segment sizing, the gain inputs' shape checks and the choice
of a kernel by argument or environment variable (:func:`kernel_choice`).

The helpers: the renormalised 2x2 Möbius composition (docs/math.md §3, §4), the adjoint and affine compositions of the
gain backward (docs/math.md §6), a segment's chunks, a sequence's first row and length (packed sequences read
``cu_seqlens``), masked channel loads, and an FP32 softplus with its derivative.

Segments (sequence parallelism of the gain scans): :func:`gain_segments` splits each (sequence, head) into segments
whose maps are composed in parallel, then walked in order; ``segment_size`` overrides the rule (tests use it to force
several segments on short sequences).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from kdn.ops.validate import check_cu_seqlens


def kernel_choice(kernel: str | None, env: str, choices: tuple[str, ...], what: str) -> str:
    """``kernel`` when given (it wins over the environment), else the environment variable ``env``, else
    ``"auto"``; a value outside ``choices`` is refused in one line that names where it came from (``what`` names the
    kernel in the message)."""
    if kernel is not None:
        if kernel not in choices:
            raise ValueError(f"{what} {kernel!r} is not one of {choices}: pass kernel= one of them")
        return kernel
    kernel = os.environ.get(env) or "auto"
    if kernel not in choices:
        raise ValueError(f"{what} {kernel!r} is not one of {choices}: set {env} to one of them")
    return kernel


@triton.jit
def _mobius_combine(a11, a12, a21, a22, b11, b12, b21, b22):
    # a: the earlier prefix, b: the later element; returns b @ a rescaled by its max-abs entry
    c11 = b11 * a11 + b12 * a21
    c12 = b11 * a12 + b12 * a22
    c21 = b21 * a11 + b22 * a21
    c22 = b21 * a12 + b22 * a22
    s = tl.maximum(tl.maximum(tl.abs(c11), tl.abs(c12)), tl.maximum(tl.abs(c21), tl.abs(c22)))
    s = tl.maximum(s, 1e-30)
    return c11 / s, c12 / s, c21 / s, c22 / s


@triton.jit
def _adjoint_combine(aP, aQ, aR, aS, bP, bQ, bR, bS):
    # maps x -> (P x + Q, R x + S) that read lambda_t and give (lambda_{t-1}, lambda_t); a is applied
    # first (the later token), b next; returns b o a
    return bP * aP, bP * aQ + bQ, bR * aP, bR * aQ + bS


@triton.jit
def _affine_combine(aP, aQ, bP, bQ):
    # maps x -> P x + Q in time order (a: the earlier token, b: the later one); the adjoint runs backward in
    # time, so b is applied first: returns a o b
    return aP * bP, aP * bQ + aQ


@triton.jit
def _seg_chunks(s, SEGC, T, BT: tl.constexpr):
    # the chunks [c0, c1) of segment s of a sequence of T tokens (empty past its end)
    c0 = s * SEGC
    return c0, tl.minimum(c0 + SEGC, tl.cdiv(T, BT))


@triton.jit
def _sequence(cu_ptr, b, T, IS_VARLEN: tl.constexpr):
    # sequence b: the row of its first token and its length; packed sequences read cu_seqlens, batch rows have
    # T tokens each
    if IS_VARLEN:
        bos = tl.load(cu_ptr + b).to(tl.int64)
        Tn = tl.load(cu_ptr + b + 1).to(tl.int64) - bos
    else:
        bos = b * T
        Tn = T
    return bos, Tn


@triton.jit
def _last_segment(T, SEGC, BT: tl.constexpr):
    # the segment holding the last token of a sequence of T tokens (0 for an empty sequence)
    return tl.maximum(tl.cdiv(tl.cdiv(T, BT), SEGC), 1) - 1


@triton.jit
def _chan(offs_k, K: tl.constexpr, ok):
    # the channel mask of a row read only when ok (a comparison: the interpreter rejects a vector & a scalar mask)
    return offs_k < tl.where(ok, K, 0)


@triton.jit
def _softplus(x):
    # log(1 + exp(x)) in FP32: no overflow, and a series for log1p where exp(-|x|) is small
    e = tl.exp(-tl.abs(x))
    return tl.maximum(x, 0.0) + tl.where(e < 1e-2, e * (1.0 - e * (0.5 - e * (1.0 / 3.0 - 0.25 * e))),
                                         tl.log(1.0 + e))


@triton.jit
def _softplus_grad(w):
    # d softplus(x) / dx = sigmoid(x) = 1 - exp(-w) from w = softplus(x); a series where w is small
    return tl.where(w < 1e-2, w * (1.0 - w * (0.5 - w * (1.0 / 6.0 - w / 24.0))), 1.0 - tl.exp(-w))


_ISO_BT = 32
# Sequence parallelism (Isotropic): about this many programs per gain launch, segments of at least
# _MIN_SEG_CHUNKS chunks (each program first applies every earlier segment's map).
_TARGET_PROGRAMS = 512
_MIN_SEG_CHUNKS = 8
# Diagonal: one warp per (sequence*head, segment), about this many of them (32 a 132-SM H200 can hold at once
# each), segments of at least _DIAG_MIN_SEG tokens (the carry launches walk the segments one by one).
_DIAG_PROGRAMS = 4096
_DIAG_MIN_SEG = 64
_DIAG_WARPS = 1


def _segments(BH: int, T: int, BT: int, programs: int = _TARGET_PROGRAMS,
              min_chunks: int = _MIN_SEG_CHUNKS, segment_size: int | None = None) -> tuple[int, int]:
    """``(SEGC, NS)``: chunks of ``BT`` tokens per segment and the number of segments, for ``B*H = BH``:
    about ``programs`` programs, at least ``min_chunks`` chunks a segment; or ``segment_size`` tokens a segment
    (a positive multiple of ``BT``)."""
    NT = triton.cdiv(T, BT)
    if segment_size is None:
        segc = max(min_chunks, triton.cdiv(NT, triton.cdiv(programs, BH)))
    elif isinstance(segment_size, int) and segment_size > 0 and segment_size % BT == 0:
        segc = segment_size // BT
    else:
        raise ValueError(f"segment_size must be a positive multiple of the chunk size {BT}, got {segment_size!r}")
    return segc, triton.cdiv(NT, segc)


def gain_segments(isotropic: bool, BH: int, T: int, segment_size: int | None = None) -> tuple[int, int]:
    """``(tokens per segment, segments)`` of the gain kernels for ``BH`` sequence-heads of ``T`` tokens.

    ``segment_size``: tokens per segment instead of the rule (a multiple of 32 for the Isotropic gain)."""
    if isotropic:
        segc, ns = _segments(BH, T, _ISO_BT, segment_size=segment_size)
        return segc * _ISO_BT, ns
    return _segments(BH, T, 1, _DIAG_PROGRAMS, _DIAG_MIN_SEG, segment_size)


def _sequences(k: Tensor, cu_seqlens: Tensor | None) -> tuple[int, int]:
    """``(N, L)``: the number of sequences and the longest one's length. Without ``cu_seqlens`` the batch rows
    (``N = B``, ``L = T``); with it, the packed sequences of ``k [1,T,...]`` at offsets ``cu_seqlens [N+1]``
    (int32/int64 on ``k``'s device; read on the host: one sync)."""
    B, T = k.shape[:2]
    if cu_seqlens is None:
        return B, T
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 \
            or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError("cu_seqlens must be a 1-D int32/int64 tensor [N+1] of sequence offsets, got "
                         f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens).__name__)} of shape "
                         f"{tuple(getattr(cu_seqlens, 'shape', ()))}")
    if cu_seqlens.device != k.device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but k on {k.device}; move it to k's device")
    c = check_cu_seqlens(cu_seqlens, T, B)
    return len(c) - 1, max(b - a for a, b in zip(c, c[1:]))


def _check_gain_shapes(
    k: Tensor, g: Tensor, omega: Tensor, r: Tensor, mu: Tensor, u0: Tensor, isotropic: bool,
    cu_seqlens: Tensor | None,
) -> tuple[int, int]:
    """Check the gain inputs' shapes (the initial uncertainty is per sequence); returns :func:`_sequences`."""
    if k.dim() != 4:
        raise ValueError(f"k must be [B,T,H,K], got shape {tuple(k.shape)}")
    B, T, H, K = k.shape
    want = {"g": (g, (B, T, H, K)), "omega": (omega, (B, T, H) if isotropic else (B, T, H, K)), "r": (r, (B, T, H)),
            "mu": (mu, (H,))}
    for name, (x, shape) in want.items():
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} for k of shape {tuple(k.shape)}, got {tuple(x.shape)}")
    N, L = _sequences(k, cu_seqlens)
    shape = (N, H) if isotropic else (N, H, K)
    if tuple(u0.shape) != shape:
        raise ValueError(f"the initial uncertainty must have shape {shape} ({N} sequences), got {tuple(u0.shape)}")
    return N, L


def _mem_dtype(x: Tensor) -> torch.dtype:
    """The memory kernels' operand dtype for ``x``: bf16 for half-precision inputs, else FP32."""
    return torch.bfloat16 if x.dtype in (torch.bfloat16, torch.float16) else torch.float32
