"""The delta-rule baselines (DeltaNet, Gated DeltaNet, KDA, GDN-2) on KDN's front end.

Each mixer has exactly the parameters of fla's layer of the same name (``fla.layers.DeltaNet``,
``GatedDeltaNet``, ``KimiDeltaAttention``, ``GatedDeltaNet2``) at ``expand_v = 1`` and with the
model's ``num_heads x head_dim`` (so every delta mixer carries the same ``H x K x V`` memory as KDN).
``_DeltaRule.__init__`` declares the projections, short convolutions, retention gate and output block, which
:class:`kdn.modules.DeltaFrontEnd` runs; only the output block follows each fla layer (``output_gate``):
``"sigmoid"`` (low-rank, with bias: KDA, GDN-2, KDN), ``"swish"`` (full rank: Gated DeltaNet),
``"swish_low_rank"`` (the low-rank gate with bias, swish-activated: the GDN-2 layer of the paper's authors' release,
whose other parameters are fla's ``GatedDeltaNet2``'s) or ``"none"`` (plain RMSNorm: DeltaNet).

Every rule is an instance of ``S_t = (I - kappa_t r_t^T) D_t S_{t-1} + kappa_t u_t^T`` (read key
``r``, write vector ``kappa``, value ``u``), which :func:`kdn.ops.torch_chunk.memory_chunk` scans on any device
(``backend="torch"``). On CUDA the default is fla's chunk kernels (``backend="fla"``; KDA through ours, :class:`KDA`).
Padding tokens are identity steps (zero key, no decay); ``cu_seqlens`` packs documents. ``fused``: the fused CUDA
front end (:class:`kdn.modules.DeltaFrontEnd`); ``recompute_states``: KDA's memory backward recomputes its states
(:func:`kdn.ops.chunk.chunk_kda`).
"""
from __future__ import annotations

import abc
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch import Tensor

from kdn.layers import RecurrentCache
from kdn.modules import DeltaFrontEnd, GatedRMSNorm, Linear, ShortConv, kda_retention, low_rank, upcast
from kdn.ops.torch_chunk import MEMORY_CHUNK, memory_chunk
from models.layers.common import (
    RMSNorm,
    check_cu_seqlens,
    current_mask,
    repack,
    unpack_all,
)

if TYPE_CHECKING:
    from kdn.ops.triton.safe_gate import SafeGate

OUTPUT_GATES = ("sigmoid", "swish", "swish_low_rank", "none")
BACKENDS = ("torch", "fla")


