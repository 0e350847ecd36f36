"""Whether fla's tensor-core diagonal blocks are exact for the gates at hand (``safe_gate``), checked on every call
(but inside a CUDA graph capture or :func:`exact_only`, which take the exact path).

fla's chunk-64 kernels (``chunk_kda``, the asymmetric ones) have two paths for the 16 x 16 diagonal blocks of each
chunk: a token-by-token loop with exact pairwise decays, and tensor-core matmuls (``safe_gate``) that split each decay
``exp(G_i - G_j)`` into ``exp(G_i - C) exp(C - G_j)``, exact while those factors stay inside FP32's range.
:func:`safe_gate` checks that envelope on the actual gates, so the faster path is taken exactly when it is exact.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import triton
import triton.language as tl
from torch import Tensor

# fla's envelope for its tensor-core diagonal blocks (``safe_gate`` with the default shift, 2 nats per token): a
# 16-token sub-chunk whose gates fall by at most 75 nats keeps both factors within exp(+-60) (fla.ops.kda.chunk_intra)
SAFE_GATE_SPREAD = 75.0
SAFE_GATE_STEPS = 15
# The counters of the count_safe_gate_reads() scopes around the caller, innermost last (none outside any scope)
_READS: ContextVar[tuple[Counter[bool], ...]] = ContextVar("safe_gate_reads", default=())


@contextmanager
def count_safe_gate_reads() -> Iterator[Counter[bool]]:
    """Within this context each read of a check (:class:`SafeGate`) is counted in the counter it yields:
    ``reads[True]`` took fla's tensor-core path, ``reads[False]`` the exact token loop. A nested scope's reads count
    in the outer ones too; a read outside every scope is not counted (``train.py``'s profiler counts its steps)."""
    reads: Counter[bool] = Counter()
    token = _READS.set((*_READS.get(), reads))
    try:
        yield reads
    finally:
        _READS.reset(token)


class SafeGate:
    """:func:`safe_gate`'s answer: computed on ``g``'s device when made, fetched when read (``bool``). On CUDA its
    copy to the host is queued behind whatever is launched in between, so reading it does not drain the GPU's queue
    (a plain ``.item()`` before the memory kernel left the GPU idle for 3% of a 750M KDA step)."""

    def __init__(self, ok: Tensor) -> None:
        self._event = None
        if ok.is_cuda:
            self._ok = torch.empty((), dtype=torch.bool, pin_memory=True)
            self._ok.copy_(ok, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._ok = ok

    def __bool__(self) -> bool:
        if self._event is not None:
            self._event.synchronize()
        ok = bool(self._ok)
        for reads in _READS.get():
            reads[ok] += 1
        return ok


EXACT_ONLY = SafeGate(torch.zeros((), dtype=torch.bool))
"""The answer inside a CUDA graph capture and under :func:`exact_only`: the exact token loop, right for every gate (a
graph cannot read a device value at replay)."""
_EXACT_ONLY: ContextVar[bool] = ContextVar("exact_only", default=False)


@contextmanager
def exact_only() -> Iterator[None]:
    """Within this context every check answers :data:`EXACT_ONLY`, without looking at the gates: steps that will
    be captured in a CUDA graph run the kernels the graph records (so those are compiled and tuned before the
    capture), and eager and replayed steps compute alike."""
    token = _EXACT_ONLY.set(True)
    try:
        yield
    finally:
        _EXACT_ONLY.reset(token)


def _capturing(x: Tensor) -> bool:
    """Whether the check must not read ``x``: under :func:`exact_only`, or while its CUDA stream is captured."""
    return _EXACT_ONLY.get() or (x.is_cuda and torch.cuda.is_current_stream_capturing())


@triton.jit
def _steepest_kernel(g_ptr, out_ptr, R, K: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr):
    """``out[r] = -min_k g[r, k]`` for ``BR`` rows of ``g [R, K]`` per program; NaN where a row holds a NaN."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BK)
    m = (rows[:, None] < R) & (cols[None, :] < K)
    x = tl.load(g_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], mask=m, other=0.0).to(tl.float32)
    steep = -tl.min(tl.where(m, x, float("inf")), axis=1)
    nan = tl.max((x != x).to(tl.int32), axis=1) > 0
    tl.store(out_ptr + rows, tl.where(nan, float("nan"), steep), mask=rows < R)


def _steepest_triton(g: Tensor) -> Tensor:
    """``-g.amin(-1)`` in FP32 for ``g [..., K]`` in one pass (torch's ``amin`` over a 128-wide last axis ran at a
    third of the HBM rate on an H200)."""
    g = g.contiguous()
    K = g.shape[-1]
    out = torch.empty(g.shape[:-1], dtype=torch.float32, device=g.device)
    R = out.numel()
    BK = triton.next_power_of_2(K)
    BR = max(1, 4096 // BK)
    _steepest_kernel[(triton.cdiv(R, BR),)](g, out, R, K=K, BR=BR, BK=BK, num_warps=4)
    return out


def safe_gate(g: Tensor) -> SafeGate:
    """Whether fla's ``safe_gate`` path is exact for the log-retention ``g`` (``[B,T,H,K]`` per channel or
    ``[B,T,H]`` per head, ``<= 0``): no key channel falls by more than :data:`SAFE_GATE_SPREAD` nats over any
    :data:`SAFE_GATE_STEPS` consecutive tokens. Read the answer with ``bool()``, as late as possible.

    Conservative: it sums each token's steepest channel, and packed sequences' windows may straddle a boundary.
    Non-finite gates give ``False`` (the exact token loop).
    """
    if _capturing(g):
        return EXACT_ONLY
    g = g.detach()
    if g.dim() == 3:
        return safe_steepest(g.float().neg())  # [B, T, H]
    return safe_steepest(_steepest_triton(g) if g.is_cuda and g.numel() else g.amin(-1).float().neg())


def safe_steepest(steep: Tensor) -> SafeGate:
    """:func:`safe_gate` from each token's steepest channel ``steep = -min_K g`` ``[B, T, H]``."""
    if _capturing(steep):
        return EXACT_ONLY
    if steep.shape[1] == 0:
        return SafeGate(torch.ones((), dtype=torch.bool, device=steep.device))
    w = min(SAFE_GATE_STEPS, steep.shape[1])
    return SafeGate(steep.unfold(1, w, 1).sum(-1).amax() <= SAFE_GATE_SPREAD)
