"""The CUDA backend of KDN: Triton gain scans plus fla's chunk memory kernels (SPEC §6).

Gain scan (ours, Triton): per channel, the predicted variances ``p^_t`` follow a Möbius recurrence. The
kernel walks the sequence in chunks of ``BT`` tokens; inside a chunk it composes the 2x2 matrices with
``tl.associative_scan`` (renormalised by their max-abs entry, FP32), applies the carry from the previous
chunk and emits ``p^_t``. Pairing each prediction with the *previous* token's update,
``N_t = [[a_t + w_t u_{t-1}, w_t], [u_{t-1}, 1]]``, makes the scan emit ``p^_t`` directly. The backward is
the adjoint recurrence ``lambda_{t-1} = a_t (gamma_t + lambda_t / (1 + u_t p^_t)^2)``: an affine scan in
reverse time, chunked the same way, with ``p_{t-1}`` recomputed from ``p^_{t-1}``.

Memory scan: Isotropic KDN is exactly fla's ``chunk_kda`` with ``beta`` = the KDN gain. Diagonal KDN maps
onto fla's ``chunk_dplr_delta_rule(q, k=kappa, v, a=exp(g) k, b=-kappa, gk=g)``.

Decoding: ``fused_recurrent`` runs gain and memory token by token in one kernel, the state in registers.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

State = tuple[Tensor, Tensor]


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
def _affine_combine(a_A, a_B, b_A, b_B):
    # a: the accumulated map, b: the next map; returns b o a
    return b_A * a_A, b_A * a_B + b_B


@triton.jit
def _gain_scan_fwd_kernel(
    x_ptr, w_ptr, u_ptr, p0_ptr, phat_ptr, pT_ptr, T, C: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, X_IS_LOG: tl.constexpr,
):
    pid_c = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_c = pid_c * BC + tl.arange(0, BC)
    mask_c = offs_c < C
    p = tl.load(p0_ptr + b * C + offs_c, mask=mask_c, other=1.0)
    base = b * T * C
    ar = tl.arange(0, BT)
    for t0 in range(0, T + 1, BT):
        rows = t0 + ar
        m = (rows < T)[:, None] & mask_c[None, :]
        idx = base + rows[:, None].to(tl.int64) * C + offs_c[None, :]
        x = tl.load(x_ptr + idx, mask=m, other=0.0)
        if X_IS_LOG:
            a = tl.exp(2.0 * x)
        else:
            a = tl.where(m, x, 1.0)
        w = tl.load(w_ptr + idx, mask=m, other=0.0)
        mp = ((rows >= 1) & (rows <= T))[:, None] & mask_c[None, :]
        u_prev = tl.load(u_ptr + idx - C, mask=mp, other=0.0)
        n11 = a + w * u_prev
        n22 = tl.full([BT, BC], 1.0, tl.float32)
        P11, P12, P21, P22 = tl.associative_scan((n11, w, u_prev, n22), 0, _mobius_combine)
        ph = (P11 * p[None, :] + P12) / (P21 * p[None, :] + P22)
        tl.store(phat_ptr + idx, ph, mask=m)
        p = tl.sum(tl.where((ar == BT - 1)[:, None], ph, 0.0), axis=0)
    tl.store(pT_ptr + b * C + offs_c, p, mask=mask_c)


@triton.jit
def _gain_scan_bwd_kernel(
    x_ptr, u_ptr, phat_ptr, p0_ptr, dphat_ptr, dpT_ptr, dx_ptr, dw_ptr, du_ptr, dp0_ptr, T,
    C: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, X_IS_LOG: tl.constexpr,
):
    pid_c = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_c = pid_c * BC + tl.arange(0, BC)
    mask_c = offs_c < C
    lam = tl.load(dpT_ptr + b * C + offs_c, mask=mask_c, other=0.0)  # lambda at the chunk's last row
    p0 = tl.load(p0_ptr + b * C + offs_c, mask=mask_c, other=1.0)
    base = b * T * C
    ar = tl.arange(0, BT)
    n_chunks = tl.cdiv(T, BT)
    for j in range(n_chunks):
        t_end = (n_chunks - 1 - j) * BT + BT - 1
        rows = t_end - ar  # reversed: index i holds token t_end - i
        valid = (rows < T)[:, None] & mask_c[None, :]
        idx = base + rows[:, None].to(tl.int64) * C + offs_c[None, :]
        # the map lambda_t -> lambda_{t-1} of token s = t + 1 (identity past the end)
        nxt = ((rows + 1) < T)[:, None] & mask_c[None, :]
        xs = tl.load(x_ptr + idx + C, mask=nxt, other=0.0)
        if X_IS_LOG:
            a_s = tl.exp(2.0 * xs)
        else:
            a_s = tl.where(nxt, xs, 1.0)
        u_s = tl.load(u_ptr + idx + C, mask=nxt, other=0.0)
        ph_s = tl.load(phat_ptr + idx + C, mask=nxt, other=0.0)
        gam_s = tl.load(dphat_ptr + idx + C, mask=nxt, other=0.0)
        d_s = 1.0 + u_s * ph_s
        A = a_s / (d_s * d_s)
        Bv = a_s * gam_s
        first = (ar == 0)[:, None]
        A = tl.where(first, 0.0, A)
        Bv = tl.where(first, lam[None, :], Bv)
        _, lam_t = tl.associative_scan((A, Bv), 0, _affine_combine)
        # this token's own terms
        x = tl.load(x_ptr + idx, mask=valid, other=0.0)
        if X_IS_LOG:
            a = tl.exp(2.0 * x)
        else:
            a = x
        u = tl.load(u_ptr + idx, mask=valid, other=0.0)
        ph = tl.load(phat_ptr + idx, mask=valid, other=0.0)
        gam = tl.load(dphat_ptr + idx, mask=valid, other=0.0)
        d = 1.0 + u * ph
        c = 1.0 / (d * d)
        dph = gam + c * lam_t
        prev_ok = ((rows >= 1) & (rows < T))[:, None] & mask_c[None, :]
        u_p = tl.load(u_ptr + idx - C, mask=prev_ok, other=0.0)
        ph_p = tl.load(phat_ptr + idx - C, mask=prev_ok, other=0.0)
        p_prev = tl.where((rows == 0)[:, None], p0[None, :], ph_p / (1.0 + u_p * ph_p))
        da = p_prev * dph
        if X_IS_LOG:
            tl.store(dx_ptr + idx, 2.0 * a * da, mask=valid)
        else:
            tl.store(dx_ptr + idx, da, mask=valid)
        tl.store(dw_ptr + idx, dph, mask=valid)
        tl.store(du_ptr + idx, -lam_t * ph * ph * c, mask=valid)
        # lambda entering the earlier chunk: a_{t0} dp^_{t0} (row index BT - 1)
        lam = tl.sum(tl.where((ar == BT - 1)[:, None], a * dph, 0.0), axis=0)
    tl.store(dp0_ptr + b * C + offs_c, lam, mask=mask_c)


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


def fused_recurrent(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, omega: Tensor, r: Tensor, mu: Tensor, state: State,
    isotropic: bool,
) -> tuple[Tensor, State]:
    """Token-by-token KDN in one kernel (decoding, short prefill), without autograd.

    ``q, k, g: [B,T,H,K]``, ``v: [B,T,H,V]``, ``omega: [B,T,H,K]`` (``[B,T,H]`` isotropic), ``r: [B,T,H]``,
    ``mu: [H]``, ``state = (S [B,H,K,V], p [B,H,K] or b [B,H])``. Returns ``o [B,T,H,V]`` (FP32) and the
    new state (FP32 copies; the inputs are not modified).
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    S = state[0].float().contiguous().clone()
    unc = state[1].float().contiguous()
    unc_out = torch.empty_like(unc)
    o = torch.empty(B, T, H, V, device=v.device, dtype=torch.float32)
    BK = triton.next_power_of_2(K)
    BV = min(triton.next_power_of_2(V), 32)
    args = [x.contiguous() for x in (q, k, v, g, omega, r)]
    _fused_recurrent_kernel[(triton.cdiv(V, BV), B * H)](
        *args, mu.float().contiguous(), S, unc, unc_out, o, T, H=H, K=K, V=V, BK=BK, BV=BV, ISOTROPIC=isotropic,
    )
    return o, (S, unc_out)


