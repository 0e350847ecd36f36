"""Chunkwise memory scan in PyTorch for the asymmetric delta rule (docs/math.md §6).

``S_t = (I - kappa_t k_t^T) D_t S_{t-1} + kappa_t v_t^T``, ``o_t = S_t^T q_t``. Inside each chunk the
innovations solve a unit lower-triangular system (the UT transform); across chunks the state is
carried. Decay ratios ``Gamma_t / Gamma_s`` come from cumulative log-retention ``gc``: as
``exp(gc_t) exp(-gc_s)`` (two matmuls) while a chunk's span keeps both factors representable, otherwise
as ``exp(gc_t - gc_s)`` masked before exponentiation, so strong forgetting neither overflows nor loses accuracy.

:func:`torch_diagonal_kdn` and :func:`torch_isotropic_kdn` are the whole chunked PyTorch path of the two KDNs: the
gain scans of :mod:`kdn.ops.torch_gain`, then :func:`memory_chunk`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kdn.ops import torch_gain as _gain
from kdn.ops.utils import State

MEMORY_CHUNK = 32
# Largest in-chunk log-decay span for which exp(gc_t) and exp(-gc_s) are both representable with ample
# margin; beyond it the pairwise ratios exp(gc_t - gc_s) are formed directly (exact, but C times the memory).
SAFE_SPAN = {torch.float32: 60.0, torch.float64: 600.0}


def memory_chunk(
    q: Tensor, k: Tensor, kappa: Tensor, v: Tensor, g: Tensor, S0: Tensor, chunk: int = MEMORY_CHUNK
) -> tuple[Tensor, Tensor]:
    """Run the asymmetric delta rule chunk by chunk.

    ``q, k, kappa, g: [B,T,H,K]``, ``v: [B,T,H,V]``, ``S0: [B,H,K,V]``, all in one float dtype.
    Returns ``o [B,T,H,V]`` and the final state ``[B,H,K,V]``.
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    pad = (-T) % chunk
    # padded steps are identities: zero key, gain, query and value, no decay
    q, k, kappa, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, kappa, v, g))
    N = (T + pad) // chunk

    def split(x: Tensor) -> Tensor:  # [B, T, H, D] -> [B, H, N, C, D]
        return x.reshape(B, N, chunk, H, x.shape[-1]).permute(0, 3, 1, 2, 4)

    q, k, kappa, v, g = map(split, (q, k, kappa, v, g))
    gc = g.cumsum(3)
    if -gc[..., -1, :].min() < SAFE_SPAN.get(gc.dtype, 0.0):
        # every in-chunk decay ratio is a product of two representable factors: two matmuls
        left, right = gc.exp(), (-gc).exp()
        kappa_r = kappa * right
        A = ((k * left) @ kappa_r.transpose(-1, -2)).tril(-1)
        M_q = ((q * left) @ kappa_r.transpose(-1, -2)).tril()
    else:
        incl = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
        diff = (gc[..., :, None, :] - gc[..., None, :, :]).masked_fill(~incl[:, :, None], float("-inf"))
        decay = diff.exp()  # [B,H,N,C(t),C(s),K], Gamma_t / Gamma_s for s <= t, else 0
        A = torch.einsum("...tk,...tsk,...sk->...ts", k, decay, kappa).tril(-1)
        M_q = torch.einsum("...tk,...tsk,...sk->...ts", q, decay, kappa)
    L = A + torch.eye(chunk, dtype=A.dtype, device=A.device)
    W_v = torch.linalg.solve_triangular(L, v, upper=False, unitriangular=True)
    W_k = torch.linalg.solve_triangular(L, k * gc.exp(), upper=False, unitriangular=True)
    q_g = q * gc.exp()
    g_last = gc[..., -1:, :]
    kappa_dec = kappa * (g_last - gc).exp()
    gamma_last = g_last.exp().squeeze(-2)[..., None]  # [B,H,N,K,1]

    S = S0
    out = []
    for n in range(N):
        delta = W_v[:, :, n] - W_k[:, :, n] @ S
        out.append(q_g[:, :, n] @ S + M_q[:, :, n] @ delta)
        S = gamma_last[:, :, n] * S + kappa_dec[:, :, n].transpose(-1, -2) @ delta
    o = torch.stack(out, 2).reshape(B, H, N * chunk, V).transpose(1, 2)[:, :T]
    return o, S


def torch_diagonal_kdn(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, omega: Tensor, r: Tensor, mu: Tensor, initial_state: State
) -> tuple[Tensor, State]:
    """Diagonal KDN in chunked PyTorch: ``q, k, g, omega [B,T,H,K]``, ``v [B,T,H,V]``, ``r [B,T,H]``, ``mu [H]``,
    ``initial_state = (S [B,H,K,V], p [B,H,K])``, one float dtype. Returns ``o [B,T,H,V]`` and ``(S_T, p_T)``."""
    kappa, p = _gain.diagonal_gain(k, g, omega, r, mu, initial_state[1])
    o, S = memory_chunk(q, k, kappa, v, g, initial_state[0])
    return o, (S, p)


def torch_isotropic_kdn(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, omega: Tensor, r: Tensor, mu: Tensor, initial_state: State
) -> tuple[Tensor, State]:
    """Isotropic KDN in chunked PyTorch: as :func:`torch_diagonal_kdn` with ``omega [B,T,H]`` and
    ``initial_state = (S, b [B,H])``."""
    beta, b = _gain.isotropic_gain(k, g, omega, r, mu, initial_state[1])
    o, S = memory_chunk(q, k, beta[..., None] * k, v, g, initial_state[0])
    return o, (S, b)
