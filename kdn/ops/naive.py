"""Token-by-token reference recurrences (docs/math.md §2–4). Readable, exact, slow.

Layout: ``q, k: [B, T, H, K]``, ``v: [B, T, H, V]``, ``g = log(alpha): [B, T, H, K]``, ``r: [B, T, H]``.
Diagonal ``omega: [B, T, H, K]``, Isotropic ``omega: [B, T, H]``. ``mu: [H]``.
States: Diagonal ``(S [B,H,K,V], p [B,H,K])``; Isotropic ``(S, b [B,H])``; exact ``(S, P [B,H,K,K])``.
Everything here runs in the dtype it is given; callers upcast. Argument order, as every KDN entry point:
the tensors ``q, k, v, g, omega, r``, then ``mu``, then the state.
"""
from __future__ import annotations

import torch
from torch import Tensor

from kdn.ops.utils import State


def diagonal_gain_step(
    k: Tensor, g: Tensor, omega: Tensor, r: Tensor, mu: Tensor, p: Tensor
) -> tuple[Tensor, Tensor]:
    """One Diagonal gain step. ``k, g, omega, p: [B,H,K]``, ``r: [B,H]``, ``mu: [H]``.

    Returns ``kappa [B,H,K]`` (from the predicted variance) and the posterior ``p [B,H,K]``.
    """
    p_hat = torch.exp(2 * g) * p + omega
    s = r + (p_hat * k * k).sum(-1)
    kappa = p_hat * k / s[..., None]
    u = (mu[:, None] / r[..., None]) * k * k
    return kappa, p_hat / (1 + u * p_hat)


def isotropic_gain_step(
    k: Tensor, g: Tensor, omega: Tensor, r: Tensor, mu: Tensor, b: Tensor
) -> tuple[Tensor, Tensor]:
    """One Isotropic gain step. ``k, g: [B,H,K]``, ``omega, r, b: [B,H]``, ``mu: [H]``.

    Returns the scalar gain ``beta [B,H]`` (``kappa = beta k``) and the posterior ``b [B,H]``.
    """
    dk = k.shape[-1]
    b_hat = torch.exp(2 * g).mean(-1) * b + omega
    n = (k * k).sum(-1)
    beta = b_hat / (r + b_hat * n)
    u = mu * n / (dk * r)
    return beta, b_hat / (1 + u * b_hat)


def memory_step(
    q: Tensor, k: Tensor, kappa: Tensor, v: Tensor, g: Tensor, S: Tensor
) -> tuple[Tensor, Tensor]:
    """``S <- D S + kappa (v - (D S)^T k)^T``; ``o = S^T q``. Vectors ``[B,H,K|V]``, ``S [B,H,K,V]``."""
    S = torch.exp(g)[..., None] * S
    delta = v - torch.einsum("bhkv,bhk->bhv", S, k)
    S = S + kappa[..., None] * delta[..., None, :]
    return torch.einsum("bhkv,bhk->bhv", S, q), S


def diagonal_kdn_step_ref(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, omega: Tensor, r: Tensor, mu: Tensor, state: State
) -> tuple[Tensor, State]:
    """One Diagonal KDN token: ``q, k, g, omega: [B,H,K]``, ``v: [B,H,V]``, ``r: [B,H]``."""
    S, p = state
    kappa, p = diagonal_gain_step(k, g, omega, r, mu, p)
    o, S = memory_step(q, k, kappa, v, g, S)
    return o, (S, p)


def isotropic_kdn_step_ref(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, omega: Tensor, r: Tensor, mu: Tensor, state: State
) -> tuple[Tensor, State]:
    """One Isotropic KDN token: ``q, k, g: [B,H,K]``, ``v: [B,H,V]``, ``omega, r: [B,H]``."""
    S, b = state
    beta, b = isotropic_gain_step(k, g, omega, r, mu, b)
    o, S = memory_step(q, k, beta[..., None] * k, v, g, S)
    return o, (S, b)


def diagonal_kdn_recurrent(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, omega: Tensor, r: Tensor, mu: Tensor, state: State
) -> tuple[Tensor, State]:
    """Diagonal KDN over a sequence, one token at a time. Returns ``o [B,T,H,V]`` and the state."""
    out = []
    for t in range(q.shape[1]):
        o, state = diagonal_kdn_step_ref(
            q[:, t], k[:, t], v[:, t], g[:, t], omega[:, t], r[:, t], mu, state
        )
        out.append(o)
    return torch.stack(out, 1), state


def isotropic_kdn_recurrent(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, omega: Tensor, r: Tensor, mu: Tensor, state: State
) -> tuple[Tensor, State]:
    """Isotropic KDN over a sequence, one token at a time. Returns ``o [B,T,H,V]`` and the state."""
    out = []
    for t in range(q.shape[1]):
        o, state = isotropic_kdn_step_ref(
            q[:, t], k[:, t], v[:, t], g[:, t], omega[:, t], r[:, t], mu, state
        )
        out.append(o)
    return torch.stack(out, 1), state


def exact_kalman_recurrent(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, omega: Tensor, r: Tensor, state: State
) -> tuple[Tensor, State]:
    """Exact Kalman memory with dense key covariance ``P [B,H,K,K]`` (docs/math.md §2)."""
    S, P = state
    out = []
    for t in range(q.shape[1]):
        alpha = torch.exp(g[:, t])
        P_hat = alpha[..., :, None] * P * alpha[..., None, :] + torch.diag_embed(omega[:, t])
        kt = k[:, t]
        Pk = torch.einsum("bhij,bhj->bhi", P_hat, kt)
        z = (kt * Pk).sum(-1)
        kappa = Pk / (r[:, t] + z)[..., None]
        o, S = memory_step(q[:, t], kt, kappa, v[:, t], g[:, t], S)
        P = P_hat - kappa[..., :, None] * Pk[..., None, :]
        out.append(o)
    return torch.stack(out, 1), (S, P)
