"""Diagonal and Isotropic KDN mixers as ``nn.Module``s (docs/math.md §5).

Both share KDA's front end (:class:`kdn.modules.DeltaFrontEnd`) and differ only in the shape of the
process noise and of the uncertainty state. ``forward`` returns ``(o, beta_eff | None, cache)``. The kernels'
options live in each layer's config dataclass beside it (:class:`IsotropicKDNConfig`, :class:`DiagonalKDNConfig`:
their defaults and checks, once); the backbone's kernel settings are constructor arguments: ``fused`` (the fused CUDA
front end) and ``recompute_states`` (the memory's backward recomputes its states).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from functools import partial
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from kdn.layers.cache import RecurrentCache
from kdn.modules import (
    DeltaFrontEnd,
    GatedRMSNorm,
    Linear,
    ShortConv,
    current_mask,
    finish,
    inv_softplus,
    kda_retention,
    low_rank,
    sigmoid_retention,
    upcast,
)
from kdn.ops import api
from kdn.ops.validate import check_memory, check_precision

MU_CHOICES = ("1", "sqrt", "dk", "4dk", "learned")
NOISE_CHOICES = ("learned", "fixed_r", "fixed_r_omega")
ALPHA_PARAMS = ("kda", "sigmoid")
R_MIN = 0.01


@dataclass
class IsotropicKDNConfig:
    """Isotropic KDN's options (the ``mixer.*`` keys of training; each checked here, once, when it is made).

    ``mu``: the information scale, one of :data:`MU_CHOICES` or a positive number (a numeric string is read as one);
    ``noise``: which of the noises are learned (:data:`NOISE_CHOICES`); ``alpha_param``: the retention gate,
    ``"kda"`` or ``"sigmoid"``; ``precision``: the CUDA memory's, ``"bf16"`` or ``"fp32"`` (docs/kernels.md,
    "Precision"); ``backend``: the op's backend (``None``: Triton on CUDA, PyTorch elsewhere)."""

    mu: str | float = "dk"
    noise: str = "learned"
    alpha_param: str = "kda"
    precision: str = "bf16"
    backend: str | None = None

    def __post_init__(self) -> None:
        mu = self.mu
        if isinstance(mu, bool):
            raise ValueError(f"mu must be one of {MU_CHOICES} or a positive number, got {mu!r}")
        if str(mu) in MU_CHOICES:
            mu = str(mu)
        else:
            try:
                mu = float(mu)
            except (TypeError, ValueError):
                raise ValueError(f"mu must be one of {MU_CHOICES} or a positive number, got {mu!r}") from None
            if not mu > 0:
                raise ValueError(f"mu must be > 0, got {mu}")
        self.mu = mu
        if self.noise not in NOISE_CHOICES:
            raise ValueError(f"noise must be one of {NOISE_CHOICES}, got {self.noise!r}")
        if self.alpha_param not in ALPHA_PARAMS:
            raise ValueError(f"alpha_param must be one of {ALPHA_PARAMS}, got {self.alpha_param!r}")
        check_precision(self.precision, getattr(self, "memory", "asym"))


@dataclass
class DiagonalKDNConfig(IsotropicKDNConfig):
    """Diagonal KDN's options: Isotropic KDN's, and the CUDA memory's route (``memory``, ``"asym"`` or ``"dplr"``,
    with ``chunk_size``: :func:`kdn.ops.diagonal_kdn`)."""

    memory: str = "asym"
    chunk_size: int | None = None

    def __post_init__(self) -> None:
        check_memory(self.memory, self.chunk_size)
        super().__post_init__()


