"""The front end shared by KDN and the delta-rule mixers (docs/math.md §5, KDA's parametrisation).

Projections, the width-4 causal depthwise convolution with SiLU, the per-channel retention gate, and the
sigmoid-gated RMSNorm output. The PyTorch code runs on every device and handles padding masks, packed sequences
(``cu_seqlens``) and a decoding cache of the last ``W - 1`` inputs. On CUDA the same operations run through fused
Triton kernels, ours (in training the three short convs with the L2 norms of ``q`` and ``k``, :mod:`kdn.modules.conv`;
the pre-norm residual add + RMSNorm, :mod:`kdn.modules.norm`) and fla's (short conv and L2 norm with a decoding
cache, KDA gate, gated RMSNorm), each one pass forward and one backward; every module takes ``fused`` (default
``True``), and ``fused=False`` runs the PyTorch code on CUDA too (the GPU tests compare both). Every projection is a
:class:`Linear`: under autocast its weight gradients leave the GEMM in FP32 (:func:`linear`).

fla's short convolution (the decoding prefill, and widths other than 4) dispatches to its Gluon kernels when the
environment sets ``FLA_CONV_GLUON=1`` (fla's default is off; this package does not set it).
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from contextvars import ContextVar

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from kdn.ops.gate import kda_gate
from kdn.ops.utils import fla_fused, upcast

__all__ = ["kda_gate", "fla_fused", "upcast"]  # re-exported with the modules


def inv_softplus(y: Tensor | float) -> Tensor:
    """The ``x`` with ``softplus(x) = y`` (``y > 0``)."""
    y = torch.as_tensor(y, dtype=torch.float32)
    return y + torch.log(-torch.expm1(-y))


L2_EPS = 1e-12  # under the root of the L2 norm of q and k (fla's l2norm; the CPU path clamps the norm at it)


# fla's row-wise norm kernels (l2norm, the gated RMSNorm) key their autotuning on a call's rows in buckets of 65,536,
# so every new batch x length of an evaluation's packed prefill tuned them again (10-15 s each; 211 s of the RULER
# grid's 415 s on an H200). Calls without gradients run in pieces of at most that many rows and tune once; training's
# fixed shapes tune once anyway and keep one call.
NORM_ROWS = 65536


def by_rows(fn: Callable[..., Tensor], *xs: Tensor, rows: int = NORM_ROWS) -> Tensor:
    """``fn(*xs)`` for a row-wise ``fn`` of tensors ``[..., D]`` of one shape, run on pieces of at most ``rows`` rows
    when no gradient is needed (one call otherwise, or when they fit). Returns ``fn``'s output, shaped as ``xs[0]``."""
    x = xs[0]
    n = x.numel() // x.shape[-1]
    if n <= rows or (torch.is_grad_enabled() and any(t.requires_grad for t in xs)):
        return fn(*xs)
    flat = [t.reshape(n, t.shape[-1]) for t in xs]
    return torch.cat([fn(*(t[i:i + rows] for t in flat)) for i in range(0, n, rows)]).view(x.shape)


def l2_normalize(x: Tensor, fused: bool = True) -> Tensor:
    """``x / ||x||`` over the last dimension, computed in at least FP32, returned in ``x``'s dtype (fla's kernel on
    CUDA when ``fused``, by :func:`by_rows`)."""
    if fla_fused(x, fused):
        from kdn.ops.fla_internals import l2norm

        return by_rows(lambda t: l2norm(t, eps=L2_EPS), x)
    return F.normalize(upcast(x), dim=-1).to(x.dtype)


def current_mask(attention_mask: Tensor | None, B: int, T: int) -> Tensor | None:
    """The boolean mask of the current ``T`` tokens, ``[B, T]``, or ``None`` when every token is real.

    ``attention_mask [B, T']`` holds 1 for tokens and 0 for padding; its last ``T`` columns describe the
    current tokens (during cached decoding it covers past and current tokens).
    """
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2 or attention_mask.shape[0] != B or attention_mask.shape[1] < T:
        raise ValueError(
            f"attention_mask must be [B, >=T] = [{B}, >={T}] of 0/1, got {list(attention_mask.shape)}")
    return attention_mask[:, -T:].to(torch.bool)


