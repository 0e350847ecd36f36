"""Mamba-3 (SISO and MIMO) with fla's parametrisation and a faithful PyTorch reference.

The module has exactly the parameters of ``fla.layers.Mamba3`` (names and shapes), so checkpoints
interchange. The recurrence is the one computed by mamba-ssm's kernels (``mamba3_siso_combined``,
``mamba3_mimo``) and decode step (``selective_state_update_fused_ref_v2``), per head ``h``:

* discretisation: ``dt = softplus(dd_dt + dt_bias)``, ``a = -max(softplus(dd_A), A_floor)``,
  ``alpha_t = exp(a_t dt_t)``, ``lambda_t = sigmoid(trap_t)``;
* exponential-trapezoidal update of the state ``S [N, P]``:
  ``S_t = alpha_t S_{t-1} + (1 - lambda_t) dt_t alpha_t sum_r k_{t-1,r} xv_{t-1,r}^T
  + lambda_t dt_t sum_r k_{t,r} xv_{t,r}^T``;
* data-dependent rotary angles ``theta_t = theta_{t-1} + pi tanh(angle_t) dt_t`` rotate ``q`` and ``k``
  (SISO: interleaved pairs ``(2i, 2i+1)``; MIMO: halves ``(i, i + N/2)``), on ``num_rope_angles`` pairs;
* ``q = RMSNorm(C) + C_bias``, ``k = RMSNorm(B) + B_bias`` (rank ``R`` each, shared over heads per group);
* MIMO rank ``R``: ``xv_{t,r} = x_t * mimo_x[r]``; read-out ``y_{t,r} = q_{t,r}^T S_t + D xv_{t,r}``;
  output ``sum_r y_{t,r} * mimo_o[r] * silu(z_t * mimo_z[r])`` (SISO: ``R = 1``, ``y * silu(z)``).

The decoding state is mamba-ssm's: ``(angle [B,H,A], ssm [B,H,P,N] fp32, k [B,R,H,N], v [B,H,P])``,
the last token's rotated key and value being kept for the trapezoid's next step. Padding tokens
are identity steps (``dt = 0``). On CUDA the kernels run when mamba-ssm is importable (SISO also
continues from a cached state; MIMO only starts from zero state); one-token decoding steps use PyTorch.
"""
from __future__ import annotations

import functools
import logging
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from kdn.layers import RecurrentCache
from kdn.modules import Linear
from models.layers._mamba_kernels import UNAVAILABLE, mamba3_kernels
from models.layers.common import RMSNorm, check_cu_seqlens, current_mask, last_index, repack, unpack_all

logger = logging.getLogger(__name__)
BACKENDS = ("torch", "kernels")
MIMO_KERNEL_HEAD_DIMS = (32, 64, 128)
"""Head sizes mamba-ssm tests its TileLang MIMO kernels at; at 16 its forward does not compile (a layout
conflict), so other sizes run the PyTorch reference."""
SISO_KERNEL_RULE = "head_dim <= state_size"
"""Where mamba-ssm's Triton SISO kernels are used: on an H200 their backward (``mamba3_siso_bwd_kernel_dqkv``)
made an illegal memory access at ``head_dim`` 64 with ``state_size`` 32, and matched the reference at 16 with 32
and at 64 with 64 (docs/results/mqar.md, "Mamba-3 kernels at the MQAR shapes"); wider heads run the PyTorch
reference."""
State = tuple[Tensor, Tensor, Tensor, Tensor]


@functools.cache
def _warn_fallback() -> None:
    logger.warning("Mamba-3 kernels unavailable on CUDA (%s); using the PyTorch reference", UNAVAILABLE)


@functools.cache
def _warn_head_dim(head_dim: int) -> None:
    logger.warning("Mamba-3 MIMO with head_dim %d: mamba-ssm's kernels take %s; using the PyTorch reference", head_dim,
                   MIMO_KERNEL_HEAD_DIMS)


@functools.cache
def _warn_siso_shape(head_dim: int, state_size: int) -> None:
    logger.warning("Mamba-3 SISO with head_dim %d > state_size %d: mamba-ssm's kernels take %s; using the PyTorch "
                   "reference", head_dim, state_size, SISO_KERNEL_RULE)