class _KalmanDelta(nn.Module):
    isotropic: bool = False
    Config: type[IsotropicKDNConfig] = IsotropicKDNConfig

    def __init__(
        self, hidden_size: int = 2048, num_heads: int = 16, head_dim: int = 128,
        config: IsotropicKDNConfig | None = None, *, conv_size: int = 4, norm_eps: float = 1e-5,
        layer_idx: int | None = None, fused: bool = True, recompute_states: bool = False, **options: Any,
    ) -> None:
        """``config`` (:attr:`Config`, its defaults when ``None``) with ``options`` (its fields) replaced."""
        super().__init__()
        config = config or self.Config()
        unknown = sorted(set(options) - {f.name for f in fields(config)})
        if unknown:
            raise ValueError(f"{type(self).__name__} does not take {unknown}; its options are the fields of "
                             f"{type(config).__name__}: {[f.name for f in fields(config)]}")
        self.config = c = replace(config, **options)
        for name, flag in (("fused", fused), ("recompute_states", recompute_states)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be True or False, got {flag!r}")
        self.fused, self.recompute_states, self.precision = fused, recompute_states, c.precision
        self.memory, self.chunk_size = getattr(c, "memory", "asym"), getattr(c, "chunk_size", None)
        mu, noise, alpha_param, backend = c.mu, c.noise, c.alpha_param, c.backend
        self.hidden_size, self.num_heads, self.head_dim = hidden_size, num_heads, head_dim
        self.layer_idx, self.backend, self.noise, self.mu_choice = layer_idx, backend, noise, mu
        H, K = num_heads, head_dim
        d, V = hidden_size, head_dim  # the value width of every head: expand_v = 1
        self.front = DeltaFrontEnd(  # registered in this order: the state dict's keys "front.<name>"
            H, K, V, alpha_param=alpha_param, gate="channel", fused=fused,
            q_proj=Linear(d, H * K, bias=False),  # [H*K, d]
            k_proj=Linear(d, H * K, bias=False),  # [H*K, d]
            v_proj=Linear(d, H * V, bias=False),  # [H*V, d]
            q_conv1d=ShortConv(H * K, conv_size, fused=fused),  # [H*K, 1, W]
            k_conv1d=ShortConv(H * K, conv_size, fused=fused),  # [H*K, 1, W]
            v_conv1d=ShortConv(H * V, conv_size, fused=fused),  # [H*V, 1, W]
            f_proj=low_rank(d, V, H * K),  # per-channel retention: [V, d], [H*K, V]
            # kda: A_log [H], dt_bias [H*K]; sigmoid: gate_bias [H*K]
            retention=(kda_retention if alpha_param == "kda" else sigmoid_retention)(H, H * K),
            g_proj=low_rank(d, V, H * V, bias=True),  # output gate: [V, d], [H*V, V] + bias [H*V]
            o_norm=GatedRMSNorm(V, eps=norm_eps, fused=fused),  # [V], sigmoid-gated
            o_proj=Linear(H * V, d, bias=False),  # [d, H*V]
        )
        if noise == "learned":
            self.r_proj = Linear(hidden_size, H, bias=True)
            nn.init.zeros_(self.r_proj.bias)
        if noise != "fixed_r_omega":
            self.omega_proj = (Linear(hidden_size, H, bias=True) if self.isotropic
                               else low_rank(hidden_size, K, H * K, bias=True))
            last = self.omega_proj if self.isotropic else self.omega_proj[-1]
            nn.init.zeros_(last.weight)
            nn.init.zeros_(last.bias)
        # initial precision 0.1 + softplus(theta), initialised to 1
        self.prior_theta = nn.Parameter(inv_softplus(torch.full((H,), 0.9)))
        self.prior_theta._no_weight_decay = True
        if mu == "learned":
            self.log_mu = nn.Parameter(torch.full((H,), math.log(K)))
            self.log_mu._no_weight_decay = True

    def mu(self) -> float | Tensor:
        """The information scale: a float, or an ``[H]`` tensor when learned."""
        K = self.head_dim
        if self.mu_choice == "learned":
            return upcast(self.log_mu).exp()
        return {"1": 1.0, "sqrt": math.sqrt(K), "dk": float(K), "4dk": 4.0 * K}.get(
            self.mu_choice, self.mu_choice)  # type: ignore[arg-type]

    def noise_terms(self, p: dict[str, Tensor], omega_logits: bool = False) -> tuple[Tensor, Tensor]:
        """``omega`` (``[B,T,H]`` isotropic, ``[B,T,H,K]`` diagonal) and ``r [B,T,H]``, in FP32, from the front end's
        projections ``p`` (``p["omega"]``, ``p["r"]`` where learned). With ``omega_logits`` and a learned ``omega``,
        its value before the softplus, in the projection's dtype."""
        like = p["v"]  # [B, T, H, V], in the projections' dtype and device
        B, T = like.shape[:2]
        H, K = self.num_heads, self.head_dim
        shape = (B, T, H) if self.isotropic else (B, T, H, K)
        if self.noise == "fixed_r_omega":
            omega = upcast(like.new_ones(shape))
        elif omega_logits:
            omega = finish(self.omega_proj, p["omega"]).view(shape)
        else:
            omega = F.softplus(upcast(finish(self.omega_proj, p["omega"]))).view(shape)
        if self.noise == "learned":
            r = R_MIN + F.softplus(upcast(p["r"]))
        else:
            r = upcast(like.new_ones(B, T, H))
        return omega, r

    def initial_uncertainty(self, n: int) -> Tensor:
        """``p0 [n,H,K]`` (diagonal) or ``b0 [n,H]`` (isotropic): the inverse learned precision."""
        p0 = 1.0 / (0.1 + F.softplus(upcast(self.prior_theta)))
        return p0.expand(n, -1) if self.isotropic else p0[:, None].expand(n, -1, self.head_dim)

    def forward(
        self, hidden_states: Tensor, attention_mask: Tensor | None = None,
        past_key_values: RecurrentCache | None = None, use_cache: bool = False,
        cu_seqlens: Tensor | None = None, output_beta_eff: bool = False, **kwargs: object,
    ) -> tuple[Tensor, Tensor | None, RecurrentCache | None]:
        """``hidden_states [B, T, d_model]``; ``attention_mask [B, T']`` (1 = token, 0 = padding; its
        last ``T`` columns are used). Returns the output ``[B, T, d_model]``, ``beta_eff [B, T, H]``
        if asked, and the cache."""
        x = hidden_states
        B, T, _ = x.shape
        mask = current_mask(attention_mask, B, T)
        if mask is not None:
            x = x * mask[..., None].to(x.dtype)
        last = past_key_values.get(self.layer_idx) if past_key_values is not None else None
        static = getattr(past_key_values, "static", False)  # a static decoding cache: its buffers update in place
        p, conv = self.front.inputs(x, {"r": getattr(self, "r_proj", None), "omega": getattr(self, "omega_proj", None)},
                                    last["conv"] if last else None, cu_seqlens, use_cache, static=static)
        q, k, v = p["q"], p["k"], p["v"]
        decoding = T == 1 and last is not None and cu_seqlens is None
        # the KDN CUDA kernels apply KDA's gate themselves (kdn.diagonal_kdn's gate): g is then its input f;
        # without the fused kernels (fused=False) the front end's PyTorch gate makes g
        plain = decoding or mask is not None or output_beta_eff or not self.fused
        kda = None if plain else self.front.gate_input(p)
        g = kda[0] if kda is not None else self.front.log_retention(p)
        logits = self.noise != "fixed_r_omega"  # omega's softplus runs inside the Diagonal CUDA gain kernels
        omega, r = self.noise_terms(p, omega_logits=logits)
        if mask is not None:  # padded tokens are identity steps: no write, no decay, no noise
            m = mask[..., None, None]
            k = k * m
            g = g * m
            om = mask[..., None] if self.isotropic else m
            omega = omega.masked_fill(~om, float("-inf")) if logits else omega * om
        scale = self.head_dim ** -0.5
        n_seq = B if cu_seqlens is None else cu_seqlens.numel() - 1
        # a fresh sequence starts from a zero memory (None: the kernels skip it) and the learned prior
        state = last["recurrent"] if last is not None else (None, self.initial_uncertainty(n_seq))
        if decoding:  # one recurrent step
            w = F.softplus(upcast(omega[:, 0])) if logits else omega[:, 0]
            args = (q[:, 0] * scale, k[:, 0], v[:, 0], g[:, 0], w, r[:, 0])
            if static and q.is_cuda and not torch.is_grad_enabled():
                o, final = self.static_step(*args, state)
            else:
                step = api.isotropic_kdn_step if self.isotropic else api.diagonal_kdn_step
                o, final = step(*args, state, mu=self.mu(), validate=False)
            o = o[:, None]
        else:
            if self.isotropic:
                fn = partial(api.isotropic_kdn, recompute_states=self.recompute_states, precision=self.precision)
            else:
                fn = partial(api.diagonal_kdn, memory=self.memory, chunk_size=self.chunk_size,
                             recompute_states=self.recompute_states, precision=self.precision)
            o, final = fn(q, k, v, g, omega, r, mu=self.mu(), initial_state=state, scale=scale,
                          output_final_state=use_cache, cu_seqlens=cu_seqlens, backend=self.backend,
                          validate=False, omega_softplus=logits,  # valid by construction: g <= 0, r >= 0.01
                          gate=kda[1] if kda is not None else None)
        beta_eff = None
        if output_beta_eff:
            beta_eff = self.beta_eff(k, g, F.softplus(upcast(omega)) if logits else omega, r, state[1])
        if use_cache:
            if past_key_values is None:
                past_key_values = RecurrentCache()
            past_key_values.update(self.layer_idx, recurrent=final, conv=conv)
        return self.front.output(o.to(x.dtype), p), beta_eff, past_key_values

    def static_step(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, omega: Tensor, r: Tensor,
                    state: tuple[Tensor, Tensor]) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """One decoding token on CUDA for a static cache: the fused Triton step called directly (no validation, no
        autograd), the memory ``S [B,H,K,V]`` (FP32) updated in place. ``q`` (scaled), ``k``, ``g``: ``[B,H,K]``; ``v``
        ``[B,H,V]``; ``omega`` (after its softplus) and ``r`` as the step's. Returns ``o [B,H,V]`` in ``v``'s dtype and
        ``(S, new uncertainty)``."""
        from kdn.ops import fused_recurrent

        mu = self.mu()
        mu = mu.float() if isinstance(mu, Tensor) else torch.full((self.num_heads,), mu, device=q.device)
        fn = (fused_recurrent.fused_recurrent_isotropic_kdn if self.isotropic
              else fused_recurrent.fused_recurrent_diagonal_kdn)
        o, final = fn(*(x[:, None] for x in (q, k, v, g, omega, r)), mu, state, inplace=True)
        return o[:, 0].to(v.dtype), final

    def beta_eff(self, k: Tensor, g: Tensor, omega: Tensor, r: Tensor, u0: Tensor) -> Tensor:
        """Effective write strength ``k^T kappa`` per token, ``[B, T, H]`` (ignores packing)."""
        kf = upcast(k)
        if self.isotropic:
            beta, _ = api.isotropic_kdn_gain(kf, g, omega, r, mu=self.mu(), initial_state=u0)
            return beta * (kf * kf).sum(-1)
        kappa, _ = api.diagonal_kdn_gain(kf, g, omega, r, mu=self.mu(), initial_state=u0)
        return (kf * kappa).sum(-1)


class DiagonalKDN(_KalmanDelta):
    """Diagonal KDN: ``K`` uncertainty scalars per head, per-channel process noise (low-rank)."""

    isotropic = False
    Config = DiagonalKDNConfig


class IsotropicKDN(_KalmanDelta):
    """Isotropic KDN: one uncertainty scalar per head, per-head process noise."""

    isotropic = True
