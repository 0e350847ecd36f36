"""The asymmetric memory on CUDA (docs/math.md §6): fla's KDA-style chunk-64 kernels with a separate write key.

``S_t = D_t S_{t-1} + beta_t kappa_t (v_t - k_t^T D_t S_{t-1})^T``, ``o_t = scale q_t^T S_t``: ``kappa`` on the write
side, ``k`` on the read side. The forward is fla's intra-chunk matrices (``fla.ops.precond_kda``), then its WY terms,
chunk states and output, in fla's three launches or fewer of ours (:mod:`kdn.ops.triton.state_output`); the backward
is fla's, except the inter-chunk + WY backward (:mod:`kdn.ops.triton.wy`) and, inside fla's safe envelope, the
intra-chunk backward (:mod:`kdn.ops.triton.intra_tma` on sm_90, :mod:`kdn.ops.triton.intra` elsewhere), with the
final chunk sums of ``dg`` left to the caller on request (:func:`_asym_intra_bwd`). fla's private launchers and
kernels are reached through :mod:`kdn.ops.fla_internals`, which also holds the launches of its intra-chunk kernels
on our grids. Both KDNs run it (Diagonal: ``kappa`` the Diagonal gain; Isotropic: ``kappa = k`` with ``beta`` the KDN
gain, KDA's rule), and so does the KDA baseline (:func:`kdn.ops.chunk.chunk_kda`).

``recompute_states``: the backward needs the forward's WY terms (``w``, ``q exp2(gc)``, ``kg``) and chunk states
(``h``, ``v_new``). ``False`` (the default): the forward keeps them, five more ``[B,T,H,K]``-sized bf16 tensors per
layer (about 0.8 GiB per layer for 32K tokens of 16 heads of 128); ``True``: the backward recomputes them, as fla's
``chunk_kda`` does (docs/performance.md).

``precise``: every launch goes through the TF32x3 copies of its kernels (:mod:`kdn.ops.triton.precision`), for FP32
operands (``precision="fp32"``, docs/kernels.md).
"""
from __future__ import annotations

import torch
from torch import Tensor

from kdn.ops import fla_internals
from kdn.ops.triton.intra import chunk_asym_bwd_intra
from kdn.ops.triton.intra_tma import chunk_asym_bwd_intra_tma, tma_supported
from kdn.ops.triton.precision import maybe_precise
from kdn.ops.triton.safe_gate import SafeGate
from kdn.ops.triton.state_output import chunk_state_output, chunk_wy_state_output, state_output_kernel
from kdn.ops.triton.utils import kernel_choice
from kdn.ops.validate import ASYM_CHUNK


