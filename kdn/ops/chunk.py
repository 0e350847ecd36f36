"""KDN and KDA on CUDA: each KDN's gain and the asymmetric memory as one autograd node, and the entry points.

- :func:`chunk_diagonal_kdn`: the fused Diagonal gain (:mod:`kdn.ops.triton.gain_diagonal`) with one of two memories,
  chosen by ``memory``. ``"asym"`` (the default, the faster: docs/results/README.md): fla's asymmetric chunk-64 kernels
  (:mod:`kdn.ops.triton.memory`), gain and memory one autograd node (:class:`_DiagonalKDN`). ``"dplr"``: fla's
  ``chunk_dplr_delta_rule(q, k=kappa, v, a=exp(g) k, b=-kappa, gk=g)`` at chunk 16 or 32.
- :func:`chunk_isotropic_kdn`: the fused Isotropic gain (:mod:`kdn.ops.triton.gain_isotropic`) + KDA's rule with
  ``beta`` the KDN gain (the asymmetric memory with ``kappa = k``), one autograd node (:class:`_IsotropicKDN`).
- :func:`chunk_kda`: KDA's rule through the same memory, as the KDA baseline runs it.

Both nodes start with one pass over ``g`` (:mod:`kdn.ops.triton.gate`) that makes the memory's chunk sums and the
safe-gate check and, given KDA's gate input (``gate=``), ``g`` itself. Their gains take on, in their last backward
launch, the memory's chunk-local reverse sums of ``dg``, the sums of the memory's and the gain's gradients of ``k``
and ``g`` (docs/performance.md, "Gradient sums in the gains' last launch") and, with ``gate=``, the gate's backward.

One calling convention (as :func:`kdn.ops.api.diagonal_kdn`): tensors ``q, k, v, g, ...`` first, settings as keywords.
``precision`` (:func:`kdn.ops.validate.check_precision`): ``"bf16"`` runs the memory in the inputs' dtype (bf16 from
the layers, the gain rounded to it); ``"fp32"`` in FP32 (``q, k, v`` and the gain) through the TF32x3 copies of its
kernels (:mod:`kdn.ops.triton.precision`). The gains and gates are FP32 on both.
"""
from __future__ import annotations

import torch
from torch import Tensor

from kdn.ops.gate import kda_gate
from kdn.ops.triton.gain_diagonal import _diag_gain_bwd, _diag_gain_fwd, diagonal_gain_dplr
from kdn.ops.triton.gain_isotropic import _iso_gain_bwd, _iso_gain_fwd
from kdn.ops.triton.gate import chunk_sums_steepest, kda_gate_fwd
from kdn.ops.triton.memory import _asym_memory_bwd, _asym_memory_fwd, _AsymmetricMemory
from kdn.ops.triton.safe_gate import SafeGate, safe_gate, safe_steepest
from kdn.ops.triton.utils import _check_gain_shapes, _mem_dtype
from kdn.ops.validate import ASYM_CHUNK, check_memory, check_precision


