"""The key-block half of the inter-chunk + WY backward (:func:`kdn.ops.triton.wy.chunk_asym_bwd_wy_dqkg`) on Hopper's
asynchronous path, in TileLang: asynchronous copies into shared memory (``cp.async``; TMA from a producer warpgroup
as a setting, :class:`WYTiles`), ``wgmma`` with FP32 accumulators in registers.

It computes what the Triton ``_dqkg_kernel`` computes, for the same grid of work (one program per key block of 64,
chunk of 64 and head; the key blocks of one chunk in neighbouring programs, which share ``v_new, do, dv`` in L2):
``dq, dk, dkg, dg [*, H, K]`` (FP32) of the block, and its FP32 shares of ``dA`` and ``db``, which the Triton
``_dA_kernel`` sums. Formulas, shapes and the meaning of each tensor: :mod:`kdn.ops.triton.wy`.

Inputs travel flattened over batch and time (``[B*T, H, *]``; states ``[NTG, H, K, V]``, ``NTG`` the chunks of all
sequences), so one compiled kernel serves every ``B`` and ``T`` (both are run-time values). Packed sequences map a
program's chunk to its sequence through ``chunk_indices``; a chunk that ends before 64 rows reads the next rows of the
tensor (those of the next sequence, or zeros past the end) and masks them out of every sum and store.

Kernels are built per (``H, K, V``, dtypes, packing, tile settings) and compiled once per process; TileLang keeps
the compiled code on disk under ``TILELANG_CACHE_DIR``.
"""

import functools
from dataclasses import dataclass, replace
from typing import Any

import torch

from kdn.ops.validate import ASYM_CHUNK as BT  # the memory's chunk, 64

_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


@dataclass(frozen=True)
class WYTiles:
    """Tile settings of the TileLang WY kernel. The defaults are those the GPU tests ran and the fastest of the
    benchmark's sweep on Hopper (docs/results/README.md): whole value rows in one step, and every thread computing, its
    loads through ``cp.async``; the producer warpgroup's TMA path left nothing in flight between a program's loads
    and its dots and took 1.1-1.5x the time.

    Args:
        block_k: key columns per program (a divisor of ``K``; ``K // block_k`` shares of ``dA`` and ``db``).
        block_v: value columns per pipeline step (a divisor of ``V``).
        threads: threads of the compute warpgroup(s) (128 or 256).
        stages: pipeline depth over the value blocks.
        warp_specialized: a producer warpgroup issues TMA loads beside the compute warpgroups (TileLang's default on
            sm_90); ``False``: every thread computes, and loads go through ``cp.async`` (TileLang 0.1.8 cannot
            lower TMA without the producer).
    """

    block_k: int = 64
    block_v: int = 128
    threads: int = 128
    stages: int = 1
    warp_specialized: bool = False


def pass_configs(tiles: WYTiles) -> dict[str, bool]:
    """TileLang's pass settings for ``tiles``: without the producer warpgroup, TMA lowering is off too."""
    ws = tiles.warp_specialized
    return {"tl.disable_warp_specialized": not ws, "tl.disable_tma_lower": not ws}