def _asym_intra_bwd(
    q: Tensor, k: Tensor, kappa: Tensor, gc: Tensor, beta: Tensor, dAqk: Tensor, dAkk: Tensor, dq: Tensor,
    dk: Tensor, dkg: Tensor, db: Tensor, dg: Tensor, safe: bool, seqs: dict[str, Tensor | None], precise: bool,
    dg_chunk_sums: bool = True, kernel: str | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The asymmetric intra-chunk backward, which adds the intra-chunk terms to ``dq, dk, dkg`` (those of
    ``q, k, kappa``), ``db`` and the per-token ``dg``, then takes ``dg``'s reverse cumulative sum within each chunk
    (``gc`` is a chunk-local cumulative sum of ``g``), which makes it the gradient of the raw ``g``. Returns
    ``(dq, dk, dkappa, db, dg)``: the first three in the inputs' dtypes, ``db`` and ``dg`` FP32 (``[B,T,H,K]``).
    ``dg_chunk_sums=False`` skips the sum, for a later pass that walks the tokens anyway to take it on (both KDN
    gains' last backward launch).

    Inside fla's safe envelope, ours (one program a chunk, the sum fused): its tiles through tensor descriptors
    where the GPU and the tensors allow (:mod:`kdn.ops.triton.intra_tma`), else through pointers
    (:mod:`kdn.ops.triton.intra`); outside it, fla's ``chunk_precond_kda_bwd_intra``, whose token loop is exact for
    any gate. ``kernel`` (:func:`intra_kernel`; None reads ``KDN_INTRA_KERNEL``) can force any of the three."""
    kernel = intra_kernel(safe, (q, k, kappa, gc, dAqk, dAkk, dq, dk, dkg, dg), kernel)
    if kernel == "fla":
        return fla_internals.asym_intra_bwd(q, k, kappa, gc, beta, dAqk, dAkk, dq, dk, dkg, db, dg, safe, seqs,
                                            precise, dg_chunk_sums)
    fn = chunk_asym_bwd_intra_tma if kernel == "tma" else chunk_asym_bwd_intra
    return maybe_precise(fn, precise)(q, k, kappa, gc, beta, dAqk, dAkk, dq, dk, dkg, db, dg,
                                      dg_chunk_sums=dg_chunk_sums, **seqs)


INTRA_KERNELS = ("auto", "tma", "kdn", "fla")


def intra_kernel(safe: bool, tensors: tuple[Tensor, ...] = (), kernel: str | None = None) -> str:
    """Which intra-chunk backward runs, for gates that are (``safe``) or are not inside fla's safe envelope, on
    ``tensors`` (the launch's inputs and incoming gradients): ``"tma"`` (ours on tensor descriptors,
    :mod:`kdn.ops.triton.intra_tma`), ``"kdn"`` (ours on pointers, :mod:`kdn.ops.triton.intra`: any GPU and the
    interpreter) or ``"fla"``. ``kernel``: ``"auto"`` (fla's outside the envelope; inside it ``"tma"`` where
    :func:`~kdn.ops.triton.intra_tma.tma_supported`, else ``"kdn"``), or one of the three, forced (ours refuse gates
    outside the envelope, ``"tma"`` tensors it cannot take); None reads ``KDN_INTRA_KERNEL``, else ``"auto"``."""
    kernel = kernel_choice(kernel, "KDN_INTRA_KERNEL", INTRA_KERNELS, "intra-chunk backward kernel")
    if kernel in ("tma", "kdn") and not safe:
        raise ValueError("the KDN intra-chunk backward needs gates inside fla's safe envelope, and these are not: "
                         "set KDN_INTRA_KERNEL=auto (or fla)")
    tma = tma_supported(*tensors)
    if kernel == "tma" and not tma:
        raise ValueError("the TMA intra-chunk backward needs CUDA tensors on sm_90 or later with 16-byte aligned rows: "
                         "set KDN_INTRA_KERNEL=auto (or kdn)")
    if kernel == "auto":
        return ("tma" if tma else "kdn") if safe else "fla"
    return kernel


def _asym_memory_fwd(
    q: Tensor, k: Tensor, kappa: Tensor, v: Tensor, g: Tensor, beta: Tensor | None, S0: Tensor | None, scale: float,
    output_final_state: bool, cu_seqlens: Tensor | None, check: SafeGate, gc: Tensor | None = None,
    recompute_states: bool = False, precise: bool = False, kernel: str | None = None,
) -> tuple[Tensor, Tensor | None, tuple[Tensor | None, ...], bool]:
    """The asymmetric memory's forward launches (shapes as :class:`_AsymmetricMemory`): ``(o, S_T, saved, safe)``,
    ``saved`` what :func:`_asym_memory_bwd` takes, ``safe`` the answer of ``check``
    (:func:`kdn.ops.triton.safe_gate.safe_gate`; read just before the first kernel that needs it): whether fla's
    tensor-core diagonal blocks were taken. Unless ``recompute_states``, ``saved`` holds the WY terms and chunk states
    the backward would otherwise recompute.
    ``gc``: ``g``'s cumulative sums within the chunks in log2 units, when already made (:mod:`kdn.ops.triton.gate`).
    After the intra-chunk matrices, as ``kernel`` (:func:`state_output_kernel`) chooses: fla's WY, chunk-state and
    output launches; fla's WY launch, then the states and output in one (:mod:`kdn.ops.triton.state_output`); or all
    three in one. Ours write ``h``, ``v_new`` (and the WY terms) only when they are kept: a forward without gradients
    passes ``recompute_states=True``, and nothing is kept for a backward that will not run."""
    C = ASYM_CHUNK
    q, k, kappa, v = (x.contiguous() for x in (q, k, kappa, v))
    seqs = {"cu_seqlens": cu_seqlens,
            "chunk_indices": None if cu_seqlens is None else fla_internals.prepare_chunk_indices(cu_seqlens, C)}
    if gc is None:  # log2, per chunk
        gc = fla_internals.chunk_local_cumsum(g.float().contiguous(), chunk_size=C, scale=fla_internals.RCP_LN2,
                                              **seqs)
    beta = q.new_ones(q.shape[:3]) if beta is None else beta.contiguous()
    safe = bool(check)
    keep = not recompute_states
    Aqk, Akk = fla_internals.asym_intra_fwd(q, k, kappa, gc, beta, scale, safe, seqs, precise)
    kernel = state_output_kernel(kernel, q.device)
    if kernel == "wy":
        o, h, v_new, S, w, qg, kg = maybe_precise(chunk_wy_state_output, precise)(
            q, k, kappa, v, beta, gc, Akk, Aqk, scale, S0, output_final_state, save_states=keep, chunk_size=C,
            **seqs)
    else:
        w, u, qg, kg = maybe_precise(fla_internals.recompute_w_u_fwd, precise)(
            k=k, k_precond=kappa, v=v, beta=beta, A=Akk, gk=gc, q=q, output_qg=keep, output_kg=True, **seqs)
    if kernel == "fused":
        o, h, v_new, S = maybe_precise(chunk_state_output, precise)(
            q, kg, w, u, gc, Aqk, scale, S0, output_final_state, save_states=keep, qg=qg, chunk_size=C, **seqs)
    elif kernel == "fla":
        h, v_new, S = maybe_precise(fla_internals.chunk_gated_delta_rule_fwd_h, precise)(
            k=kg, w=w, u=u, gk=gc, initial_state=S0, output_final_state=output_final_state, chunk_size=C, **seqs)
        o = maybe_precise(fla_internals.chunk_gla_fwd_o_gk, precise)(q=q, v=v_new, g=gc, A=Aqk, h=h, scale=scale,
                                                                     chunk_size=C, **seqs)
    states = (w, qg, kg, h, v_new) if keep else (None,) * 5
    saved = (q, k, kappa, v, gc, beta, Aqk, Akk, S0, seqs["cu_seqlens"], seqs["chunk_indices"], *states)
    return o.to(q.dtype), S, saved, safe


def _asym_memory_bwd(
    saved: tuple[Tensor | None, ...], scale: float, safe: bool, do: Tensor, dS: Tensor | None, precise: bool = False,
    dg_chunk_sums: bool = True,
) -> tuple[Tensor | None, ...]:
    """The asymmetric memory's backward launches from ``saved`` (:func:`_asym_memory_fwd`, of the same ``precise``)
    and the gradients of ``o`` and ``S_T``: ``(dq, dk, dkappa, dv, dg, dbeta, dS0)``, the first four in their inputs'
    dtypes, ``dg`` (of the raw ``g``) and ``dbeta`` FP32, ``dS0`` FP32 (``None`` without ``S0``).
    ``dg_chunk_sums=False``: ``dg`` before its reverse cumulative sum within the chunks (:func:`_asym_intra_bwd`)."""
    from kdn.ops.triton.wy import chunk_asym_bwd_wy_dqkg

    q, k, kappa, v, gc, beta, Aqk, Akk, S0, cu_seqlens, chunk_indices, w, qg, kg, h, v_new = saved
    C = ASYM_CHUNK
    seqs = {"cu_seqlens": cu_seqlens, "chunk_indices": chunk_indices}
    do = do.contiguous()
    if h is None:  # recompute the WY representation and the chunk states (as fla's KDA backward does)
        w, u, qg, kg = maybe_precise(fla_internals.recompute_w_u_fwd, precise)(
            k=k, k_precond=kappa, v=v, beta=beta, A=Akk, gk=gc, q=q, output_qg=True, output_kg=True, **seqs)
        h, v_new, _ = maybe_precise(fla_internals.chunk_gated_delta_rule_fwd_h, precise)(
            k=kg, w=w, u=u, gk=gc, initial_state=S0, output_final_state=False, chunk_size=C, **seqs)
    dAqk, dv = maybe_precise(fla_internals.chunk_precond_kda_bwd_dAv, precise)(
        q=q, k=k, v=v_new, do=do, A=Aqk, scale=scale, chunk_size=C, **seqs)
    dh, dS0, dv = maybe_precise(fla_internals.chunk_gated_delta_rule_bwd_dhu, precise)(
        q=qg, k=kg, w=w, gk=gc, h0=S0, dht=dS, do=do, dv=dv, scale=scale, chunk_size=C, **seqs)
    dq, dk, dkg, dv, dbeta, dg, dAkk = maybe_precise(chunk_asym_bwd_wy_dqkg, precise)(
        q=q, k=k, k_precond=kappa, v=v, v_new=v_new, g=gc, beta=beta, A=Akk, h=h, do=do, dh=dh, dv=dv,
        scale=scale, chunk_size=C, **seqs)
    dq, dk, dkappa, dbeta, dg = _asym_intra_bwd(q, k, kappa, gc, beta, dAqk, dAkk, dq, dk, dkg, dbeta, dg, safe,
                                                seqs, precise, dg_chunk_sums)
    return dq.to(q), dk.to(k), dkappa.to(kappa), dv.to(v), dg, dbeta, dS0


class _AsymmetricMemory(torch.autograd.Function):
    """The asymmetric gated delta rule ``S_t = D_t S_{t-1} + beta_t kappa_t (v_t - k_t^T D_t S_{t-1})^T``,
    ``o_t = scale q_t^T S_t``, through fla's KDA-style chunk-64 kernels with a separate write key (those of
    ``fla.ops.precond_kda`` without its preconditioner: ``kappa`` takes the place of ``beta k_precond``), except the
    inter-chunk + WY backward, ours (:func:`kdn.ops.triton.wy.chunk_asym_bwd_wy_dqkg`: the same values, split over key
    blocks, 2x faster on an H200), and the intra-chunk backward inside fla's safe envelope, ours
    (:func:`kdn.ops.triton.intra_tma.chunk_asym_bwd_intra_tma` on sm_90, else
    :func:`kdn.ops.triton.intra.chunk_asym_bwd_intra`).

    ``q, k, kappa: [B,T,H,K]`` and ``v [B,T,H,V]`` (bf16 or FP32), ``g [B,T,H,K]`` FP32 log-retention,
    ``beta [B,T,H]`` (``kappa``'s dtype; ``None``: ones, the write key is ``kappa`` alone), ``S0 [N,H,K,V]`` FP32 or
    ``None``; ``N = B``, or with ``cu_seqlens [N+1]`` (packed sequences, ``B = 1``)
    the number of sequences; ``check``: :func:`kdn.ops.triton.safe_gate.safe_gate` of ``g``; ``recompute_states`` as
    in the module docstring; ``precise``: the TF32x3 kernels. Returns ``o [B,T,H,V]`` and ``S_T [N,H,K,V]``
    (``None`` unless asked).
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, q: Tensor, k: Tensor, kappa: Tensor, v: Tensor, g: Tensor,
        beta: Tensor | None, S0: Tensor | None, scale: float, output_final_state: bool, cu_seqlens: Tensor | None,
        check: SafeGate, recompute_states: bool, precise: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        ctx.same_key = kappa is k  # one key on both sides (Isotropic): its two gradients are summed in FP32
        o, S, saved, ctx.safe = _asym_memory_fwd(q, k, kappa, v, g, beta, S0, scale, output_final_state, cu_seqlens,
                                                 check, recompute_states=recompute_states, precise=precise)
        ctx.precise = precise
        ctx.save_for_backward(*saved)
        ctx.scale = scale
        return o, S

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, do: Tensor, dS: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        saved = ctx.saved_tensors
        dq, dk, dkappa, dv, dg, dbeta, dS0 = _asym_memory_bwd(saved, ctx.scale, ctx.safe, do, dS, ctx.precise)
        dbeta = dbeta.to(saved[5]) if ctx.needs_input_grad[5] else None  # saved[5]: beta
        if ctx.same_key:
            dk, dkappa = dk + dkappa, None
        return dq, dk, dkappa, dv, dg, dbeta, dS0, None, None, None, None, None, None
