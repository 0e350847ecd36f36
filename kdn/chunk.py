"""Chunkwise memory scan in PyTorch for the asymmetric delta rule (SPEC §6).

``S_t = (I - kappa_t k_t^T) D_t S_{t-1} + kappa_t v_t^T``, ``o_t = S_t^T q_t``. Inside each chunk the
innovations solve a unit lower-triangular system (the UT transform); across chunks the state is
carried. Decay ratios ``Gamma_t / Gamma_s`` are ``exp(gc_t - gc_s)`` of cumulative log-retention,
masked before exponentiation, so strong forgetting neither overflows nor loses accuracy.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

MEMORY_CHUNK = 32


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
    incl = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    diff = (gc[..., :, None, :] - gc[..., None, :, :]).masked_fill(~incl[:, :, None], float("-inf"))
    decay = diff.exp()  # [B,H,N,C(t),C(s),K], Gamma_t / Gamma_s for s <= t, else 0

    A = torch.einsum("...tk,...tsk,...sk->...ts", k, decay, kappa).tril(-1)
    L = A + torch.eye(chunk, dtype=A.dtype, device=A.device)
    W_v = torch.linalg.solve_triangular(L, v, upper=False, unitriangular=True)
    W_k = torch.linalg.solve_triangular(L, k * gc.exp(), upper=False, unitriangular=True)
    M_q = torch.einsum("...tk,...tsk,...sk->...ts", q, decay, kappa)
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