class _DiagonalKDN(torch.autograd.Function):
    """``(q, k, v, g, omega, r, mu, p0, S0, [A_log, dt_bias]) -> (o, S_T, p_T)``: the fused Diagonal gain feeding the
    asymmetric memory (``kappa`` its write key), one autograd node. Its backward runs the memory's, then the gain's,
    whose last launch adds the memory's gradients of ``k`` and ``g`` to the gain's own (no separate ``[B,T,H,K]``
    sums) and, with KDA's gate in the kernels, takes them through the gate.

    ``q, v`` in the memory's dtype (``kappa``'s too; the memory reads ``k`` in it), ``k`` any float dtype, the rest
    as :func:`chunk_diagonal_kdn` (``S0`` FP32 or ``None``, ``N, L`` from :func:`kdn.ops.triton.utils._sequences`).
    One pass over ``g`` makes the memory's chunk sums and the safe-gate check (:mod:`kdn.ops.triton.gate`); with
    ``A_log, dt_bias``, ``g`` is the input of KDA's gate, whose output that pass makes too.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, q: Tensor, k: Tensor, v: Tensor, g: Tensor, omega: Tensor,
        r: Tensor, mu: Tensor, p0: Tensor, S0: Tensor | None, scale: float, output_final_state: bool,
        cu_seqlens: Tensor | None, N: int, L: int, omega_softplus: bool, recompute_states: bool,
        segment_size: int | None, A_log: Tensor | None, dt_bias: Tensor | None, precise: bool = False,
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        ctx.f_dtype = g.dtype
        g, gc, check = _gate_pass(g, A_log, dt_bias, cu_seqlens)
        (kappa, pT), gain = _diag_gain_fwd(k, g, omega, r, mu, p0, q.dtype, False, cu_seqlens, N, L, omega_softplus,
                                           A_log, segment_size)
        o, S, mem, ctx.safe = _asym_memory_fwd(q, k.to(q.dtype), kappa, v, g, None, S0, scale, output_final_state,
                                               cu_seqlens, check, gc, recompute_states, precise)
        ctx.save_for_backward(*gain, *mem)
        ctx.precise = precise
        ctx.n_gain, ctx.seqs, ctx.omega_softplus, ctx.scale = len(gain), (N, L), omega_softplus, scale
        ctx.segment_size = segment_size
        return o, S, pT

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, do: Tensor, dS: Tensor | None, dpT: Tensor
    ) -> tuple[Tensor | None, ...]:
        saved, n = ctx.saved_tensors, ctx.n_gain
        # the memory's dg before its chunk-local reverse sums: the gain's last launch walks the tokens and sums it
        dq, dk_mem, dkappa, dv, dg_mem, _, dS0 = _asym_memory_bwd(saved[n:], ctx.scale, ctx.safe, do, dS,
                                                                      ctx.precise, dg_chunk_sums=False)
        dk, dg, dw, dr, dmu, dp0, dgate = _diag_gain_bwd(saved[:n], (dkappa, dpT), False, *ctx.seqs,
                                                         ctx.omega_softplus, ctx.needs_input_grad[6], (dk_mem, dg_mem),
                                                         ctx.f_dtype, ctx.segment_size, ASYM_CHUNK)
        dA, dbias = dgate if dgate is not None else (None, None)
        return dq, dk, dv, dg, dw, dr, dmu, dp0, dS0, *(None,) * 8, dA, dbias, None


class _IsotropicKDN(torch.autograd.Function):
    """``(q, k, v, g, omega, r, mu, b0, S0) -> (o, S_T, b_T)``: the fused Isotropic gain feeding KDA's rule (the
    asymmetric memory with ``kappa = k`` and ``beta`` the gain), one autograd node. Its backward runs the memory's,
    then the gain's, whose last launch adds the memory's gradients of ``k`` (both sides) and ``g`` to its own and takes
    the memory's chunk-local sums of ``dg``: no separate ``[B,T,H,K]`` sums. The gain receives ``dbeta`` in FP32.

    ``q, v`` in the memory's dtype (``beta``'s too; the memory reads ``k`` in it), ``k`` any float dtype, the rest as
    :func:`chunk_isotropic_kdn` (``S0`` FP32 or ``None``, ``N, L`` from :func:`kdn.ops.triton.utils._sequences`).
    ``g`` and ``A_log, dt_bias`` as in :class:`_DiagonalKDN`: KDA's gate, when given, runs in the first pass and its
    backward in the gain's last launch.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, q: Tensor, k: Tensor, v: Tensor, g: Tensor, omega: Tensor,
        r: Tensor, mu: Tensor, b0: Tensor, S0: Tensor | None, scale: float, output_final_state: bool,
        cu_seqlens: Tensor | None, N: int, L: int, recompute_states: bool, segment_size: int | None,
        A_log: Tensor | None, dt_bias: Tensor | None, precise: bool,
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        ctx.f_dtype = g.dtype
        g, gc, check = _gate_pass(g, A_log, dt_bias, cu_seqlens)
        (beta, bT), gain = _iso_gain_fwd(k, g, omega, r, mu, b0, q.dtype, cu_seqlens, N, L, segment_size, A_log)
        km = k.to(q.dtype)
        o, S, mem, ctx.safe = _asym_memory_fwd(q, km, km, v, g, beta, S0, scale, output_final_state, cu_seqlens,
                                               check, gc, recompute_states, precise)
        ctx.save_for_backward(*gain, *mem)
        ctx.precise, ctx.n_gain, ctx.seqs, ctx.scale = precise, len(gain), (N, L), scale
        ctx.segment_size = segment_size
        return o, S, bT

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, do: Tensor, dS: Tensor | None, dbT: Tensor
    ) -> tuple[Tensor | None, ...]:
        saved, n = ctx.saved_tensors, ctx.n_gain
        dq, dk_mem, dkappa_mem, dv, dg_mem, dbeta, dS0 = _asym_memory_bwd(saved[n:], ctx.scale, ctx.safe, do, dS,
                                                                          ctx.precise, dg_chunk_sums=False)
        dk, dg, dw, dr, dmu, db0, dgate = _iso_gain_bwd(saved[:n], dbeta, dbT, *ctx.seqs, ctx.needs_input_grad[6],
                                                        ctx.segment_size, (dk_mem, dkappa_mem, dg_mem), ASYM_CHUNK,
                                                        ctx.f_dtype)
        dA, dbias = dgate if dgate is not None else (None, None)
        return dq, dk, dv, dg, dw, dr, dmu, db0, dS0, *(None,) * 7, dA, dbias, None


