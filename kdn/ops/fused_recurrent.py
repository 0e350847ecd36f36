"""The one-token Triton step of KDN (decoding, short prefill; docs/math.md §3, §4): gain and memory token by token
in one kernel, the state in registers, without autograd.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kdn.ops.utils import State


@triton.jit
def _fused_recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, w_ptr, r_ptr, mu_ptr, S_ptr, u_ptr, u_out_ptr, o_ptr, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    ISOTROPIC: tl.constexpr,
):
    # one (batch, head) and one block of value columns; the whole key axis lives in registers
    pid_v = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    h = bh % H
    offs_k = tl.arange(0, BK)
    offs_v = pid_v * BV + tl.arange(0, BV)
    mk, mv = offs_k < K, offs_v < V
    mkv = mk[:, None] & mv[None, :]
    S = tl.load(S_ptr + bh * K * V + offs_k[:, None] * V + offs_v[None, :], mask=mkv, other=0.0)
    mu = tl.load(mu_ptr + h)
    if ISOTROPIC:
        unc = tl.load(u_ptr + bh)
    else:
        unc = tl.load(u_ptr + bh * K + offs_k, mask=mk, other=0.0)
    b = bh // H
    for t in range(T):
        tok = (b * T + t) * H + h  # row of [B, T, H, *]
        q = tl.load(q_ptr + tok * K + offs_k, mask=mk, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + tok * K + offs_k, mask=mk, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + tok * V + offs_v, mask=mv, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + tok * K + offs_k, mask=mk, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + tok).to(tl.float32)
        alpha = tl.exp(g)
        k2 = k * k
        if ISOTROPIC:
            w = tl.load(w_ptr + tok).to(tl.float32)
            a = tl.sum(tl.where(mk, alpha * alpha, 0.0), axis=0) / K
            b_hat = a * unc + w
            n = tl.sum(k2, axis=0)
            kappa = b_hat / (r + b_hat * n) * k
            unc = b_hat / (1.0 + mu * n / (K * r) * b_hat)
        else:
            w = tl.load(w_ptr + tok * K + offs_k, mask=mk, other=0.0).to(tl.float32)
            p_hat = alpha * alpha * unc + w
            kappa = p_hat * k / (r + tl.sum(p_hat * k2, axis=0))
            unc = p_hat / (1.0 + mu / r * k2 * p_hat)
        S = S * alpha[:, None]
        delta = v - tl.sum(S * k[:, None], axis=0)
        S = S + kappa[:, None] * delta[None, :]
        o = tl.sum(S * q[:, None], axis=0)
        tl.store(o_ptr + tok * V + offs_v, o, mask=mv)
    tl.store(S_ptr + bh * K * V + offs_k[:, None] * V + offs_v[None, :], S, mask=mkv)
    if pid_v == 0:  # every value block computes the same uncertainty; a separate buffer avoids a read race
        if ISOTROPIC:
            tl.store(u_out_ptr + bh, unc)
        else:
            tl.store(u_out_ptr + bh * K + offs_k, unc, mask=mk)


def _fused_recurrent(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, omega: Tensor, r: Tensor, mu: Tensor, initial_state: State,
    isotropic: bool, inplace: bool = False,
) -> tuple[Tensor, State]:
    B, T, H, K = k.shape
    V = v.shape[-1]
    if inplace:
        S = initial_state[0]
        if S.dtype != torch.float32 or not S.is_contiguous():
            raise ValueError(f"inplace=True updates the memory where it lies: it must be a contiguous FP32 tensor, got "
                             f"{S.dtype}{'' if S.is_contiguous() else ' (not contiguous)'}; pass inplace=False")
    else:
        S = initial_state[0].float().contiguous().clone()
    unc = initial_state[1].float().contiguous()
    unc_out = torch.empty_like(unc)
    o = torch.empty(B, T, H, V, device=v.device, dtype=torch.float32)
    BK = triton.next_power_of_2(K)
    BV = min(triton.next_power_of_2(V), 32)
    args = [x.contiguous() for x in (q, k, v, g, omega, r)]
    _fused_recurrent_kernel[(triton.cdiv(V, BV), B * H)](
        *args, mu.float().contiguous(), S, unc, unc_out, o, T, H=H, K=K, V=V, BK=BK, BV=BV, ISOTROPIC=isotropic,
    )
    return o, (S, unc_out)


def fused_recurrent_diagonal_kdn(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, omega: Tensor, r: Tensor, mu: Tensor, initial_state: State, *,
    inplace: bool = False,
) -> tuple[Tensor, State]:
    """Diagonal KDN token by token in one Triton kernel, without autograd.

    Args:
        q, k, g, omega: ``[B,T,H,K]``; ``v``: ``[B,T,H,V]``; ``r``: ``[B,T,H]``; ``mu``: ``[H]``.
        initial_state: ``(S [B,H,K,V], p [B,H,K])``.

        inplace: the new memory overwrites ``S`` (a contiguous FP32 tensor, as a static decoding cache holds it)
            instead of a copy; the uncertainty always comes back in a new tensor.

    Returns:
        ``o [B,T,H,V]`` (FP32) and the new state (FP32 copies unless ``inplace``; then ``S`` itself is returned).

    Example::

        o, (S, p) = fused_recurrent_diagonal_kdn(q[:, None], k[:, None], v[:, None], g[:, None],
                                                 omega[:, None], r[:, None], mu, (S, p))
    """
    return _fused_recurrent(q, k, v, g, omega, r, mu, initial_state, False, inplace)


def fused_recurrent_isotropic_kdn(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, omega: Tensor, r: Tensor, mu: Tensor, initial_state: State, *,
    inplace: bool = False,
) -> tuple[Tensor, State]:
    """Isotropic KDN token by token in one Triton kernel: as :func:`fused_recurrent_diagonal_kdn` with
    ``omega [B,T,H]`` and ``initial_state = (S [B,H,K,V], b [B,H])``."""
    return _fused_recurrent(q, k, v, g, omega, r, mu, initial_state, True, inplace)