_BT, _BC = 32, 32


class _MobiusScan(torch.autograd.Function):
    """``(x, w, u, p0) -> (p^ [B,T,C], p_T [B,C])``; ``x`` is ``g`` (``a = exp(2g)``) or ``a`` itself."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, x: Tensor, w: Tensor, u: Tensor, p0: Tensor, x_is_log: bool
    ) -> tuple[Tensor, Tensor]:
        x, w, u, p0 = (t.float().contiguous() for t in (x, w, u, p0))
        B, T, C = x.shape
        phat = torch.empty_like(x)
        pT = torch.empty_like(p0)
        grid = (triton.cdiv(C, _BC), B)
        _gain_scan_fwd_kernel[grid](x, w, u, p0, phat, pT, T, C, BT=_BT, BC=_BC, X_IS_LOG=x_is_log)
        ctx.save_for_backward(x, u, phat, p0)
        ctx.x_is_log = x_is_log
        return phat, pT

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, dphat: Tensor | None, dpT: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        x, u, phat, p0 = ctx.saved_tensors
        B, T, C = x.shape
        dphat = torch.zeros_like(phat) if dphat is None else dphat.float().contiguous()
        dpT = torch.zeros_like(p0) if dpT is None else dpT.float().contiguous()
        dx, dw, du = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)
        dp0 = torch.empty_like(p0)
        grid = (triton.cdiv(C, _BC), B)
        _gain_scan_bwd_kernel[grid](x, u, phat, p0, dphat, dpT, dx, dw, du, dp0, T, C,
                                    BT=_BT, BC=_BC, X_IS_LOG=ctx.x_is_log)
        return dx, dw, du, dp0, None


def diagonal_gain(k: Tensor, g: Tensor, omega: Tensor, r: Tensor, mu: Tensor, p0: Tensor) -> tuple[Tensor, Tensor]:
    """Triton Diagonal gains: ``kappa [B,T,H,K]`` (FP32) and ``p_T [B,H,K]``. Shapes as ``kdn.gain``."""
    B, T, H, K = k.shape
    kf, rf = k.float(), r.float()
    k2 = kf * kf
    u = (mu.float()[:, None] / rf[..., None]) * k2
    phat, pT = _MobiusScan.apply(g.reshape(B, T, H * K), omega.reshape(B, T, H * K), u.reshape(B, T, H * K),
                                 p0.reshape(B, H * K), True)
    phat = phat.view(B, T, H, K)
    s = rf + (phat * k2).sum(-1)
    return phat * kf / s[..., None], pT.view(B, H, K)


def isotropic_gain(k: Tensor, g: Tensor, omega: Tensor, r: Tensor, mu: Tensor, b0: Tensor) -> tuple[Tensor, Tensor]:
    """Triton Isotropic gains: ``beta [B,T,H]`` (FP32) and ``b_T [B,H]``."""
    K = k.shape[-1]
    kf, rf = k.float(), r.float()
    a = torch.exp(2 * g.float()).mean(-1)
    n = (kf * kf).sum(-1)
    u = mu.float() * n / (K * rf)
    bhat, bT = _MobiusScan.apply(a, omega, u, b0, False)
    return bhat / (rf + bhat * n), bT


def _mem_dtype(x: Tensor) -> torch.dtype:
    return torch.bfloat16 if x.dtype in (torch.bfloat16, torch.float16) else torch.float32


def diagonal_kdn(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, omega: Tensor, r: Tensor, mu: Tensor, state: State
) -> tuple[Tensor, State]:
    """Diagonal KDN on CUDA: Triton gain scan + fla's DPLR chunk kernel for the asymmetric memory."""
    from fla.ops.generalized_delta_rule.dplr import chunk_dplr_delta_rule

    kappa, pT = diagonal_gain(k, g, omega, r, mu, state[1])
    dt = _mem_dtype(v)
    gf = g.float()
    o, S = chunk_dplr_delta_rule(
        q=q.to(dt), k=kappa.to(dt), v=v.to(dt), a=(gf.exp() * k.float()).to(dt), b=(-kappa).to(dt), gk=gf,
        scale=1.0, initial_state=state[0].float(), output_final_state=True,
    )
    return o, (S, pT)


def isotropic_kdn(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, omega: Tensor, r: Tensor, mu: Tensor, state: State
) -> tuple[Tensor, State]:
    """Isotropic KDN on CUDA: Triton gain scan + fla's ``chunk_kda`` with ``beta`` = the KDN gain."""
    from fla.ops.kda import chunk_kda

    beta, bT = isotropic_gain(k, g, omega, r, mu, state[1])
    dt = _mem_dtype(v)
    o, S = chunk_kda(
        q=q.to(dt), k=k.to(dt), v=v.to(dt), g=g.float(), beta=beta.to(dt), scale=1.0,
        initial_state=state[0].float(), output_final_state=True,
    )
    return o, (S, bT)