def _gate_pass(
    g: Tensor, A_log: Tensor | None, dt_bias: Tensor | None, cu_seqlens: Tensor | None
) -> tuple[Tensor, Tensor, SafeGate]:
    """One pass over ``g [B,T,H,K]`` (:mod:`kdn.ops.triton.gate`): ``(g, gc, check)``, the log-retention (KDA's gate
    applied when ``A_log, dt_bias`` are given, else ``g`` as it came), its chunk sums for the memory and the
    safe-gate check, to be read after the gain's kernels are queued."""
    if A_log is not None:
        g, gc, steep = kda_gate_fwd(g, A_log, dt_bias, cu_seqlens)
    else:
        gc, steep = chunk_sums_steepest(g, cu_seqlens)
    return g, gc, safe_steepest(steep)


def _recompute(recompute_states: bool) -> bool:
    """The memory's ``recompute_states`` for this call: a forward without gradients (evaluation's prefill) keeps no
    states for a backward that will not run, so that the fused state and output launch writes none."""
    return bool(recompute_states) or not torch.is_grad_enabled()


def chunk_diagonal_kdn(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, omega: Tensor, r: Tensor, mu: Tensor,
    initial_state: tuple[Tensor | None, Tensor], *, scale: float = 1.0, output_final_state: bool = True,
    cu_seqlens: Tensor | None = None, omega_softplus: bool = False, gate: tuple[Tensor, Tensor] | None = None,
    memory: str = "asym", chunk_size: int | None = None, recompute_states: bool = False,
    segment_size: int | None = None, precision: str = "bf16",
) -> tuple[Tensor, tuple[Tensor | None, Tensor]]:
    """Diagonal KDN on CUDA (docs/math.md §3, §6): the fused Triton gain + fla's asymmetric chunk-64 kernels
    (``memory="asym"``) or fla's DPLR chunk kernel (``memory="dplr"``, ``chunk_size`` 16 or 32).

    Args:
        q, k: ``[B,T,H,K]``; ``v``: ``[B,T,H,V]``; ``g, omega``: ``[B,T,H,K]``; ``r``: ``[B,T,H]``; ``mu``: ``[H]``.
        initial_state: ``(S0 [N,H,K,V] or None (zero memory), p0 [N,H,K])``; ``N = B``, or the number of packed
            sequences.
        scale: multiplies ``q``. cu_seqlens: ``[N+1]`` offsets of packed sequences (``B = 1``; ``"asym"`` only).
        omega_softplus: ``omega`` is given before its softplus (applied in the gain kernels).
        gate: ``(A_log [H], dt_bias [H*K])``: ``g`` holds the input of KDA's gate (:func:`kdn.ops.gate.kda_gate`),
            applied inside the ``"asym"`` kernels (before the ``"dplr"`` ones).
        memory, chunk_size: the memory route (:func:`kdn.ops.validate.check_memory`).
        recompute_states: the ``"asym"`` backward recomputes the WY terms and chunk states instead of keeping them.
        segment_size: tokens per segment of the gain's sequence-parallel scan (default: the rule).
        precision: ``"bf16"`` or ``"fp32"`` (the module docstring; ``"fp32"`` with ``memory="asym"``).

    Returns:
        ``o [B,T,H,V]`` and ``(S_T, p_T)`` (``S_T`` is ``None`` unless ``output_final_state``).

    Example::

        o, (S, p) = chunk_diagonal_kdn(q, k, v, g, omega, r, mu, (None, p0), scale=K ** -0.5)
    """
    from fla.ops.generalized_delta_rule import chunk_dplr_delta_rule

    chunk = check_memory(memory, chunk_size)
    precise = check_precision(precision, memory) == "fp32"
    S0, p0 = initial_state
    dt = torch.float32 if precise else _mem_dtype(v)
    if memory == "asym":
        N, L = _check_gain_shapes(k, g, omega, r, mu, p0, False, cu_seqlens)
        o, S, pT = _DiagonalKDN.apply(q.to(dt), k, v.to(dt), g, omega, r, mu, p0, None if S0 is None else S0.float(),
                                      float(scale), output_final_state, cu_seqlens, N, L, omega_softplus,
                                      _recompute(recompute_states), segment_size,
                                      *(gate if gate is not None else (None, None)), precise)
        return o, (S, pT)
    if gate is not None:
        g = kda_gate(g, *gate)
    if cu_seqlens is not None:
        raise NotImplementedError("chunk_diagonal_kdn takes cu_seqlens only with memory='asym'; packed sequences go "
                                  "through kdn.ops.api's unpacking for the DPLR memory")
    kappa, a, b, pT = diagonal_gain_dplr(k, g, omega, r, mu, p0, dt, omega_softplus=omega_softplus,
                                         segment_size=segment_size)
    o, S = chunk_dplr_delta_rule(
        q=q.to(dt), k=kappa, v=v.to(dt), a=a, b=b, gk=g.float(), scale=scale, chunk_size=chunk,
        initial_state=None if S0 is None else S0.float(), output_final_state=output_final_state,
    )
    return o, (S, pT)