class _DeltaRule(nn.Module, abc.ABC):
    """Shared forward of the delta-rule baselines; subclasses define the write terms and the kernel call."""

    gate: str = "channel"
    output_gate_default: str = "sigmoid"
    checks_safe_gate = False  # fla_call gets kdn.ops.triton.safe_gate(g) (fla's tensor-core path when it is exact)

    def __init__(
        self, hidden_size: int = 2048, num_heads: int = 16, head_dim: int = 128, *,
        output_gate: str | None = None, conv_size: int = 4, norm_eps: float = 1e-5,
        layer_idx: int | None = None, backend: str | None = None, fused: bool = True,
        recompute_states: bool = False,
    ) -> None:
        super().__init__()
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS} or None (auto), got {backend!r}")
        self.hidden_size, self.num_heads, self.head_dim = hidden_size, num_heads, head_dim
        self.layer_idx, self.backend, self.recompute_states = layer_idx, backend, recompute_states
        output_gate = output_gate or self.output_gate_default
        if output_gate not in OUTPUT_GATES:
            raise ValueError(f"output_gate must be one of {OUTPUT_GATES}, got {output_gate!r}")
        H, K, V, d = num_heads, head_dim, head_dim, hidden_size  # expand_v = 1
        gated_out = output_gate != "none"
        self.front = DeltaFrontEnd(  # registered in this order: the state dict's keys "front.<name>"
            H, K, V, gate=self.gate, fused=fused,
            q_proj=Linear(d, H * K, bias=False),  # [H*K, d]
            k_proj=Linear(d, H * K, bias=False),  # [H*K, d]
            v_proj=Linear(d, H * V, bias=False),  # [H*V, d]
            q_conv1d=ShortConv(H * K, conv_size, fused=fused),  # [H*K, 1, W]
            k_conv1d=ShortConv(H * K, conv_size, fused=fused),  # [H*K, 1, W]
            v_conv1d=ShortConv(H * V, conv_size, fused=fused),  # [H*V, 1, W]
            # retention: per channel [V, d], [H*K, V] (KDA, GDN-2); per head [H, d] (fla's a_proj: Gated DeltaNet)
            f_proj=(low_rank(d, V, H * K) if self.gate == "channel"
                    else Linear(d, H, bias=False) if self.gate == "head" else None),
            # KDA's parametrisation: A_log [H], dt_bias [H*K] per channel or [H] per head; none without decay
            retention=kda_retention(H, H * K if self.gate == "channel" else H) if self.gate != "none" else {},
            # output gate: low rank [V, d], [H*V, V] + bias [H*V] (sigmoid, swish_low_rank); full rank [H*V, d]
            # (swish); none: a plain RMSNorm
            g_proj=(Linear(d, H * V, bias=False) if output_gate == "swish"
                    else low_rank(d, V, H * V, bias=True) if gated_out else None),
            o_norm=GatedRMSNorm(V, norm_eps, activation="sigmoid" if output_gate == "sigmoid" else "swish",
                                fused=fused) if gated_out else RMSNorm(V, norm_eps, fused=fused),  # [V]
            o_proj=Linear(H * V, d, bias=False),  # [d, H*V]
        )

    # -- per-rule pieces ---------------------------------------------------------------------------
    @abc.abstractmethod
    def write_projections(self) -> dict[str, nn.Linear]:
        """The rule's own projections of the layer input (they join the front end's matmul)."""

    @abc.abstractmethod
    def write_terms(self, p: dict[str, Tensor]) -> dict[str, Tensor]:
        """The rule's write strengths (FP32) from the projections ``p`` of the layer input, ``[B, T, width]``."""

    def rule(self, k: Tensor, v: Tensor, terms: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """``(read key r, write vector kappa, value u)`` of the generic rule, from ``k [B,T,H,K]``, ``v``."""
        beta = terms["beta"][..., None]
        return k, beta * k, v

    @abc.abstractmethod
    def fla_call(
        self, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, terms: dict[str, Tensor], S0: Tensor | None,
        output_final_state: bool, cu_seqlens: Tensor | None, check: SafeGate | None,
    ) -> tuple[Tensor, Tensor | None]:
        """Run fla's chunk kernel for this rule (CUDA); ``q`` unscaled, ``S0 [N,H,K,V]`` FP32 or ``None``;
        ``check``: ``kdn.ops.triton.safe_gate(g)`` when the class sets ``checks_safe_gate``, else ``None``."""

    def effective_strength(self, k: Tensor, terms: dict[str, Tensor]) -> Tensor:
        """``r_t^T kappa_t`` per token, ``[B, T, H]`` (the rule's ``beta_eff``)."""
        return terms["beta"] * (k * k).sum(-1)

    # -- shared --------------------------------------------------------------------------------------
    def resolve_backend(self, device: torch.device) -> str:
        if self.backend is None:
            return "fla" if device.type == "cuda" else "torch"
        if self.backend == "fla" and device.type != "cuda":
            raise ValueError("backend='fla' needs CUDA tensors (fla's Triton kernels); use backend='torch'")
        return self.backend

    def forward(
        self, hidden_states: Tensor, attention_mask: Tensor | None = None,
        past_key_values: RecurrentCache | None = None, use_cache: bool = False,
        cu_seqlens: Tensor | None = None, output_beta_eff: bool = False, **kwargs: object,
    ) -> tuple[Tensor, Tensor | None, RecurrentCache | None]:
        """``hidden_states [B, T, d]`` -> ``(o [B, T, d], beta_eff [B, T, H] | None, cache)``."""
        x = hidden_states
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        mask = current_mask(attention_mask, B, T)
        if cu_seqlens is not None:
            check_cu_seqlens(cu_seqlens, T, B)
        if mask is not None:
            x = x * mask[..., None].to(x.dtype)
        last = past_key_values.get(self.layer_idx) if past_key_values is not None else None
        p, conv = self.front.inputs(x, self.write_projections(), last["conv"] if last else None, cu_seqlens,
                                    use_cache, static=getattr(past_key_values, "static", False))
        g = self.front.log_retention(p) if self.gate != "none" else None
        if mask is not None and g is not None:  # padded tokens are identity steps: no key, no decay
            g = g * (mask[..., None] if g.dim() == 3 else mask[..., None, None])
        # one decoding token runs delta_step on every device: a few small kernels and no host sync (fla's chunk
        # kernels, the safe-gate check and the chunked scan's span test read host values), so a CUDA graph captures it
        decoding = T == 1 and last is not None and cu_seqlens is None
        fla = self.resolve_backend(x.device) == "fla" and not decoding
        check = None
        if fla and self.checks_safe_gate:  # read in fla_call, once write_terms' kernels are queued
            from kdn.ops.triton.safe_gate import safe_gate

            check = safe_gate(g)
        terms = self.write_terms(p)
        q, k, v = p["q"], p["k"], p["v"]
        if mask is not None:
            k = k * mask[..., None, None].to(k.dtype)
        S0 = last["recurrent"] if last is not None else None
        if fla:  # one activation dtype for the kernels (v's, under autocast)
            cu = cu_seqlens.to(x.device) if cu_seqlens is not None else None
            h0 = S0.float() if S0 is not None else None
            o, S = self.fla_call(q.to(v.dtype), k.to(v.dtype), v, g, terms, h0, use_cache, cu, check)
        else:
            dt = torch.promote_types(x.dtype, torch.float32)
            if S0 is None:
                n_seq = B if cu_seqlens is None else cu_seqlens.numel() - 1
                S0 = x.new_zeros(n_seq, H, K, self.front.V, dtype=dt)
            with torch.autocast(x.device.type, enabled=False):  # the scan runs in FP32 even under autocast
                call = self.torch_step if decoding else self.torch_call
                o, S = call(q, k, v, g, terms, S0, cu_seqlens, dt)
        beta_eff = self.effective_strength(k.float(), terms) if output_beta_eff else None
        if use_cache:
            if past_key_values is None:
                past_key_values = RecurrentCache()
            past_key_values.update(self.layer_idx, recurrent=S, conv=conv)
        return self.front.output(o.to(x.dtype), p), beta_eff, past_key_values

    def torch_call(
        self, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, terms: dict[str, Tensor], S0: Tensor,
        cu_seqlens: Tensor | None, dt: torch.dtype,
    ) -> tuple[Tensor, Tensor]:
        """The chunked PyTorch scan (any device), in FP32 (float64 for float64 inputs)."""
        K = self.head_dim
        k, v = k.to(dt), v.to(dt)
        r, kappa, u = self.rule(k, v, {n: t.to(dt) for n, t in terms.items()})
        if g is None:
            g = torch.zeros_like(k)
        elif g.dim() == 3:
            g = g[..., None].expand_as(k)
        xs = unpack_all([q.to(dt) * K ** -0.5, r, kappa, u, g.to(dt)], [0.0] * 5, cu_seqlens)
        o, S = memory_chunk(*xs, S0.to(dt), chunk=min(MEMORY_CHUNK, xs[0].shape[1]))  # decoding: chunk of 1
        return (repack(o, cu_seqlens) if cu_seqlens is not None else o), S

    def torch_step(
        self, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, terms: dict[str, Tensor], S0: Tensor,
        cu_seqlens: Tensor | None, dt: torch.dtype,
    ) -> tuple[Tensor, Tensor]:
        """One decoding token (``T = 1``, arguments as :meth:`torch_call`), in FP32 (float64 for float64 inputs)."""
        k, v = k.to(dt), v.to(dt)
        r, kappa, u = self.rule(k, v, {n: t.to(dt) for n, t in terms.items()})
        if g is not None:
            g = g.to(dt)[:, 0]
            g = g[..., None] if g.dim() == 2 else g
        o, S = delta_step(q.to(dt)[:, 0] * self.head_dim ** -0.5, r[:, 0], kappa[:, 0], u[:, 0], g, S0.to(dt))
        return o[:, None], S


def delta_step(q: Tensor, r: Tensor, kappa: Tensor, u: Tensor, g: Tensor | None, S: Tensor) -> tuple[Tensor, Tensor]:
    """One token of ``S' = (I - kappa r^T) D S + kappa u^T``, ``o = S'^T q``: ``q, r, kappa [B, H, K]``,
    ``u [B, H, V]``, ``g = log D`` as ``[B, H, K]`` or ``[B, H, 1]`` (``None``: no decay), ``S [B, H, K, V]``.
    Returns ``o [B, H, V]`` and ``S'``."""
    if g is not None:
        S = S * g.exp()[..., None]
    S = S + kappa[..., None] * (u - (r[..., None] * S).sum(-2))[..., None, :]
    return (q[..., None] * S).sum(-2), S


class _ScalarBetaRule(_DeltaRule):
    """A rule whose write strength is one ``beta = sigmoid(b_proj(x))`` per head (fla's ``b_proj``)."""

    def __init__(self, hidden_size: int = 2048, num_heads: int = 16, head_dim: int = 128, **kw: object) -> None:
        super().__init__(hidden_size, num_heads, head_dim, **kw)
        self.b_proj = Linear(hidden_size, num_heads, bias=False)

    def write_projections(self) -> dict[str, nn.Linear]:
        return {"beta": self.b_proj}

    def write_terms(self, p: dict[str, Tensor]) -> dict[str, Tensor]:
        return {"beta": torch.sigmoid(upcast(p["beta"]))}


class DeltaNet(_ScalarBetaRule):
    """DeltaNet (fla ``DeltaNet``): ``S_t = (I - beta k k^T) S + beta k v^T``, no decay, plain output norm."""

    gate = "none"
    output_gate_default = "none"

    def fla_call(
        self, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, terms: dict[str, Tensor], S0: Tensor | None,
        output_final_state: bool, cu_seqlens: Tensor | None, check: SafeGate | None,
    ) -> tuple[Tensor, Tensor | None]:
        from fla.ops.delta_rule import chunk_delta_rule

        dt = torch.bfloat16 if q.dtype == torch.float32 else q.dtype  # fla's delta-rule kernels refuse FP32
        o, S = chunk_delta_rule(q.to(dt), k.to(dt), v.to(dt), terms["beta"].to(dt), scale=self.head_dim ** -0.5,
                                initial_state=S0, output_final_state=output_final_state, cu_seqlens=cu_seqlens)
        return o.to(q.dtype), S


class GatedDeltaNet(_ScalarBetaRule):
    """Gated DeltaNet (fla ``GatedDeltaNet``): a per-head decay ``g = -exp(A_log) softplus(a(x) + dt_bias)``,
    full-rank swish output gate."""

    gate = "head"
    output_gate_default = "swish"

    def __init__(self, hidden_size: int = 2048, num_heads: int = 16, head_dim: int = 128, **kw: object) -> None:
        super().__init__(hidden_size, num_heads, head_dim, **kw)
        with torch.no_grad():  # fla's Gated DeltaNet draws A from U(0, 16)
            self.front.A_log.copy_(torch.empty_like(self.front.A_log).uniform_(0, 16).clamp_min(1e-4).log())

    @property
    def checks_safe_gate(self) -> bool:  # type: ignore[override]
        """Only the KDA fallback (:meth:`runs_as_kda`) reads the check."""
        return self.runs_as_kda()

    @staticmethod
    def runs_as_kda() -> bool:
        """Whether fla refuses this rule's backward here (a Triton miscompilation, fla #640: Hopper, Triton 3.4 to
        3.7.1, gradients on); the same rule is then KDA with the head's decay on every key channel, whose kernels
        are not affected."""
        from kdn.ops.fla_internals import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1

        return IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1 and torch.is_grad_enabled()

    def fla_call(
        self, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, terms: dict[str, Tensor], S0: Tensor | None,
        output_final_state: bool, cu_seqlens: Tensor | None, check: SafeGate | None,
    ) -> tuple[Tensor, Tensor | None]:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        if self.runs_as_kda():  # forward made the check (checks_safe_gate)
            from kdn.ops.chunk import chunk_kda

            gk = g.float()[..., None].expand_as(k).contiguous()
            return chunk_kda(q, k, v, gk, terms["beta"].to(q.dtype), scale=self.head_dim ** -0.5, initial_state=S0,
                             output_final_state=output_final_state, cu_seqlens=cu_seqlens, check=check,
                             recompute_states=self.recompute_states)
        return chunk_gated_delta_rule(q, k, v, g.float(), terms["beta"].to(q.dtype), scale=self.head_dim ** -0.5,
                                      initial_state=S0, output_final_state=output_final_state,
                                      cu_seqlens=cu_seqlens)


class KDA(_ScalarBetaRule):
    """Kimi Delta Attention (fla ``KimiDeltaAttention``): per-channel decay, scalar ``beta`` per head. On CUDA the rule
    runs through :func:`kdn.ops.chunk.chunk_kda` (the asymmetric memory with ``kappa = k``, as Isotropic KDN runs it:
    fla's chunk-64 kernels with our faster WY backward), the values of fla's ``chunk_kda``."""

    gate = "channel"
    output_gate_default = "sigmoid"
    checks_safe_gate = True

    def fla_call(
        self, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, terms: dict[str, Tensor], S0: Tensor | None,
        output_final_state: bool, cu_seqlens: Tensor | None, check: SafeGate | None,
    ) -> tuple[Tensor, Tensor | None]:
        from kdn.ops.chunk import chunk_kda

        return chunk_kda(q, k, v, g.float(), terms["beta"].to(q.dtype), scale=self.head_dim ** -0.5,
                         initial_state=S0, output_final_state=output_final_state, cu_seqlens=cu_seqlens, check=check,
                         recompute_states=self.recompute_states)


class GDN2(_DeltaRule):
    """Gated DeltaNet-2 (fla ``GatedDeltaNet2``): channel-wise erase gate ``b`` (key axis) and write gate
    ``w`` (value axis): ``S_t = (I - k (b*k)^T) D S + k (w*v)^T``."""

    gate = "channel"
    output_gate_default = "sigmoid"

    def __init__(self, hidden_size: int = 2048, num_heads: int = 16, head_dim: int = 128, **kw: object) -> None:
        super().__init__(hidden_size, num_heads, head_dim, **kw)
        self.b_proj = Linear(hidden_size, num_heads * head_dim, bias=False)
        self.w_proj = Linear(hidden_size, num_heads * self.front.V, bias=False)

    def write_projections(self) -> dict[str, nn.Linear]:
        return {"b": self.b_proj, "w": self.w_proj}

    def write_terms(self, p: dict[str, Tensor]) -> dict[str, Tensor]:
        B, T = p["b"].shape[:2]
        b = torch.sigmoid(upcast(p["b"])).view(B, T, self.num_heads, self.head_dim)
        w = torch.sigmoid(upcast(p["w"])).view(B, T, self.num_heads, self.front.V)
        return {"b": b, "w": w}

    def rule(self, k: Tensor, v: Tensor, terms: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        return terms["b"] * k, k, terms["w"] * v

    def effective_strength(self, k: Tensor, terms: dict[str, Tensor]) -> Tensor:
        return (terms["b"] * k * k).sum(-1)

    def fla_call(
        self, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, terms: dict[str, Tensor], S0: Tensor | None,
        output_final_state: bool, cu_seqlens: Tensor | None, check: SafeGate | None,
    ) -> tuple[Tensor, Tensor | None]:
        from fla.ops.gdn2 import chunk_gdn2

        return chunk_gdn2(q, k, v, g.float(), terms["b"].to(q.dtype), terms["w"].to(q.dtype),
                          scale=self.head_dim ** -0.5, initial_state=S0,
                          output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def fla_layer_kwargs(name: str, hidden_size: int, num_heads: int, head_dim: int, norm_eps: float) -> dict:
    """Constructor arguments of the fla layer that our mixer ``name`` reproduces (for parity tests)."""
    common = {"hidden_size": hidden_size, "num_heads": num_heads, "norm_eps": norm_eps}
    if name == "deltanet":
        return {**common, "expand_k": num_heads * head_dim / hidden_size,
                "expand_v": num_heads * head_dim / hidden_size, "use_gate": False}
    if name == "gdn":
        return {**common, "head_dim": head_dim, "expand_v": 1, "use_gate": True}
    if name in ("kda", "gdn2"):
        return {**common, "head_dim": head_dim, "expand_v": 1}
    raise ValueError(f"no fla counterpart for {name!r}")


def fla_state_dict_map(name: str, ours: dict[str, Tensor]) -> dict[str, Tensor]:
    """Rename our state dict to the fla layer's keys (``front.`` dropped; GDN's gate is fla's ``a_proj``)."""
    out = {}
    for key, value in ours.items():
        key = key.removeprefix("front.")
        if name == "gdn" and key == "f_proj.weight":
            key = "a_proj.weight"
        out[key] = value
    return out


DELTA_MIXERS: dict[str, type[_DeltaRule]] = {"deltanet": DeltaNet, "gdn": GatedDeltaNet, "kda": KDA, "gdn2": GDN2}
