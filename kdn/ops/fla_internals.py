"""Every use of fla's internals, in one place: what flash-linear-attention does not export as its public API (an op's
package, ``fla.ops.<op>``, and the layers of ``fla.modules``), written against flash-linear-attention==0.6.0.

Two kinds:

- **names** (:data:`NAMES`): fla's helpers inside our kernels (``exp2``, ``RCP_LN2``, ``autotune_cache_kwargs``),
  its chunk utilities and hardware flags, the launchers of its private kernels and the fused functions behind its
  modules. ``from kdn.ops.fla_internals import exp2`` (or ``fla_internals.exp2``) resolves one when it is read, so
  that this package imports without fla, and a flag is read as fla holds it at that moment (the interpreter harness
  of the tests switches ``IS_GATHER_SUPPORTED`` off).
- **launches** of fla's private ``@triton.jit`` kernels on our grids: the asymmetric memory's intra-chunk matrices
  (:func:`asym_intra_fwd`) and, outside fla's safe envelope, its intra-chunk backward (:func:`asym_intra_bwd`).

A name that fla moved or removed is refused in one line that names the pinned version.
"""
from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import Tensor

FLA_PIN = "0.6.0"

NAMES: dict[str, str] = {
    # helpers that our kernels call or are built with
    "exp2": "fla.ops.utils.op",
    "RCP_LN2": "fla.ops.utils.constant",
    "autotune_cache_kwargs": "fla.utils",
    "prepare_chunk_indices": "fla.ops.utils",
    "prepare_chunk_offsets": "fla.ops.utils",
    "chunk_local_cumsum": "fla.ops.utils",
    # hardware and Triton flags
    "IS_GATHER_SUPPORTED": "fla.utils",
    "IS_NVIDIA_HOPPER": "fla.utils",
    "TRITON_ABOVE_3_4_0": "fla.utils",
    "TRITON_ABOVE_3_7_1": "fla.utils",
    # the asymmetric memory's launchers (fla.ops.precond_kda and the chunk state / output kernels it shares)
    "chunk_gated_delta_rule_fwd_h": "fla.ops.common.chunk_delta_h",
    "chunk_gated_delta_rule_bwd_dhu": "fla.ops.common.chunk_delta_h",
    "chunk_gla_fwd_o_gk": "fla.ops.gla.chunk",
    "chunk_precond_kda_bwd_dAv": "fla.ops.precond_kda.chunk_bwd",
    "recompute_w_u_fwd": "fla.ops.precond_kda.wy_fast",
    # the kernels of the intra-chunk launches below
    "DEFAULT_SOLVE_TRIL_PRECISION": "fla.ops.precond_kda.chunk_intra",
    "chunk_precond_kda_fwd_intra_token_parallel": "fla.ops.precond_kda.chunk_intra",
    "chunk_precond_kda_fwd_kernel_inter_solve_fused": "fla.ops.precond_kda.chunk_intra",
    "chunk_precond_kda_fwd_kernel_intra_sub_chunk": "fla.ops.precond_kda.chunk_intra",
    "chunk_precond_kda_bwd_kernel_intra": "fla.ops.precond_kda.chunk_intra",
    # the fused functions behind fla's modules and gates
    "l2norm": "fla.modules.norm.l2norm",
    "causal_conv1d": "fla.modules.causal_conv1d",
    "rms_norm": "fla.modules.norm.layernorm",
    "rms_norm_gated": "fla.modules.norm.fused_norm_gate",
    "fused_kda_gate": "fla.ops.kda.gate",
    "cross_entropy_fwd": "fla.modules.fused_cross_entropy.ops",
    "cross_entropy_bwd": "fla.modules.fused_cross_entropy.ops",
}


def _installed() -> str:
    try:
        from importlib.metadata import version

        return f"flash-linear-attention {version('flash-linear-attention')}"
    except Exception:  # noqa: BLE001 (any failure to read the metadata: say so, the refusal stays one line)
        return "no flash-linear-attention"


def resolve(name: str) -> Any:
    """fla's object :data:`NAMES` ``[name]``; refused in one line naming the pinned version when fla has no such
    object there (moved, removed, or fla missing)."""
    module = NAMES[name]
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        cause = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ImportError(f"fla's {module}.{name} is not in {_installed()} ({cause}): this code is written against "
                          f"its internals at flash-linear-attention=={FLA_PIN}; pip install "
                          f"flash-linear-attention=={FLA_PIN}") from None


