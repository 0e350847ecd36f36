"""Independent float64 compositions of the delta-rule and KDN layers from their own parameters.

Everything here is written in plain torch from docs/math.md §3-5 (the projections, the causal depthwise
short convolution with SiLU, the L2 norm, the retention gates, the noise and prior parametrisation, the token
recurrences and the gated RMSNorm), reading only the layers' parameters: none of the layers' own functions or
submodules' ``forward`` runs here, so a test that compares a layer with these compositions does not compare the
layer with itself.
"""
from __future__ import annotations

import inspect
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

R_MIN = 0.01  # docs/math.md §5: r = r_min + softplus(w_r^T x + b_r)
PRIOR_FLOOR = 0.1  # docs/math.md §5: initial precision 0.1 + softplus(theta)


def randomize(module: nn.Module, seed: int) -> None:
    """Overwrite every parameter of ``module`` with random values, none at an initial special value: weights
    ``N(0, 1/fan_in)``, biases, gate and noise parameters ``N(0, 0.5^2)``, norm weights ``1 + N(0, 0.3^2)``."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            x = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            if p.dim() >= 2:
                x = x / math.sqrt(p[0].numel())
            elif name.endswith("norm.weight"):
                x = 1.0 + 0.3 * x
            else:
                x = 0.5 * x
            p.copy_(x.to(p.dtype))


def linear(x: Tensor, m: nn.Module) -> Tensor:
    """``x W^T (+ b)`` of an ``nn.Linear`` or of a bottleneck ``nn.Sequential`` of them, from their parameters."""
    layers = list(m) if isinstance(m, nn.Sequential) else [m]
    for lin in layers:
        x = x @ lin.weight.T
        if lin.bias is not None:
            x = x + lin.bias
    return x


def short_conv(x: Tensor, weight: Tensor) -> Tensor:
    """Causal depthwise convolution + SiLU: ``x [B, T, D]``, ``weight [D, 1, W]`` (``weight[:, 0, W-1]`` multiplies
    the current token), zeros before the start."""
    T, W = x.shape[1], weight.shape[-1]
    xp = F.pad(x, (0, 0, W - 1, 0))
    y = sum(weight[:, 0, j] * xp[:, j:j + T] for j in range(W))
    return y * torch.sigmoid(y)


def l2(x: Tensor) -> Tensor:
    """``x / ||x||`` over the last dimension."""
    return x / x.pow(2).sum(-1, keepdim=True).sqrt()


def rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dimension, weighted."""
    return x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt() * weight