def _program(H: int, K: int, V: int, in_dtype: str, beta_dtype: str, varlen: bool, tiles: WYTiles) -> Any:
    """The TileLang ``prim_func`` for one configuration (arguments as in :func:`wy_dqkg_tilelang`)."""
    import tilelang.language as T

    BK, BV = tiles.block_k, tiles.block_v
    NK, NV = K // BK, V // BV
    acc = "float32"
    NTOK, NTG, NSEQ = T.dynamic("NTOK, NTG, NSEQ")

    @T.prim_func
    def dqkg(
        q: T.Tensor((NTOK, H, K), in_dtype), k: T.Tensor((NTOK, H, K), in_dtype),
        kp: T.Tensor((NTOK, H, K), in_dtype), v_new: T.Tensor((NTOK, H, V), in_dtype),
        g: T.Tensor((NTOK, H, K), acc), beta: T.Tensor((NTOK, H), beta_dtype), A: T.Tensor((NTOK, H, BT), in_dtype),
        h: T.Tensor((NTG, H, K, V), in_dtype), do: T.Tensor((NTOK, H, V), in_dtype),
        dh: T.Tensor((NTG, H, K, V), in_dtype), dv: T.Tensor((NTOK, H, V), in_dtype),
        cu_seqlens: T.Tensor((NSEQ,), "int32"), chunk_indices: T.Tensor((NTG, 2), "int32"),
        scale: T.float32, seq_len: T.int32, chunks_per_seq: T.int32,
        dq: T.Tensor((NTOK, H, K), acc), dk: T.Tensor((NTOK, H, K), acc), dkg: T.Tensor((NTOK, H, K), acc),
        dg: T.Tensor((NTOK, H, K), acc), dA_part: T.Tensor((NK, NTG, H, BT, BT), acc),
        db_part: T.Tensor((NK, NTG, H, BT), acc),
    ):
        with T.Kernel(NK, NTG, H, threads=tiles.threads) as (i_k, i_tg, i_h):
            vn_s = T.alloc_shared((BT, BV), in_dtype)
            do_s = T.alloc_shared((BT, BV), in_dtype)
            dv_s = T.alloc_shared((BT, BV), in_dtype)
            h_s = T.alloc_shared((BK, BV), in_dtype)
            dh_s = T.alloc_shared((BK, BV), in_dtype)
            q_s = T.alloc_shared((BT, BK), in_dtype)
            k_s = T.alloc_shared((BT, BK), in_dtype)
            kp_s = T.alloc_shared((BT, BK), in_dtype)
            g_s = T.alloc_shared((BT, BK), acc)
            A_s = T.alloc_shared((BT, BT), in_dtype)
            kg_s = T.alloc_shared((BT, BK), in_dtype)
            dw_s = T.alloc_shared((BT, BK), in_dtype)
            beta_s = T.alloc_shared((BT,), acc)
            gn_s = T.alloc_shared((BK,), acc)
            dgk_s = T.alloc_shared((BK,), acc)
            cs_s = T.alloc_shared((BK,), acc)

            dq_f = T.alloc_fragment((BT, BK), acc)
            dkg_f = T.alloc_fragment((BT, BK), acc)
            dw_f = T.alloc_fragment((BT, BK), acc)
            hdh_f = T.alloc_fragment((BK, BV), acc)
            dgk_f = T.alloc_fragment((BK,), acc)
            dkgb_f = T.alloc_fragment((BT, BK), acc)
            dA_f = T.alloc_fragment((BT, BT), acc)
            t_f = T.alloc_fragment((BT, BK), acc)
            db_f = T.alloc_fragment((BT,), acc)
            colsum_f = T.alloc_fragment((BK,), acc)

            if varlen:
                i_n = chunk_indices[i_tg, 0]
                i_t = chunk_indices[i_tg, 1]
                bos = cu_seqlens[i_n]
                n_rows = cu_seqlens[i_n + 1] - bos
            else:
                i_t = i_tg % chunks_per_seq
                bos = (i_tg // chunks_per_seq) * seq_len
                n_rows = seq_len
            row0 = bos + i_t * BT
            n_valid = T.min(n_rows - i_t * BT, BT)
            k0 = i_k * BK

            T.clear(dq_f)
            T.clear(dkg_f)
            T.clear(dw_f)
            T.clear(dgk_f)
            for i_v in T.Pipelined(NV, num_stages=tiles.stages):
                T.copy(v_new[row0:row0 + BT, i_h, i_v * BV:(i_v + 1) * BV], vn_s)
                T.copy(do[row0:row0 + BT, i_h, i_v * BV:(i_v + 1) * BV], do_s)
                T.copy(dv[row0:row0 + BT, i_h, i_v * BV:(i_v + 1) * BV], dv_s)
                T.copy(h[i_tg, i_h, k0:k0 + BK, i_v * BV:(i_v + 1) * BV], h_s)
                T.copy(dh[i_tg, i_h, k0:k0 + BK, i_v * BV:(i_v + 1) * BV], dh_s)
                T.gemm(do_s, h_s, dq_f, transpose_B=True)
                T.gemm(vn_s, dh_s, dkg_f, transpose_B=True)
                T.gemm(dv_s, h_s, dw_f, transpose_B=True)
                for i, j in T.Parallel(BK, BV):
                    hdh_f[i, j] = T.cast(h_s[i, j], acc) * T.cast(dh_s[i, j], acc)
                T.reduce_sum(hdh_f, dgk_f, dim=1, clear=False)

            T.copy(q[row0:row0 + BT, i_h, k0:k0 + BK], q_s)
            T.copy(k[row0:row0 + BT, i_h, k0:k0 + BK], k_s)
            T.copy(kp[row0:row0 + BT, i_h, k0:k0 + BK], kp_s)
            T.copy(g[row0:row0 + BT, i_h, k0:k0 + BK], g_s)
            T.copy(A[row0:row0 + BT, i_h, 0:BT], A_s)
            for i in T.Parallel(BT):
                beta_s[i] = T.if_then_else(i < n_valid, T.cast(beta[row0 + i, i_h], acc), 0.0)
            for j in T.Parallel(BK):
                gn_s[j] = g[row0 + n_valid - 1, i_h, k0 + j]
            # rows past the chunk's end leave the WY product: A's rows t (columns of A^T) masked
            for i, j in T.Parallel(BT, BT):
                A_s[i, j] = T.if_then_else(i < n_valid, A_s[i, j], T.cast(0, in_dtype))
            for i, j in T.Parallel(BT, BK):
                kg_s[i, j] = T.cast(T.cast(k_s[i, j], acc) * T.exp2(g_s[i, j]), in_dtype)
                dw_s[i, j] = T.cast(-dw_f[i, j], in_dtype)
            T.clear(dA_f)
            T.clear(dkgb_f)
            T.gemm(dw_s, kg_s, dA_f, transpose_B=True)  # dw kg^T [BT, BT]
            T.gemm(A_s, dw_s, dkgb_f, transpose_A=True)  # A^T dw [BT, BK]

            for i, j in T.Parallel(BT, BK):
                t_f[i, j] = dkgb_f[i, j] * T.cast(k_s[i, j], acc) * T.exp2(g_s[i, j])
            T.reduce_sum(t_f, db_f, dim=1)
            # kp * exp2(gn - g) * dkg_raw, zero past the chunk's end
            for i, j in T.Parallel(BT, BK):
                t_f[i, j] = T.if_then_else(
                    i < n_valid, T.cast(kp_s[i, j], acc) * T.exp2(gn_s[j] - g_s[i, j]) * dkg_f[i, j], 0.0)
            T.reduce_sum(t_f, colsum_f, dim=0)
            T.copy(colsum_f, cs_s)
            T.copy(dgk_f, dgk_s)
            for j in T.Parallel(BK):
                dgk_s[j] = dgk_s[j] * T.exp2(gn_s[j]) + cs_s[j]

            for i, j in T.Parallel(BT, BK):
                if i < n_valid:
                    gk = T.exp2(g_s[i, j])
                    dq_ij = dq_f[i, j] * gk * scale
                    kg_ij = T.cast(k_s[i, j], acc) * gk
                    dq[row0 + i, i_h, k0 + j] = dq_ij
                    dk[row0 + i, i_h, k0 + j] = dkgb_f[i, j] * gk * beta_s[i]
                    dkg[row0 + i, i_h, k0 + j] = dkg_f[i, j] * T.exp2(gn_s[j] - g_s[i, j])
                    dg[row0 + i, i_h, k0 + j] = (
                        T.cast(q_s[i, j], acc) * dq_ij - t_f[i, j] + kg_ij * dkgb_f[i, j] * beta_s[i]
                        + T.if_then_else(i == n_valid - 1, dgk_s[j], 0.0))
            T.copy(dA_f, dA_part[i_k, i_tg, i_h, 0:BT, 0:BT])
            T.copy(db_f, db_part[i_k, i_tg, i_h, 0:BT])

    return dqkg


@functools.cache
def _kernel(H: int, K: int, V: int, in_dtype: str, beta_dtype: str, varlen: bool, tiles: WYTiles) -> Any:
    """The compiled kernel of one configuration (once per process; TileLang's disk cache across processes)."""
    import tilelang

    return tilelang.compile(_program(H, K, V, in_dtype, beta_dtype, varlen, tiles), target="cuda",
                            pass_configs=pass_configs(tiles))


def fit(tiles: WYTiles, K: int, V: int) -> WYTiles:
    """``tiles`` with its blocks cut to ``K`` and ``V`` where those are smaller."""
    return replace(tiles, block_k=min(tiles.block_k, K), block_v=min(tiles.block_v, V))


def supports(*tensors: torch.Tensor, beta: torch.Tensor, tiles: WYTiles = WYTiles()) -> bool:
    """Whether :func:`wy_dqkg_tilelang` takes these inputs: ``tensors`` (``k`` first, then ``v`` or any other
    ``[..., V]`` input and the states) on a Hopper GPU (sm_90), all of one 16-bit dtype, ``K`` and ``V`` multiples of
    64 and of the blocks of :func:`fit`; ``beta`` 16-bit or FP32; TileLang importable."""
    k, v = tensors[0], tensors[1]
    K, V = k.shape[-1], v.shape[-1]
    if not (k.is_cuda and torch.cuda.get_device_capability(k.device) == (9, 0)):
        return False
    if k.dtype not in (torch.bfloat16, torch.float16) or any(t.dtype != k.dtype for t in tensors):
        return False
    tiles = fit(tiles, K, V)
    if beta.dtype not in _DTYPES or K % 64 or V % 64 or K % tiles.block_k or V % tiles.block_v:
        return False
    try:
        import tilelang  # noqa: F401
    except ImportError:
        return False
    return True


def wy_dqkg_tilelang(
    q: torch.Tensor, k: torch.Tensor, k_precond: torch.Tensor, v_new: torch.Tensor, g: torch.Tensor,
    beta: torch.Tensor, A: torch.Tensor, h: torch.Tensor, do: torch.Tensor, dh: torch.Tensor, dv: torch.Tensor,
    scale: float, cu_seqlens: torch.Tensor | None, chunk_indices: torch.Tensor | None, tiles: WYTiles = WYTiles(),
) -> tuple[torch.Tensor, ...]:
    """The key-block kernel of the WY backward: ``dq, dk, dkg, dg [B,T,H,K]`` (FP32) and the shares
    ``dA_part [NK, NTG, H, 64, 64]``, ``db_part [NK, NTG, H, 64]`` (FP32) for :mod:`kdn.ops.triton.wy`'s ``_dA_kernel``.

    Args:
        q, k, k_precond: ``[B,T,H,K]``, 16-bit. v_new, do, dv: ``[B,T,H,V]``, ``k``'s dtype. g: ``[B,T,H,K]`` FP32,
            the gate's cumulative sum within each chunk (log2). beta: ``[B,T,H]``. A: ``[B,T,H,64]``, the WY inverse.
        h, dh: ``[B,NT,H,K,V]`` (``B = 1`` and all chunks when packed), the chunk states and their gradients.
        scale: the output scale. cu_seqlens: ``[N+1]`` or None. chunk_indices: ``[NTG, 2]`` (sequence, chunk) or
            None (required with ``cu_seqlens``). tiles: :class:`WYTiles`.

    Returns:
        ``(dq, dk, dkg, dg, dA_part, db_part)``.
    """
    B, T, H, K = k.shape
    V = v_new.shape[-1]
    tiles = fit(tiles, K, V)
    varlen = cu_seqlens is not None
    NT = -(-T // BT)
    NTG = len(chunk_indices) if varlen else B * NT
    flat = [x.contiguous().reshape(B * T, *x.shape[2:]) for x in (q, k, k_precond, v_new, g, beta, A, do, dv)]
    states = [x.contiguous().reshape(NTG, H, K, V) for x in (h, dh)]
    if varlen:
        seqs = (cu_seqlens.to(torch.int32), chunk_indices.to(torch.int32).contiguous())
    else:  # unread placeholders of the packed path's arguments (empty: nothing to fill)
        seqs = (k.new_empty(2, dtype=torch.int32), k.new_empty(NTG, 2, dtype=torch.int32))
    dq, dk, dkg, dg = (torch.empty(B, T, H, K, device=k.device, dtype=torch.float) for _ in range(4))
    NK = K // tiles.block_k
    dA_part = k.new_empty(NK, NTG, H, BT, BT, dtype=torch.float)
    db_part = k.new_empty(NK, NTG, H, BT, dtype=torch.float)
    kernel = _kernel(H, K, V, _DTYPES[k.dtype], _DTYPES[beta.dtype], varlen, tiles)
    q_, k_, kp_, vn_, g_, beta_, A_, do_, dv_ = flat
    kernel(q_, k_, kp_, vn_, g_, beta_, A_, states[0], do_, states[1], dv_, *seqs, float(scale), T, NT,
           *(x.view(B * T, H, K) for x in (dq, dk, dkg, dg)), dA_part, db_part)
    return dq, dk, dkg, dg, dA_part, db_part