def __getattr__(name: str) -> Any:
    if name in NAMES:
        return resolve(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def asym_intra_fwd(
    q: Tensor, k: Tensor, kappa: Tensor, gc: Tensor, beta: Tensor, scale: float, safe: bool,
    seqs: dict[str, Tensor | None], precise: bool = False,
) -> tuple[Tensor, Tensor]:
    """The intra-chunk matrices of fla's ``chunk_precond_kda_fwd_intra`` (its first two launches: the diagonal blocks,
    the fused inter-block + solve) with a separate write key ``kappa [B,T,H,K]``; its third, the WY representation
    (``recompute_w_u_fwd``), is the caller's (:func:`kdn.ops.triton.memory._asym_memory_fwd`). ``safe``: fla's
    tensor-core diagonal blocks, else its token loop; ``precise``: the TF32x3 copies
    (:func:`kdn.ops.triton.precision.maybe_precise`). Returns ``(Aqk, Akk)``, each ``[B,T,H,BT]`` in ``k``'s dtype
    (``Akk`` the inverse of the key matrix, its strict upper triangle zero)."""
    import triton

    from kdn.ops.triton.precision import maybe_precise
    from kdn.ops.validate import ASYM_CHUNK

    C = ASYM_CHUNK
    B, T, H, K = k.shape
    BC = 16
    NT = triton.cdiv(T, C) if seqs["chunk_indices"] is None else len(seqs["chunk_indices"])
    Aqk = torch.empty(B, T, H, C, device=k.device, dtype=k.dtype)
    Akk = torch.zeros(B, T, H, C, device=k.device, dtype=k.dtype)  # the kernels write its lower triangle only
    Akk_diag = torch.empty(B, T, H, BC, device=k.device, dtype=torch.float32)
    shift = 2.0 * resolve("RCP_LN2")
    if safe:
        maybe_precise(resolve("chunk_precond_kda_fwd_kernel_intra_sub_chunk"), precise)[(NT, C // BC, B * H)](
            q=q, k=k, k_precond=kappa, g=gc, beta=beta, Aqk=Aqk, Akk=Akk_diag, scale=scale, **seqs, T=T, H=H, K=K,
            BT=C, BC=BC, BK=triton.next_power_of_2(K), GATE_SHIFT=shift, USE_GATHER=resolve("IS_GATHER_SUPPORTED"))
    else:
        maybe_precise(resolve("chunk_precond_kda_fwd_intra_token_parallel"), precise)(
            q=q, k=k, k_precond=kappa, gk=gc, beta=beta, Aqk=Aqk, Akk=Akk_diag, scale=scale,
            cu_seqlens=seqs["cu_seqlens"], chunk_size=C, sub_chunk_size=BC)
    maybe_precise(resolve("chunk_precond_kda_fwd_kernel_inter_solve_fused"), precise)[(NT, B * H)](
        q=q, k=k, k_precond=kappa, g=gc, beta=beta, Aqk=Aqk, Akk_diag=Akk_diag, Akk=Akk, scale=scale, **seqs, T=T,
        H=H, K=K, BT=C, BC=BC, SOLVE_TRIL_DOT_PRECISION=resolve("DEFAULT_SOLVE_TRIL_PRECISION"), USE_SAFE_GATE=safe)
    return Aqk, Akk


def asym_intra_bwd(
    q: Tensor, k: Tensor, kappa: Tensor, gc: Tensor, beta: Tensor, dAqk: Tensor, dAkk: Tensor, dq: Tensor,
    dk: Tensor, dkg: Tensor, db: Tensor, dg: Tensor, safe: bool, seqs: dict[str, Tensor | None], precise: bool,
    dg_chunk_sums: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """fla's ``chunk_precond_kda_bwd_intra`` with a separate write key: its kernel (fla's tiles), then, when
    ``dg_chunk_sums``, ``dg``'s reverse cumulative sum within each chunk. Arguments and outputs as
    :func:`kdn.ops.triton.memory._asym_intra_bwd`'s; exact for any gate (``safe`` takes its tensor-core blocks)."""
    import triton

    from kdn.ops.triton.precision import maybe_precise
    from kdn.ops.validate import ASYM_CHUNK

    C = ASYM_CHUNK
    B, T, H, K = k.shape
    BC, BK = 16, min(32, triton.next_power_of_2(K))  # fla's tiles (docs/performance.md, "Memory and WY")
    NT = triton.cdiv(T, C) if seqs["chunk_indices"] is None else len(seqs["chunk_indices"])
    NK = triton.cdiv(K, BK)
    dq2, dk2, dkappa2 = torch.empty_like(q), torch.empty_like(k), torch.empty_like(kappa)
    db2 = beta.new_empty(NK, *beta.shape, dtype=torch.float)
    dg2 = torch.empty_like(dg, dtype=torch.float)
    maybe_precise(resolve("chunk_precond_kda_bwd_kernel_intra"), precise)[(NK * (C // BC) * NT, B * H)](
        q=q, k=k, k_precond=kappa, g=gc, beta=beta, dAqk=dAqk, dAkk=dAkk, dq=dq, dq2=dq2, dk=dk, dk2=dk2,
        dk_precond=dkg, dk_precond2=dkappa2, dg=dg, dg2=dg2, db=db2, **seqs, B=B, T=T, H=H, K=K, BT=C, BC=BC, BK=BK,
        NC=C // BC, SAFE_GATE=safe, GATE_SHIFT=2.0 * resolve("RCP_LN2"), USE_GATHER=resolve("IS_GATHER_SUPPORTED"))
    db = db2.sum(0).add_(db)
    if dg_chunk_sums:
        dg2 = resolve("chunk_local_cumsum")(dg2, chunk_size=C, reverse=True, **seqs)
    return dq2, dk2, dkappa2, db, dg2