def chunk_isotropic_kdn(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, omega: Tensor, r: Tensor, mu: Tensor,
    initial_state: tuple[Tensor | None, Tensor], *, scale: float = 1.0, output_final_state: bool = True,
    cu_seqlens: Tensor | None = None, gate: tuple[Tensor, Tensor] | None = None, recompute_states: bool = False,
    segment_size: int | None = None, precision: str = "bf16",
) -> tuple[Tensor, tuple[Tensor | None, Tensor]]:
    """Isotropic KDN on CUDA (docs/math.md §4, §6): the fused Triton gain + KDA's rule with ``beta`` = the KDN gain
    (:func:`chunk_kda`: the asymmetric memory with ``kappa = k``, whose kernels train faster than fla's ``chunk_kda``;
    docs/performance.md).

    Args:
        q, k, g: ``[B,T,H,K]``; ``v``: ``[B,T,H,V]``; ``omega, r``: ``[B,T,H]``; ``mu``: ``[H]``.
        initial_state: ``(S0 [N,H,K,V] or None, b0 [N,H])``. Settings as in :func:`chunk_diagonal_kdn`
            (``gate`` and ``precision`` too).

    Returns:
        ``o [B,T,H,V]`` and ``(S_T, b_T)``.
    """
    S0, b0 = initial_state
    precise = check_precision(precision) == "fp32"
    dt = torch.float32 if precise else _mem_dtype(v)
    N, L = _check_gain_shapes(k, g, omega, r, mu, b0, True, cu_seqlens)
    o, S, bT = _IsotropicKDN.apply(q.to(dt), k, v.to(dt), g, omega, r, mu, b0, None if S0 is None else S0.float(),
                                   float(scale), output_final_state, cu_seqlens, N, L, _recompute(recompute_states),
                                   segment_size, *(gate if gate is not None else (None, None)), precise)
    return o, (S, bT)


def chunk_kda(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, scale: float, initial_state: Tensor | None = None,
    output_final_state: bool = False, cu_seqlens: Tensor | None = None, check: SafeGate | None = None,
    recompute_states: bool = False, precise: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """KDA's rule (fla's ``chunk_kda``: ``S_t = D_t S_{t-1} + beta_t k_t (v_t - k_t^T D_t S_{t-1})^T``, ``o_t = scale
    q_t^T S_t``) through the asymmetric memory with ``kappa = k`` (:class:`kdn.ops.triton.memory._AsymmetricMemory`),
    whose backward is faster than ``chunk_kda``'s (docs/performance.md), as Isotropic KDN runs it.

    Args:
        q, k: ``[B,T,H,K]``; ``v``: ``[B,T,H,V]`` (one dtype); ``g``: ``[B,T,H,K]`` log-retention; ``beta``:
            ``[B,T,H]`` (``q``'s dtype).
        scale: multiplies ``q``. initial_state: ``[N,H,K,V]`` FP32 or ``None``. cu_seqlens: ``[N+1]`` packed
            sequences (``B = 1``), else ``N = B``.
        check: :func:`kdn.ops.triton.safe_gate.safe_gate` of ``g`` (made here when ``None``).
        recompute_states: the backward recomputes the WY terms and chunk states instead of keeping them.
        precise: the TF32x3 kernels (for FP32 operands: ``precision="fp32"``).

    Returns:
        ``o [B,T,H,V]`` and ``S_T`` (``None`` unless ``output_final_state``).
    """
    check = safe_gate(g) if check is None else check
    S0 = None if initial_state is None else initial_state.float()
    return _AsymmetricMemory.apply(q, k, k, v, g, beta, S0, float(scale), output_final_state, cu_seqlens, check,
                                   _recompute(recompute_states), bool(precise))