def front_qkv(front: nn.Module, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``q, k`` (L2-normalised, unscaled) ``[B, T, H, K]`` and ``v [B, T, H, V]`` of a delta-rule front end."""
    B, T = x.shape[:2]
    H, K, V = front.H, front.K, front.V
    q = short_conv(x @ front.q_proj.weight.T, front.q_conv1d.weight)
    k = short_conv(x @ front.k_proj.weight.T, front.k_conv1d.weight)
    v = short_conv(x @ front.v_proj.weight.T, front.v_conv1d.weight)
    return l2(q.view(B, T, H, K)), l2(k.view(B, T, H, K)), v.view(B, T, H, V)


def retention(front: nn.Module, x: Tensor) -> Tensor:
    """``g = log alpha``: KDA's ``-exp(A_log) softplus(f + dt_bias)`` or ``logsigmoid(f + bias)``; ``[B, T, H, K]``
    for the per-channel gate, ``[B, T, H]`` for the per-head one."""
    B, T = x.shape[:2]
    H = front.H
    f = linear(x, front.f_proj)  # [B, T, H*K] or [B, T, H]
    per = f.shape[-1] // H
    if hasattr(front, "A_log"):
        g = -front.A_log.exp().repeat_interleave(per) * F.softplus(f + front.dt_bias)
    else:
        g = F.logsigmoid(f + front.gate_bias)
    return g.view(B, T, H) if front.gate == "head" else g.view(B, T, H, per)


def kdn_recurrence(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, omega: Tensor, r: Tensor, mu: Tensor, p0: Tensor, isotropic: bool,
) -> tuple[Tensor, Tensor]:
    """Token by token (docs/math.md §3-4), from ``S = 0`` and ``p0 [B, H, K]`` (or ``b0 [B, H]``): ``q`` already
    scaled; ``mu [H]``. Returns ``o [B, T, H, V]`` and the write vectors ``kappa [B, T, H, K]``."""
    B, T, H, K = k.shape
    S = k.new_zeros(B, H, K, v.shape[-1])
    p = p0.clone()
    outs, kappas = [], []
    for t in range(T):
        kt, gt, rt = k[:, t], g[:, t], r[:, t]
        if isotropic:
            n = kt.pow(2).sum(-1)
            p_hat = torch.exp(2 * gt).mean(-1) * p + omega[:, t]
            kappa = (p_hat / (rt + p_hat * n))[..., None] * kt
            p = p_hat / (1 + mu * n / (K * rt) * p_hat)
        else:
            p_hat = torch.exp(2 * gt) * p + omega[:, t]
            kappa = p_hat * kt / (rt + (p_hat * kt * kt).sum(-1))[..., None]
            p = p_hat / (1 + mu[:, None] / rt[..., None] * kt * kt * p_hat)
        S_hat = gt.exp()[..., None] * S
        delta = v[:, t] - torch.einsum("bhkv,bhk->bhv", S_hat, kt)
        S = S_hat + kappa[..., None] * delta[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
        kappas.append(kappa)
    return torch.stack(outs, 1), torch.stack(kappas, 1)


def recurrence_inputs(layer: nn.Module, x: Tensor) -> dict[str, Tensor]:
    """The arguments (``k, g, omega, r, u0, ...``) the layer hands to its effective-write-strength computation in
    one forward of ``x``: the gain recurrence's own inputs of that forward."""
    seen: list[dict] = []
    original = layer.beta_eff
    signature = inspect.signature(original)

    def capture(*args: object, **kwargs: object) -> Tensor:
        seen.append(dict(signature.bind(*args, **kwargs).arguments))
        return original(*args, **kwargs)

    layer.beta_eff = capture
    try:
        with torch.no_grad():
            layer(x, output_beta_eff=True)
    finally:
        del layer.beta_eff
    (got,) = seen
    return got


def kdn_layer(layer: nn.Module, x: Tensor) -> dict[str, Tensor]:
    """The KDN layer's output composed by hand. ``x [B, T, d_model]``; returns ``out [B, T, d_model]``, the memory
    read-out before the norm ``o [B, T, H, V]``, every recurrence input (``q`` scaled, ``k, v, g, omega, r``,
    ``mu [H]``, ``p0``) and the write vectors ``kappa``."""
    front = layer.front
    B, T = x.shape[:2]
    H, K, V = front.H, front.K, front.V
    iso = layer.isotropic
    q, k, v = front_qkv(front, x)
    g = retention(front, x)
    if layer.noise == "fixed_r_omega":
        omega = x.new_ones((B, T, H) if iso else (B, T, H, K))
    else:
        omega = F.softplus(linear(x, layer.omega_proj)).view((B, T, H) if iso else (B, T, H, K))
    r = R_MIN + F.softplus(linear(x, layer.r_proj)) if layer.noise == "learned" else x.new_ones(B, T, H)
    precision = PRIOR_FLOOR + F.softplus(layer.prior_theta)
    p0 = (1 / precision).expand(B, H) if iso else (1 / precision)[:, None].expand(B, H, K)
    choice = layer.mu_choice
    if choice == "learned":
        mu = layer.log_mu.exp()
    else:
        value = {"1": 1.0, "sqrt": math.sqrt(K), "dk": float(K), "4dk": 4.0 * K}.get(choice, choice)
        mu = x.new_full((H,), float(value))
    q = q * K ** -0.5
    o, kappa = kdn_recurrence(q, k, v, g, omega, r, mu, p0, iso)
    gate = linear(x, front.g_proj).view(B, T, H, V)
    y = rms(o, front.o_norm.weight, front.o_norm.eps) * torch.sigmoid(gate)
    out = y.reshape(B, T, H * V) @ front.o_proj.weight.T
    return {"out": out, "o": o, "q": q, "k": k, "v": v, "g": g, "omega": omega, "r": r, "mu": mu, "p0": p0,
            "kappa": kappa}


def delta_layer(name: str, layer: nn.Module, x: Tensor) -> dict[str, Tensor]:
    """A delta-rule baseline (``name`` in ``deltanet, gdn, kda, gdn2``) composed by hand, its recurrence run by
    fla's naive reference (FP32 inside). Returns ``out [B, T, d_model]`` and the memory read-out ``o``."""
    from fla.ops.delta_rule.naive import delta_rule_recurrence
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
    from fla.ops.gdn2.naive import naive_recurrent_gdn2
    from fla.ops.kda.naive import naive_recurrent_kda

    front = layer.front
    B, T = x.shape[:2]
    H, K, V = front.H, front.K, front.V
    q, k, v = front_qkv(front, x)
    scale = K ** -0.5
    if name == "gdn2":
        b = torch.sigmoid(x @ layer.b_proj.weight.T).view(B, T, H, K)
        w = torch.sigmoid(x @ layer.w_proj.weight.T).view(B, T, H, V)
        o, _ = naive_recurrent_gdn2(q, k, v, retention(front, x), b, w, scale=scale)
    else:
        beta = torch.sigmoid(x @ layer.b_proj.weight.T)  # [B, T, H]
        if name == "deltanet":
            o, _ = delta_rule_recurrence(*(t.transpose(1, 2) for t in (q, k, v, beta)))
            o = o.transpose(1, 2)
        elif name == "gdn":
            o, _ = naive_recurrent_gated_delta_rule(q, k, v, beta, retention(front, x), scale=scale)
        else:
            o, _ = naive_recurrent_kda(q, k, v, retention(front, x), beta, scale=scale)
    o = o.double()
    if name == "deltanet":  # plain per-head RMSNorm
        y = rms(o, front.o_norm.weight, front.o_norm.eps)
    elif name == "gdn":  # full-rank swish gate
        gate = (x @ front.g_proj.weight.T).view(B, T, H, V)
        y = rms(o, front.o_norm.weight, front.o_norm.eps) * F.silu(gate)
    else:  # low-rank sigmoid gate with bias
        gate = linear(x, front.g_proj).view(B, T, H, V)
        y = rms(o, front.o_norm.weight, front.o_norm.eps) * torch.sigmoid(gate)
    return {"out": y.reshape(B, T, H * V) @ front.o_proj.weight.T, "o": o}