def rotate(x: Tensor, theta: Tensor, pairwise: bool) -> Tensor:
    """Rotate ``x [..., N]`` by ``theta [..., A]`` on ``A`` planes: pairs ``(2i, 2i+1)`` or ``(i, i + N/2)``."""
    N, A = x.shape[-1], theta.shape[-1]
    cos, sin = theta.cos(), theta.sin()
    if pairwise:
        x0, x1 = x[..., 0:2 * A:2], x[..., 1:2 * A:2]
        rot = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], -1).flatten(-2)
        return torch.cat([rot, x[..., 2 * A:]], -1)
    h = N // 2
    x0, x1 = x[..., :A], x[..., h:h + A]
    return torch.cat([x0 * cos - x1 * sin, x[..., A:h], x0 * sin + x1 * cos, x[..., h + A:]], -1)


def mamba3_scan(
    q: Tensor, k: Tensor, x: Tensor, z: Tensor, adt: Tensor, dt: Tensor, trap: Tensor, angles: Tensor,
    q_bias: Tensor, k_bias: Tensor, D: Tensor, mimo: tuple[Tensor, Tensor, Tensor] | None, *,
    chunk: int, state: State | None = None, last: Tensor | None = None,
) -> tuple[Tensor, State]:
    """Reference Mamba-3 scan, chunked (quadratic inside a chunk, state carried across chunks).

    ``q, k [B,T,R,G,N]`` (normalised C and B, before bias), ``x, z [B,T,H,P]``, ``adt, dt, trap [B,T,H]``
    (``a dt``, ``dt``, trapezoid logits), ``angles [B,T,A]`` (raw), ``q_bias, k_bias [H,R,N]``, ``D [H]``,
    ``mimo = (mimo_x, mimo_z, mimo_o)``, each ``[H,R,P]`` (``None``: SISO). ``state``: initial
    ``(angle, ssm, k, v)``; ``last [B]``: index of each row's last token (default ``T - 1``).
    Returns ``y [B,T,H,P]`` and the final state. Computes in FP32 (float64 for float64 input).
    """
    B, T, R, G, N = q.shape
    H, P = x.shape[2], x.shape[3]
    f = torch.promote_types(x.dtype, torch.float32)
    pairwise = mimo is None
    q, k, x, adt, dt = (t.to(f) for t in (q, k, x, adt, dt))
    qh = q.repeat_interleave(H // G, dim=3) + q_bias.to(f).transpose(0, 1)  # [B,T,R,H,N]
    kh = k.repeat_interleave(H // G, dim=3) + k_bias.to(f).transpose(0, 1)
    A = angles.shape[-1]
    theta0 = state[0].to(torch.float64) if state is not None else x.new_zeros(B, H, A, dtype=torch.float64)
    dtheta = torch.tanh(angles.to(f))[:, :, None, :] * math.pi * dt[..., None]  # [B,T,H,A]
    theta = (theta0[:, None] + dtheta.to(torch.float64).cumsum(1)).remainder(2 * math.pi)
    qr = rotate(qh, theta.to(f)[:, :, None], pairwise)
    kr = rotate(kh, theta.to(f)[:, :, None], pairwise)
    lam = torch.sigmoid(trap.to(f))
    gamma = dt * lam  # weight of the token's own write
    scale = gamma + F.pad((dt * (1 - lam))[:, 1:], (0, 0, 0, 1))  # + the next token's trapezoid share
    if mimo is None:
        xv = x[:, :, None]  # [B,T,1,H,P]
    else:
        xv = x[:, :, None] * mimo[0].to(f).transpose(0, 1)
    if state is None:
        S = x.new_zeros(B, H, N, P, dtype=f)
    else:
        k_prev, v_prev = state[2].to(f), state[3].to(f)
        xv_prev = v_prev[:, None] if mimo is None else v_prev[:, None] * mimo[0].to(f).transpose(0, 1)
        share = (dt[:, 0] * (1 - lam[:, 0]))[..., None, None]  # first token's share of the previous write
        S = state[1].to(f).transpose(-1, -2) + share * torch.einsum("brhn,brhp->bhnp", k_prev, xv_prev)

    pad = (-T) % chunk
    C = (T + pad) // chunk

    def split(t: Tensor) -> Tensor:  # [B, T, ...] -> [B, C, chunk, ...]
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
        return t.reshape(B, C, chunk, *t.shape[2:])

    qc, kc, xc, ac, gc, sc = map(split, (qr, kr, xv, adt, gamma, scale))

    def rows(t: Tensor) -> Tensor:  # [B, C, c, R, H, D] -> [B, C, H, c*R, D]: one row per (token, rank)
        return t.permute(0, 1, 4, 2, 3, 5).reshape(B, C, H, chunk * R, t.shape[-1])

    Qm, Km, Xm = rows(qc), rows(kc), rows(xc)
    cs = ac.cumsum(2).transpose(2, 3)  # [B,C,H,c]
    idx = torch.arange(chunk, device=x.device)
    seg = (cs[..., :, None] - cs[..., None, :]).masked_fill(idx[:, None] < idx[None, :], float("-inf"))
    own = torch.diag_embed(gc.transpose(2, 3))  # s == t: the token's own write
    weight = seg.exp() * torch.where(idx[:, None] > idx[None, :], sc.transpose(2, 3)[..., None, :], 0.0) + own
    scores = (Qm @ Km.transpose(-1, -2)).view(B, C, H, chunk, R, chunk, R) * weight[..., :, None, :, None]
    y = scores.view(B, C, H, chunk * R, chunk * R) @ Xm  # intra-chunk; rows and columns are (token, rank)
    decay_in = cs.exp().repeat_interleave(R, -1)[..., None]  # [B,C,H,cR,1]
    decay_out = ((cs[..., -1:] - cs).exp() * sc.transpose(2, 3)).repeat_interleave(R, -1)[..., None]
    # Every chunk's write, decayed to the chunk's end, in one batched product; the loop carries only the
    # [B,H,N,P] state. Slicing the [B,C,...] tensors per chunk instead would make each slice's backward write a
    # zero tensor of the whole [B,C,...] size: quadratic in the number of chunks.
    writes = (Km * decay_out).transpose(-1, -2) @ Xm  # [B,C,H,N,P]
    before = []  # the state entering each chunk
    for write, decay in zip(writes.unbind(1), cs[..., -1].exp().unbind(1)):
        before.append(S)
        S = decay[..., None, None] * S + write
    y = y + (Qm @ torch.stack(before, 1)) * decay_in  # [B,C,H,cR,P]
    y = y.reshape(B, C, H, chunk, R, P).permute(0, 1, 3, 4, 2, 5).reshape(B, C * chunk, R, H, P)[:, :T]
    y = y + D.to(f)[:, None] * xv
    if mimo is None:
        out = y[:, :, 0] * F.silu(z.to(f))
    else:
        gate = F.silu(z.to(f)[:, :, None] * mimo[1].to(f).transpose(0, 1))
        out = (y * mimo[2].to(f).transpose(0, 1) * gate).sum(2)
    batch = torch.arange(B, device=x.device)
    last = last if last is not None else torch.full((B,), T - 1, dtype=torch.long, device=x.device)
    final = (theta[:, -1].to(f), S.transpose(-1, -2).contiguous(),
             kr[batch, last].contiguous(), x[batch, last].contiguous())
    return out, final


class Mamba3(nn.Module):
    """Mamba-3 mixer (``is_mimo`` selects MIMO of rank ``mimo_rank``), parameters as ``fla.layers.Mamba3``.

    ``backend``: ``None`` (kernels on CUDA when importable, else PyTorch), ``"torch"`` or ``"kernels"``;
    ``fused``: the fused CUDA kernels of its RMSNorms.
    """

    def __init__(
        self, hidden_size: int = 2048, state_size: int = 128, expand: int = 2, head_dim: int = 64,
        n_groups: int = 1, rope_fraction: float = 0.5, dt_min: float = 0.001, dt_max: float = 0.1,
        dt_init_floor: float = 1e-4, A_floor: float = 1e-4, is_mimo: bool = False, mimo_rank: int = 4,
        chunk_size: int | None = None, norm_eps: float = 1e-5, layer_idx: int | None = None,
        backend: str | None = None, fused: bool = True,
    ) -> None:
        super().__init__()
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS} or None (auto), got {backend!r}")
        if rope_fraction not in (0.5, 1.0):
            raise ValueError(f"rope_fraction must be 0.5 or 1.0, got {rope_fraction}")
        self.hidden_size, self.state_size, self.head_dim = hidden_size, state_size, head_dim
        self.intermediate_size = int(expand * hidden_size)
        if self.intermediate_size % head_dim:
            raise ValueError(f"expand * hidden_size = {self.intermediate_size} must be divisible by head_dim "
                             f"{head_dim}; change head_dim or expand")
        self.num_heads = self.intermediate_size // head_dim
        if n_groups < 1 or self.num_heads % n_groups:
            raise ValueError(f"n_groups={n_groups} must divide the number of heads {self.num_heads}")
        self.n_groups, self.is_mimo = n_groups, is_mimo
        self.mimo_rank = mimo_rank if is_mimo else 1
        if self.mimo_rank < 1:
            raise ValueError(f"mimo_rank must be >= 1, got {mimo_rank}")
        self.chunk_size = chunk_size or (max(64 // self.mimo_rank, 8) if is_mimo else 64)
        split = int(state_size * rope_fraction)
        split -= split % 2
        self.num_rope_angles = split // 2
        if self.num_rope_angles <= 0:
            raise ValueError(f"state_size * rope_fraction = {state_size * rope_fraction} gives no rotary angle; "
                             "use a larger state_size")
        self.rotary_dim_divisor = int(2 / rope_fraction)
        self.A_floor, self.layer_idx, self.backend = A_floor, layer_idx, backend
        H, R, N = self.num_heads, self.mimo_rank, state_size
        self.in_proj = Linear(hidden_size, 2 * self.intermediate_size + 2 * N * n_groups * R + 3 * H
                              + self.num_rope_angles, bias=False)
        dt = torch.exp(torch.rand(H) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = dt.clamp(min=dt_init_floor)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.dt_bias._no_weight_decay = True
        self.B_bias = nn.Parameter(torch.ones(H, R, N))
        self.C_bias = nn.Parameter(torch.ones(H, R, N))
        self.B_norm = RMSNorm(N, eps=norm_eps, fused=fused)
        self.C_norm = RMSNorm(N, eps=norm_eps, fused=fused)
        if is_mimo:
            self.mimo_x = nn.Parameter(torch.ones(H, R, head_dim) / R)
            self.mimo_z = nn.Parameter(torch.ones(H, R, head_dim))
            self.mimo_o = nn.Parameter(torch.ones(H, R, head_dim) / R)
        self.D = nn.Parameter(torch.ones(H))
        self.D._no_weight_decay = True
        self.out_proj = Linear(self.intermediate_size, hidden_size, bias=False)

    def _project(self, x: Tensor) -> dict[str, Tensor]:
        """Split ``in_proj(x)``: ``z, x [B,T,H,P]``, normalised ``k`` (B) and ``q`` (C) ``[B,T,R,G,N]``,
        ``adt, dt [B,T,H]`` (FP32), raw ``trap [B,T,H]`` and ``angles [B,T,A]``."""
        B, T = x.shape[:2]
        H, P, N, R, G = self.num_heads, self.head_dim, self.state_size, self.mimo_rank, self.n_groups
        z, xv, Bm, Cm, dd_dt, dd_A, trap, angles = torch.split(
            self.in_proj(x), [self.intermediate_size] * 2 + [N * G * R] * 2 + [H] * 3 + [self.num_rope_angles], -1)
        f = torch.promote_types(x.dtype, torch.float32)
        a = (-F.softplus(dd_A.to(f))).clamp(max=-self.A_floor)
        dt = F.softplus(dd_dt.to(f) + self.dt_bias.to(f))
        return {
            "z": z.reshape(B, T, H, P), "x": xv.reshape(B, T, H, P),
            "k": self.B_norm(Bm.reshape(B, T, R, G, N)), "q": self.C_norm(Cm.reshape(B, T, R, G, N)),
            "adt": a * dt, "dt": dt, "trap": trap, "angles": angles,
        }

    def _use_kernels(self, device: torch.device, has_state: bool, T: int) -> bool:
        if self.backend == "torch" or device.type != "cuda":
            if self.backend == "kernels":
                raise ValueError("backend='kernels' needs CUDA tensors; use backend='torch'")
            return False
        if self.is_mimo and self.head_dim not in MIMO_KERNEL_HEAD_DIMS:
            if self.backend == "kernels":
                raise ValueError(f"mamba-ssm's MIMO kernels take head_dim in {MIMO_KERNEL_HEAD_DIMS}, got "
                                 f"{self.head_dim}; use one of those or backend='torch'")
            _warn_head_dim(self.head_dim)
            return False
        if not self.is_mimo and self.head_dim > self.state_size:
            if self.backend == "kernels":
                raise ValueError(f"mamba-ssm's SISO kernels take {SISO_KERNEL_RULE}, got head_dim {self.head_dim} and "
                                 f"state_size {self.state_size}; use such a shape or backend='torch'")
            _warn_siso_shape(self.head_dim, self.state_size)
            return False
        siso, mimo = mamba3_kernels()
        kernel = mimo if self.is_mimo else siso
        if kernel is None:
            if self.backend == "kernels":
                raise ValueError(f"backend='kernels' but the mamba-ssm kernel is unavailable: {UNAVAILABLE}")
            _warn_fallback()
            return False
        # the MIMO kernel cannot start from a cached state; one-token decoding steps are cheap in PyTorch
        return T > 1 and not (self.is_mimo and has_state)

    def forward(
        self, hidden_states: Tensor, attention_mask: Tensor | None = None,
        past_key_values: RecurrentCache | None = None, use_cache: bool = False,
        cu_seqlens: Tensor | None = None, output_beta_eff: bool = False, **kwargs: object,
    ) -> tuple[Tensor, None, RecurrentCache | None]:
        """``hidden_states [B, T, d]`` -> ``(o [B, T, d], None, cache)``."""
        x = hidden_states
        B, T, _ = x.shape
        mask = current_mask(attention_mask, B, T)
        if cu_seqlens is not None:
            check_cu_seqlens(cu_seqlens, T, B)
        if mask is not None:
            x = x * mask[..., None].to(x.dtype)
        p = self._project(x)
        if mask is not None:  # padding: dt = 0 makes the step an identity (no decay, write or rotation)
            p["dt"] = p["dt"] * mask[..., None]
            p["adt"] = p["adt"] * mask[..., None]
        last = past_key_values.get(self.layer_idx) if past_key_values is not None else None
        state = last["recurrent"] if last is not None else None
        # a packed prefill for decoding (cu_seqlens with a cache) takes the reference, whose per-sequence final
        # states the CPU tests check against token-by-token decoding
        packed_prefill = cu_seqlens is not None and use_cache
        if not packed_prefill and self._use_kernels(x.device, state is not None, T):
            y, final = self._kernel_forward(p, state, use_cache, cu_seqlens)
        else:
            with torch.autocast(x.device.type, enabled=False):  # the reference runs in FP32 even under autocast
                y, final = self._torch_forward(p, state, cu_seqlens)
        if use_cache:
            if past_key_values is None:
                past_key_values = RecurrentCache()
            past_key_values.update(self.layer_idx, recurrent=final)
        return self.out_proj(y.reshape(B, T, -1).to(x.dtype)), None, past_key_values

    def _mimo_params(self) -> tuple[Tensor, Tensor, Tensor] | None:
        return (self.mimo_x, self.mimo_z, self.mimo_o) if self.is_mimo else None

    def _torch_forward(self, p: dict[str, Tensor], state: State | None, cu_seqlens: Tensor | None
                       ) -> tuple[Tensor, State]:
        names = ("q", "k", "x", "z", "adt", "dt", "trap", "angles")
        xs = unpack_all([p[n] for n in names], [0.0] * len(names), cu_seqlens)
        B, T = xs[2].shape[:2]
        y, final = mamba3_scan(*xs, self.C_bias, self.B_bias, self.D, self._mimo_params(),
                               chunk=min(self.chunk_size, T), state=state,
                               last=last_index(B, T, cu_seqlens, xs[2].device))
        return (repack(y, cu_seqlens) if cu_seqlens is not None else y), final

    def _kernel_forward(self, p: dict[str, Tensor], state: State | None, use_cache: bool,
                        cu_seqlens: Tensor | None) -> tuple[Tensor, State | None]:
        siso, mimo = mamba3_kernels()
        H = self.num_heads
        common = {
            "V": p["x"], "ADT": p["adt"].transpose(1, 2).contiguous(), "DT": p["dt"].transpose(1, 2).contiguous(),
            "Trap": p["trap"].transpose(1, 2).contiguous(), "D": self.D, "Z": p["z"], "chunk_size": self.chunk_size,
            "Angles": p["angles"][:, :, None].expand(-1, -1, H, -1).float().contiguous(),
            "cu_seqlens": None if cu_seqlens is None else cu_seqlens.to(torch.int32),
        }
        if self.is_mimo:
            # TileLang's MIMO kernels take these parameters in FP32 only: a layer cast to BF16 passes FP32 copies
            # (`.float()` is the parameter itself in an FP32 layer)
            f32 = {"Q_bias": self.C_bias, "K_bias": self.B_bias, "D": self.D, "MIMO_V": self.mimo_x,
                   "MIMO_Z": self.mimo_z, "MIMO_Out": self.mimo_o}
            out = mimo(Q=p["q"], K=p["k"], **{**common, **{k: v.float() for k, v in f32.items()}},
                       rotary_dim_divisor=self.rotary_dim_divisor, dtype=p["x"].dtype, return_state=use_cache)
            return (out[0], tuple(out[1:5])) if use_cache else (out, None)
        states = None if state is None else (state[0], state[1], state[2][:, 0].contiguous(), state[3])
        out = siso(Q=p["q"][:, :, 0], K=p["k"][:, :, 0], Q_bias=self.C_bias[:, 0], K_bias=self.B_bias[:, 0],
                   Input_States=states, return_final_states=use_cache, **common)
        if not use_cache:
            return out, None
        y, angle, ssm, k, v = out
        return y, (angle, ssm, k[:, None], v)
