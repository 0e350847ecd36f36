"""Chunked Möbius gain scans in PyTorch (docs/math.md §3, §4, §6).

Each uncertainty channel follows ``p_t = (a_t p_{t-1} + w_t) / (u_t a_t p_{t-1} + 1 + u_t w_t)``,
i.e. the homogeneous linear map ``M_t = [[a, w], [u a, 1 + u w]]``. The scan composes these 2x2
matrices: a log-depth inclusive scan inside each chunk, an exclusive carry across chunks, then
a replay that emits ``p_{t-1}`` for every token. Products are rescaled by their max-abs entry
(the ratio ``n / d`` is scale-free, so the scale is detached) and kept in FP32 or float64.

FP32 range: a map is unchanged by a positive factor, so each token's matrix is formed already divided by
``(1 + u)(1 + w)`` from ``1 / (1 + u) = r / (r + x)``, ``u / (1 + u) = x / (r + x)`` (``u = x / r``),
``1 / (1 + w)`` and ``w / (1 + w)``: every entry lies in ``[0, 1]`` and no intermediate overflows, whatever the size
of ``w`` (process noise), ``1 / r`` or ``mu``. The gains are formed from ``p^`` and ``r`` divided by their largest
value, which leaves them unchanged and keeps ``p^ k^2`` in range.
"""
from __future__ import annotations

import torch
from torch import Tensor

GAIN_CHUNK = 64


def _compose(later: tuple[Tensor, ...], earlier: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """``later @ earlier`` for batches of 2x2 matrices stored as four tensors, renormalised."""
    a11, a12, a21, a22 = later
    b11, b12, b21, b22 = earlier
    c = (
        a11 * b11 + a12 * b21,
        a11 * b12 + a12 * b22,
        a21 * b11 + a22 * b21,
        a21 * b12 + a22 * b22,
    )
    scale = torch.stack(c).abs().amax(0).detach().clamp_min(torch.finfo(c[0].dtype).tiny)
    return tuple(x / scale for x in c)


def _token_maps(a: Tensor, w: Tensor, x: Tensor, r: Tensor) -> tuple[Tensor, ...]:
    """Each token's ``M = [[a, w], [u a, 1 + u w]]`` (``u = x / r``) divided by ``(1 + u)(1 + w)`` and then by its
    largest entry (detached): the same map, entries in ``[0, 1]``, none of them overflowing."""
    den = r + x
    rho, sigma = r / den, x / den  # 1 / (1 + u), u / (1 + u)
    tau, wt = 1 / (1 + w), w / (1 + w)  # 1 / (1 + w), w / (1 + w)
    tiny = torch.finfo(a.dtype).tiny
    mats = (a * rho * tau, rho * wt, a * sigma * tau, (rho * tau + sigma * wt).clamp_min(tiny))
    scale = torch.stack(torch.broadcast_tensors(*mats)).amax(0).detach().clamp_min(tiny)
    return tuple(m / scale for m in mats)


def mobius_prev(
    a: Tensor, w: Tensor, x: Tensor, r: Tensor, p0: Tensor, chunk: int = GAIN_CHUNK
) -> tuple[Tensor, Tensor]:
    """Scan ``p_t = (a p + w) / (u a p + 1 + u w)``, ``u = x / r``, along dim 1.

    ``a, w, x: [B, T, *S]`` (all >= 0), ``r``: ``> 0``, broadcastable to them, ``p0: [B, *S]``. Returns ``p_prev
    [B, T, *S]`` (the value before each token's update, ``p_{t-1}``) and ``p_T [B, *S]``.
    """
    B, T = a.shape[:2]
    rest = a.shape[2:]
    pad = (-T) % chunk
    mats = _token_maps(a, w, x, r)
    if pad:
        # identity matrices after the end leave every prefix unchanged
        ident = (1.0, 0.0, 0.0, 1.0)
        mats = tuple(
            torch.cat([m, m.new_full((B, pad, *rest), e)], 1) for m, e in zip(mats, ident)
        )
    n_chunks = (T + pad) // chunk
    mats = tuple(m.reshape(B, n_chunks, chunk, *rest) for m in mats)

    # inclusive Hillis-Steele scan inside each chunk: X[t] <- X[t] @ X[t - offset]
    offset = 1
    while offset < chunk:
        shifted = tuple(m[:, :, :-offset] for m in mats)
        head = tuple(m[:, :, offset:] for m in mats)
        new = _compose(head, shifted)
        mats = tuple(torch.cat([m[:, :, :offset], nm], 2) for m, nm in zip(mats, new))
        offset *= 2

    # exclusive carry across chunks: the value entering each chunk
    carries = []
    p = p0
    for j in range(n_chunks):
        carries.append(p)
        m11, m12, m21, m22 = (m[:, j, -1] for m in mats)
        p = (m11 * p + m12) / (m21 * p + m22)
    carry = torch.stack(carries, 1)[:, :, None]  # [B, N, 1, *S]

    m11, m12, m21, m22 = mats
    p_incl = ((m11 * carry + m12) / (m21 * carry + m22)).reshape(B, n_chunks * chunk, *rest)[:, :T]
    p_prev = torch.cat([p0[:, None], p_incl[:, :-1]], 1)
    return p_prev, p_incl[:, -1]


def diagonal_gain(
    k: Tensor, g: Tensor, omega: Tensor, r: Tensor, mu: Tensor, p0: Tensor
) -> tuple[Tensor, Tensor]:
    """Diagonal KDN gains. ``k, g, omega: [B,T,H,K]``, ``r: [B,T,H]``, ``mu: [H]``, ``p0: [B,H,K]``.

    Returns ``kappa [B,T,H,K]`` and the final ``p [B,H,K]``.
    """
    a = torch.exp(2 * g)
    p_prev, p_T = mobius_prev(a, omega, mu[:, None] * k * k, r[..., None], p0)
    p_hat = a * p_prev + omega
    c = torch.maximum(p_hat.amax(-1), r).detach()[..., None]  # kappa is unchanged by a common factor
    ph = p_hat / c
    return ph * k / (r[..., None] / c + (ph * k * k).sum(-1, keepdim=True)), p_T


def isotropic_gain(
    k: Tensor, g: Tensor, omega: Tensor, r: Tensor, mu: Tensor, b0: Tensor
) -> tuple[Tensor, Tensor]:
    """Isotropic KDN gains. ``k, g: [B,T,H,K]``, ``omega, r: [B,T,H]``, ``mu: [H]``, ``b0: [B,H]``.

    Returns ``beta [B,T,H]`` (``kappa = beta k``) and the final ``b [B,H]``.
    """
    a = torch.exp(2 * g).mean(-1)
    n = (k * k).sum(-1)
    b_prev, b_T = mobius_prev(a, omega, mu * n / k.shape[-1], r, b0)
    b_hat = a * b_prev + omega
    c = torch.maximum(b_hat, r).detach()  # beta is unchanged by a common factor
    bh = b_hat / c
    return bh / (r / c + bh * n), b_T