def positions_in_sequence(B: int, T: int, cu_seqlens: Tensor | None, device: torch.device) -> Tensor:
    """Index of each token inside its own sequence, ``[B, T]`` (packed: resets at each offset)."""
    pos = torch.arange(T, device=device).expand(B, T)
    if cu_seqlens is None:
        return pos
    starts = cu_seqlens[:-1].to(device)
    seq_id = torch.searchsorted(cu_seqlens[1:].to(device), torch.arange(T, device=device), right=True)
    return (pos[0] - starts[seq_id]).expand(B, T)


def packed_conv_state(x: Tensor, cu_seqlens: Tensor, W: int) -> Tensor:
    """The decoding cache of each packed sequence of ``x [1, T, D]``: its last ``W - 1`` inputs, zeros before its
    first token, ``[N, D, W - 1]``."""
    ends = cu_seqlens[1:].to(x.device)
    idx = ends[:, None] - (W - 1) + torch.arange(W - 1, device=x.device)  # [N, W-1]
    inside = idx >= cu_seqlens[:-1].to(x.device)[:, None]
    return (x[0, idx.clamp(min=0)] * inside[..., None].to(x.dtype)).transpose(1, 2).contiguous()


class ShortConv(nn.Conv1d):
    """Causal depthwise conv (width ``W``) + SiLU over ``[B, T, D]``; weights as fla's ``[D, 1, W]``.

    ``cache [B, D, W-1]`` holds the previous inputs for decoding; packed sequences never see across
    their boundaries. ``fused``: fla's kernel on CUDA.
    """

    def __init__(self, dim: int, kernel_size: int = 4, *, fused: bool = True) -> None:
        super().__init__(dim, dim, kernel_size, groups=dim, bias=False, padding=0)
        self.fused = fused

    def forward(  # type: ignore[override]
        self, x: Tensor, cache: Tensor | None = None, cu_seqlens: Tensor | None = None,
        output_final_state: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        B, T, D = x.shape
        W = self.kernel_size[0]
        if cache is None and fla_fused(x, self.fused):
            from kdn.ops.fla_internals import causal_conv1d

            y, _ = causal_conv1d(x, self.weight[:, 0, :].to(x.dtype), activation="silu", cu_seqlens=cu_seqlens)
            new_cache = None
            if output_final_state:  # the last W - 1 inputs, zeros before the start
                new_cache = F.pad(x[:, -(W - 1):], (0, 0, max(W - 1 - T, 0), 0)).transpose(1, 2).contiguous()
                if cu_seqlens is not None:
                    new_cache = packed_conv_state(x, cu_seqlens, W)
            return y, new_cache
        hist = cache.transpose(1, 2).to(x.dtype) if cache is not None else x.new_zeros(B, W - 1, D)
        xx = torch.cat([hist, x], 1)  # [B, W-1+T, D]
        w = self.weight[:, 0, :]  # [D, W]; w[:, W-1] multiplies the current token
        if cu_seqlens is None:
            y = F.conv1d(xx.transpose(1, 2), self.weight, groups=D).transpose(1, 2)
        else:
            pos = positions_in_sequence(B, T, cu_seqlens, x.device)
            y = x * w[:, W - 1]
            for lag in range(1, W):
                y = y + xx[:, W - 1 - lag: W - 1 - lag + T] * w[:, W - 1 - lag] * (pos >= lag)[..., None]
        new_cache = None
        if output_final_state:
            new_cache = (xx[:, -(W - 1):].transpose(1, 2).contiguous() if cu_seqlens is None
                         else packed_conv_state(x, cu_seqlens, W))
        return F.silu(y), new_cache


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension ``x [..., D]``, computed in at least FP32; ``fused``: fused kernels on CUDA."""

    def __init__(self, dim: int, eps: float = 1e-5, *, fused: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.fused = eps, fused

    def normed(self, x: Tensor) -> Tensor:
        """The normalised, weighted ``x`` in the compute dtype (not cast back)."""
        xf = upcast(x)
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * upcast(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        if fla_fused(x, self.fused):
            from kdn.ops.fla_internals import rms_norm

            return rms_norm(x, self.weight, None, eps=self.eps)
        return self.normed(x).to(x.dtype)

    def add_norm(self, x: Tensor, residual: Tensor | None) -> tuple[Tensor, Tensor]:
        """A pre-norm residual step: ``residual' = residual + x`` (``x`` alone when ``residual`` is ``None``),
        kept in at least FP32, and ``RMSNorm(residual')`` in ``x``'s dtype. ``x, residual: [..., D]``; returns
        ``(normed, residual')``. Under autocast ``x`` (a sublayer's output) is bf16, so the sublayers read bf16
        and the stream stays FP32; on CUDA the add and the norm are one fused pass each way
        (:func:`kdn.modules.norm.add_rms_norm`)."""
        if fla_fused(x, self.fused):
            from kdn.modules.norm import add_rms_norm

            return add_rms_norm(x, residual, self.weight, self.eps)
        res = upcast(x) if residual is None else residual + x
        return self.normed(res).to(x.dtype), res


class GatedRMSNorm(RMSNorm):
    """Per-head RMSNorm whose output is multiplied by ``act(gate)``; ``x, gate: [..., D]``.

    ``activation``: ``"sigmoid"`` (KDA, KDN) or ``"swish"`` (Gated DeltaNet's output gate).
    """

    def __init__(self, dim: int, eps: float = 1e-5, activation: str = "sigmoid", *, fused: bool = True) -> None:
        super().__init__(dim, eps, fused=fused)
        if activation not in ("sigmoid", "swish"):
            raise ValueError(f"activation must be 'sigmoid' or 'swish', got {activation!r}")
        self.activation = activation

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:  # type: ignore[override]
        if fla_fused(x, self.fused):
            from kdn.ops.fla_internals import rms_norm_gated

            return by_rows(lambda a, b: rms_norm_gated(a, b, self.weight, None, activation=self.activation,
                                                       eps=self.eps), x, gate)
        act = torch.sigmoid if self.activation == "sigmoid" else F.silu
        return (self.normed(x) * act(upcast(gate))).to(x.dtype)


def _stack(weights: list[Tensor] | tuple[Tensor, ...], dtype: torch.dtype, pad: int) -> Tensor:
    """``cat(weights)`` in ``dtype`` with ``pad`` rows of zeros below: ``[sum n_i + pad, d]``."""
    ws = [m.to(dtype) for m in weights]
    if pad:
        ws.append(ws[0].new_zeros(pad, ws[0].shape[1]))
    return torch.cat(ws) if len(ws) > 1 else ws[0]


def _zeros_after(bias: Tensor | None, pad: int) -> Tensor | None:
    """``bias`` with ``pad`` zeros appended (``None`` stays ``None``)."""
    return F.pad(bias, (0, pad)) if pad and bias is not None else bias


class _AutocastLinear(torch.autograd.Function):
    """``(x, bias | None, pad, *weights) -> x @ cat(weights, zeros(pad))^T + bias`` under autocast, FP32 weights and
    bias (padded with ``pad`` zeros).

    The weights are cast to the autocast dtype and stacked (``[N, d]``), and the output and the input gradient come
    from GEMMs in that dtype, as autocast's ``F.linear`` would compute them. The weight gradients leave their GEMM in
    FP32 (``torch.mm(..., out_dtype=float32)`` on CUDA), where autocast's path rounds them to bf16 and a separate
    pass casts them back to the weights' FP32: one pass over every weight gradient fewer, and no rounding.
    """

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, bias: Tensor | None, pad: int,
                *weights: Tensor) -> Tensor:
        dt = torch.get_autocast_dtype(x.device.type)
        key = (dt, pad, *(id(m) for m in weights))
        casts = _CAST_CACHE.get()
        w = casts.get(key) if casts is not None else None
        if w is None:
            w = _stack(weights, dt, pad)
            if casts is not None:
                casts[key] = w
        x = x.to(dt)
        ctx.save_for_backward(x, w)
        ctx.splits = [m.shape[0] for m in weights]
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x, w, _zeros_after(None if bias is None else bias.to(dt), pad))

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, dy: Tensor) -> tuple[Tensor | None, ...]:
        x, w = ctx.saved_tensors
        dy = dy.to(w.dtype)
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        n = sum(ctx.splits)  # the padding's columns (past n) have no parameters to give gradients to
        with torch.autocast(x.device.type, enabled=False):
            dx = dy @ w if ctx.needs_input_grad[0] else None
            db = dy2[:, :n].sum(0, dtype=torch.float32) if ctx.needs_input_grad[1] else None  # False without a bias
            if not any(ctx.needs_input_grad[3:]):
                return dx, db, None, *(None for _ in ctx.splits)
            if dy.is_cuda:
                dw = torch.mm(dy2.t(), x2, out_dtype=torch.float32)
            else:  # no mixed-dtype GEMM here: the same FP32 result from upcast operands
                dw = dy2.t().float() @ x2.float()
        return dx, db, None, *dw[:n].split(ctx.splits)


# The casts of the innermost cached_weight_casts() around the caller (None outside any): scoped to the context, so
# that no thread or task sees another's casts, and left as it was on exit
_CAST_CACHE: ContextVar[dict[tuple, Tensor] | None] = ContextVar("cast_cache", default=None)
# The front end's joint projection is padded to a multiple of 8 columns (16 bytes of bf16): cuBLAS runs a GEMM whose
# rows are not 16-byte aligned on Ampere's CUTLASS kernels ("align2") instead of Hopper's. With 18 heads (the 1.3B
# models: 7,314 columns, the per-head r among them) each such GEMM took 2.1-2.3 ms on an H200, three per layer.
JOINT_MULTIPLE = 8


@contextlib.contextmanager
def cached_weight_casts() -> Iterator[None]:
    """Inside, :func:`linear` casts (and stacks) each set of FP32 weights to the autocast dtype once and reuses the
    result, instead of once per call: ``train.py`` wraps one optimiser step's micro-batches, which all read the same
    weights. The weights must not change inside (the optimiser steps outside); leaving drops the casts."""
    token = _CAST_CACHE.set({})
    try:
        yield
    finally:
        _CAST_CACHE.reset(token)


def aligned_width(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (a positive int)."""
    if multiple < 1:
        raise ValueError(f"multiple must be a positive number of columns, got {multiple}")
    return -(-n // multiple) * multiple


def linear(x: Tensor, weights: Tensor | list[Tensor], bias: Tensor | None = None, *, multiple: int = 1) -> Tensor:
    """``x @ cat(weights)^T + bias``: ``x [..., d]``, weights ``[n_i, d]``, ``bias [sum n_i]`` -> ``[..., N]``,
    ``N = sum n_i`` rounded up to ``multiple`` (the columns past ``sum n_i`` are zeros, their gradient ignored).

    Under autocast with FP32 weights (single-device and DDP training) this is :class:`_AutocastLinear`, whose weight
    gradients come out of the GEMM in FP32; otherwise (FP32 runs, bf16 parameters under FSDP2's mixed precision)
    ``F.linear`` on the stacked weights. Either way one GEMM each for the output, the input gradient and the weight
    gradient of all the stacked weights."""
    ws = [weights] if isinstance(weights, Tensor) else list(weights)
    n = sum(w.shape[0] for w in ws)
    pad = aligned_width(n, multiple) - n
    if torch.is_autocast_enabled(x.device.type) and all(w.dtype == torch.float32 for w in ws) and (
            bias is None or bias.dtype == torch.float32):
        return _AutocastLinear.apply(x, bias, pad, *ws)
    return F.linear(x, _stack(ws, ws[0].dtype, pad), _zeros_after(bias, pad))


def stacked_weights(owner: nn.Module, weights: list[Tensor], x: Tensor, multiple: int = 1) -> Tensor:
    """``cat(weights)`` ``[N, d]`` (``N``: ``sum n_i`` rounded up to ``multiple``, zero rows below) in the dtype
    :func:`linear` computes ``x``'s product in, kept on ``owner`` between calls (decoding steps, and the CUDA graphs
    that replay them, read it) while no weight changes: the key holds each weight's address and version counter,
    which every in-place update (an optimiser step, ``load_state_dict``) advances. Without it every decoding step
    copies these weights before its GEMM. For inference (no autograd); it holds one copy of the weights on
    ``owner``."""
    amp = torch.is_autocast_enabled(x.device.type) and all(w.dtype == torch.float32 for w in weights)
    dtype = torch.get_autocast_dtype(x.device.type) if amp else weights[0].dtype
    n = sum(w.shape[0] for w in weights)
    key = (dtype, multiple, *((w.data_ptr(), w._version) for w in weights))
    cached = owner.__dict__.get("_stacked_weights")
    if cached is None or cached[0] != key:
        cached = (key, _stack(weights, dtype, aligned_width(n, multiple) - n))
        owner.__dict__["_stacked_weights"] = cached
    return cached[1]


class Linear(nn.Linear):
    """``nn.Linear`` computed through :func:`linear` (FP32 weight gradients under autocast)."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


def low_rank(d_in: int, rank: int, d_out: int, bias: bool = False) -> nn.Sequential:
    """``d_in -> rank -> d_out`` linear bottleneck (no nonlinearity), as KDA's gate projections."""
    return nn.Sequential(Linear(d_in, rank, bias=False), Linear(rank, d_out, bias=bias))


def input_stage(proj: nn.Module) -> nn.Linear:
    """The linear that reads the layer input: ``proj`` itself, or a :func:`low_rank`'s first stage."""
    return proj[0] if isinstance(proj, nn.Sequential) else proj


def finish(proj: nn.Module, y: Tensor) -> Tensor:
    """``proj(x)`` from ``y = input_stage(proj)(x)``: the rest of a :func:`low_rank`, else ``y``. ``y`` (a view of
    :func:`split_outputs`' joint output) is made contiguous first, so that a biased stage is one GEMM with the bias
    in its epilogue: on a strided 3-D input, ``F.linear`` adds the bias in a separate pass over the output."""
    return proj[1:](y.contiguous()) if isinstance(proj, nn.Sequential) else y


def split_outputs(y: Tensor, layers: dict[str, nn.Linear]) -> dict[str, Tensor]:
    """``{name: layer(x)}`` from ``y = linear(x, [m.weight for m in layers.values()])``, the joint output
    ``[..., sum out_features]`` of one matmul over the stacked weights (``x`` is read once, and its gradient is one
    GEMM instead of one per layer plus the adds that sum them): views, or for a layer with a bias, that view plus its
    bias (in ``y``'s dtype). The biases are added per layer, not in the joint GEMM: there a bias gradient would be a
    reduction over every column of the joint output, zeros included (the biased layers here are narrow: KDN's
    per-head noise projections). Columns of ``y`` past the layers' widths (:func:`linear`'s alignment) are left
    out."""
    widths = [m.out_features for m in layers.values()]
    out = dict(zip(layers, y.split([*widths, y.shape[-1] - sum(widths)], -1)))
    for name, m in layers.items():
        if m.bias is not None:
            out[name] = out[name] + m.bias.to(y.dtype)
    return out


def retention_init(num_heads: int, gate_dim: int) -> tuple[Tensor, Tensor]:
    """KDA's initial retention: ``A [H] ~ U(1, 16)`` per head and ``dt [gate_dim]`` log-uniform in ``[1e-3, 0.1]`` per
    channel (or head), drawn in that order, so that both parametrisations below start from one draw."""
    A = torch.empty(num_heads).uniform_(1, 16)
    dt = torch.exp(torch.rand(gate_dim) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
    return A, dt


def _no_decay(x: Tensor) -> nn.Parameter:
    param = nn.Parameter(x)
    param._no_weight_decay = True
    return param


def kda_retention(num_heads: int, gate_dim: int) -> dict[str, nn.Parameter]:
    """``{"A_log": [H], "dt_bias": [gate_dim]}`` of ``g = -exp(A_log) softplus(f(x) + dt_bias)`` (no weight decay)."""
    A, dt = retention_init(num_heads, gate_dim)
    return {"A_log": _no_decay(torch.log(A)), "dt_bias": _no_decay(inv_softplus(dt))}


def sigmoid_retention(num_heads: int, gate_dim: int) -> dict[str, nn.Parameter]:
    """``{"gate_bias": [gate_dim]}`` of ``g = logsigmoid(f(x) + gate_bias)``, starting at KDA's retention
    ``alpha_0 = exp(-A_h dt_c)`` (no weight decay)."""
    A, dt = retention_init(num_heads, gate_dim)
    alpha0 = torch.exp(-A.repeat_interleave(gate_dim // num_heads) * dt).clamp(1e-4, 1 - 1e-4)
    return {"gate_bias": _no_decay(torch.logit(alpha0))}


RETENTION_KEYS = {"kda": ("A_log", "dt_bias"), "sigmoid": ("gate_bias",)}


class DeltaFrontEnd(nn.Module):
    """What a delta-rule mixer does around its memory, on the modules the mixer's layer declares and passes in.

    Shapes: input ``x [B, T, d_model]``; ``q, k, g: [B, T, H, K]``; ``v: [B, T, H, V]``. The modules, each as its
    layer builds it: ``q_proj, k_proj [H*K, d]``, ``v_proj [H*V, d]`` and their :class:`ShortConv` s; the retention
    gate ``gate`` (``"channel"``: ``f_proj`` a :func:`low_rank` ``d -> V -> H*K``; ``"head"``: a ``[H, d]``
    :class:`Linear`; ``"none"``: no ``f_proj``, no decay) with ``alpha_param`` ``"kda"`` (``A_log [H]``,
    ``dt_bias``: :func:`kda_retention`) or ``"sigmoid"`` (``gate_bias``: :func:`sigmoid_retention`); the output gate
    ``g_proj`` (``None``: ``o_norm`` is a plain RMSNorm) and ``o_norm`` per head, then ``o_proj [d, H*V]``. They are
    registered in that order (the state dict's keys and order). ``fused``: the fused CUDA kernels (ours and fla's) for
    the convolutions, L2 norms, gate and norm; ``False``: PyTorch everywhere.
    """

    def __init__(
        self, num_heads: int, head_dim: int, value_dim: int, *, q_proj: nn.Linear, k_proj: nn.Linear,
        v_proj: nn.Linear, q_conv1d: ShortConv, k_conv1d: ShortConv, v_conv1d: ShortConv, f_proj: nn.Module | None,
        retention: dict[str, nn.Parameter], g_proj: nn.Module | None, o_norm: nn.Module, o_proj: nn.Linear,
        alpha_param: str = "kda", gate: str = "channel", fused: bool = True,
    ) -> None:
        super().__init__()
        if alpha_param not in RETENTION_KEYS:
            raise ValueError(f"alpha_param must be 'kda' or 'sigmoid', got {alpha_param!r}")
        if gate not in ("channel", "head", "none"):
            raise ValueError(f"gate must be 'channel', 'head' or 'none', got {gate!r}")
        want = RETENTION_KEYS[alpha_param] if gate != "none" else ()
        if tuple(retention) != want or (f_proj is None) != (gate == "none"):
            raise ValueError(f"gate={gate!r}, alpha_param={alpha_param!r} takes " + (
                f"f_proj and retention parameters {', '.join(want)}" if want else "no f_proj and no retention")
                + f", got f_proj={type(f_proj).__name__} and {', '.join(retention) or 'no retention'}")
        self.H, self.K, self.V = num_heads, head_dim, value_dim
        self.alpha_param, self.gate, self.fused = alpha_param, gate, fused
        self.q_proj, self.k_proj, self.v_proj = q_proj, k_proj, v_proj
        self.q_conv1d, self.k_conv1d, self.v_conv1d = q_conv1d, k_conv1d, v_conv1d
        self.f_proj = f_proj
        for name, param in retention.items():
            self.register_parameter(name, param)
        self.g_proj, self.o_norm, self.o_proj = g_proj, o_norm, o_proj

    def inputs(
        self, x: Tensor, extra: dict[str, nn.Module | None] | None = None,
        conv_state: tuple[Tensor, Tensor, Tensor] | None = None, cu_seqlens: Tensor | None = None,
        use_cache: bool = False, static: bool = False,
    ) -> tuple[dict[str, Tensor], tuple | None]:
        """Every projection of the layer input ``x [B, T, d_model]`` from one matmul (:func:`split_outputs`), with
        ``q, k, v`` through their short convs: ``(p, conv cache)``. ``p`` maps ``q, k [B, T, H, K]`` (L2-normalised,
        ``q`` not scaled), ``v [B, T, H, V]``, the retention gate's ``f`` and the output gate's ``g`` (first stage when
        low-rank) and the mixer's ``extra`` projections (``None`` skipped; :func:`finish` completes a low-rank one)
        to ``[B, T, width]``. The cache (``use_cache``) holds each stream's last inputs. On CUDA in training
        (no cache, width-4 convolutions), the convolutions read the joint projection and write its gradient in one
        fused pass each way (:func:`kdn.modules.conv.front_conv`). Decoding one token on CUDA without autograd, one
        kernel makes ``q, k, v`` and advances the conv windows (:func:`kdn.modules.conv.front_conv_step`): in place
        when ``static`` (the buffers of a static decoding cache), else in copies."""
        layers = {"q": self.q_proj, "k": self.k_proj, "v": self.v_proj}
        if self.gate != "none":
            layers["f"] = input_stage(self.f_proj)
        if self.g_proj is not None:
            layers["g"] = input_stage(self.g_proj)
        layers.update({n: input_stage(m) for n, m in (extra or {}).items() if m is not None})
        B, T = x.shape[:2]
        step = T == 1 and conv_state is not None and cu_seqlens is None and not torch.is_grad_enabled()
        ws = [m.weight for m in layers.values()]
        y = linear(x, stacked_weights(self, ws, x, JOINT_MULTIPLE) if step else ws, multiple=JOINT_MULTIPLE)
        fusable = self.q_conv1d.kernel_size[0] == 4 and fla_fused(y, self.fused)
        if conv_state is None and not use_cache and fusable:
            from kdn.modules.conv import front_conv

            q, k, v, rest = front_conv(y, self._conv_weight(), self.H, self.K, self.V, L2_EPS, cu_seqlens)
            p = split_outputs(rest, {n: m for n, m in layers.items() if n not in ("q", "k", "v")})
            p.update(q=q, k=k, v=v)
            return p, None
        p = split_outputs(y, layers)
        if step and fusable:
            from kdn.modules.conv import front_conv_step

            state = conv_state if static else tuple(c.clone(memory_format=torch.contiguous_format)
                                                    for c in conv_state)
            q, k, v = front_conv_step(y, self._conv_weight(), state, self.H, self.K, self.V, L2_EPS)
            p.update(q=q, k=k, v=v)
            return p, (state if use_cache else None)
        cq, ck, cv = conv_state if conv_state is not None else (None, None, None)
        q, cq = self.q_conv1d(p["q"], cq, cu_seqlens, use_cache)
        k, ck = self.k_conv1d(p["k"], ck, cu_seqlens, use_cache)
        v, cv = self.v_conv1d(p["v"], cv, cu_seqlens, use_cache)
        p.update(q=l2_normalize(q.view(B, T, self.H, self.K), self.fused),
                 k=l2_normalize(k.view(B, T, self.H, self.K), self.fused),
                 v=v.view(B, T, self.H, self.V))
        return p, ((cq, ck, cv) if use_cache else None)

    def _conv_weight(self) -> Tensor:
        """The taps of the ``q, k, v`` convolutions, ``[2HK + HV, W]``."""
        return torch.cat([c.weight[:, 0] for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)])

    def gate_input(self, p: dict[str, Tensor]) -> tuple[Tensor, tuple[Tensor, Tensor]] | None:
        """With KDA's per-channel gate, its input ``f [B, T, H, K]`` and ``(A_log [H], dt_bias [H*K])``, for kernels
        that apply :func:`kda_gate` themselves; ``None`` for the other gates (use :meth:`log_retention`)."""
        if self.alpha_param != "kda" or self.gate != "channel":
            return None
        f = finish(self.f_proj, p["f"])
        return f.view(*f.shape[:2], self.H, self.K), (self.A_log, self.dt_bias)

    def log_retention(self, p: dict[str, Tensor]) -> Tensor:
        """``g = log(alpha) <= 0`` from the projections ``p``: ``[B, T, H, K]`` (per channel) or ``[B, T, H]``
        (per head)."""
        kda = self.gate_input(p)
        if kda is not None:
            return kda_gate(kda[0], *kda[1], fused=self.fused)
        f = upcast(finish(self.f_proj, p["f"]))
        B, T = f.shape[:2]
        if self.alpha_param == "kda":
            g = -upcast(self.A_log).exp().repeat_interleave(f.shape[-1] // self.H) * F.softplus(f + self.dt_bias)
        else:
            g = F.logsigmoid(f + self.gate_bias)
        return g.view(B, T, self.H, -1).squeeze(-1) if self.gate == "head" else g.view(B, T, self.H, self.K)

    def output(self, o: Tensor, p: dict[str, Tensor]) -> Tensor:
        """RMSNorm per head, gated by ``g_proj``'s output when there is one, then the output projection.
        ``o: [B, T, H, V]`` -> ``[B, T, d_model]``; ``p``: the projections of the layer input (:meth:`inputs`)."""
        B, T = o.shape[:2]
        if self.g_proj is None:
            y = self.o_norm(o)
        else:
            y = self.o_norm(o, finish(self.g_proj, p["g"]).view(B, T, self.H, self.V))
        return self.o_proj(y.reshape(B, T, self.H * self.V))
