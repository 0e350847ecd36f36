"""The asymmetric memory's forward after its intra-chunk matrices in one launch: fla 0.6.0's ``recompute_w_u_fwd``
(the WY terms, optionally), ``chunk_gated_delta_rule_fwd_h`` (the serial pass over chunks) and ``chunk_gla_fwd_o_gk``
(the output) as one program per (value block, sequence, head), the same values.

fla's state kernel writes every chunk's entering state ``h [B,NT,H,K,V]`` and the corrected values
``v_new = u - w h`` for the output kernel to read back. Here the state stays in registers: each chunk's output
``o = scale (q exp2(gc)) h + tril(Aqk) v_new`` is made as the state reaches the chunk, then the state moves on
(``h <- exp2(gc_last) h + kg^T v_new``). ``h`` and ``v_new`` are written only when the backward needs them
(``save_states``): a forward without gradients (evaluation's prefill) writes neither. The output's dots do not feed the
chain from chunk to chunk, so they overlap its latency instead of adding a launch that reads ``h`` and ``v_new``
back.

:func:`chunk_wy_state_output` also makes the WY terms inside the walk, from the chunk's ``Akk`` (the inverse of the
intra-chunk key matrix): ``w = Akk (beta k exp2(gc))``, ``u = Akk (beta v)``, ``kg = kappa exp2(gc_last - gc)``,
``qg = q exp2(gc)``, each rounded to its input's dtype where fla stores it. Those dots and loads do not depend on the
state either; ``w``, ``qg`` and ``kg`` are written (by the first value block's program) only when the backward keeps
them, and ``u`` never leaves the program.

Shapes (``B = 1`` with ``cu_seqlens``; ``NT`` chunks of ``BT = 64`` rows in all): ``q, k, kappa, kg, w, gc
[B,T,H,K]`` (``gc`` the gate's cumulative sums within each chunk, log2 units, FP32; ``kg`` the write keys gated to the
chunk's end), ``u, v [B,T,H,V]``, ``beta [B,T,H]``, ``Aqk, Akk [B,T,H,BT]`` (the intra-chunk output matrix, scale
included, and the WY inverse), ``h0 [N,H,K,V]`` FP32 or ``None``. ``qg = q exp2(gc)`` (``q``'s dtype), when the
caller has it, is read instead of ``q`` and ``gc``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kdn.ops.fla_internals import autotune_cache_kwargs, exp2, prepare_chunk_offsets
from kdn.ops.triton.utils import kernel_choice


@triton.autotune(
    configs=[triton.Config({"BV": bv}, num_warps=w, num_stages=s) for bv in (32, 64) for w in (2, 4, 8)
             for s in (2, 3)],
    key=["H", "K", "V", "BT", "USE_QG", "SAVE_STATES", "FUSE_WY"],
    **autotune_cache_kwargs,
)
@triton.jit(do_not_specialize=["T"])
def _state_output_kernel(q, qg, gc, kg, w, u, k, kappa, v, beta, Akk, Aqk, h0, h, v_new, o, ht, cu_seqlens,
                         chunk_offsets, scale, T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                         BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_QG: tl.constexpr,
                         USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
                         SAVE_STATES: tl.constexpr, FUSE_WY: tl.constexpr, IS_VARLEN: tl.constexpr):
    """One value block of one (sequence, head): every chunk's output, and ``h, v_new`` when ``SAVE_STATES``.
    ``FUSE_WY``: the WY terms from ``k, kappa, v, beta, Akk`` (``w, qg, kg`` written when ``SAVE_STATES``), else
    read from ``w, u, kg`` (and ``qg`` when ``USE_QG``)."""
    i_v, i_nh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_n, i_h = i_nh // H, i_nh % H
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
        boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        bos = i_n * T
        boh = i_n * tl.cdiv(T, BT)
    NT = tl.cdiv(T, BT)

    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    o_kv = o_k[:, None] * V + o_v[None, :]
    o_r = tl.arange(0, BT)
    m_s = o_r[:, None] >= o_r[None, :]
    # the first value block's program stores the WY terms: a mask, not a branch inside the pipelined chunk loop
    m_first = tl.full([BK], i_v, tl.int64) == 0

    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_h += tl.load(h0 + i_nh * K * V + o_kv, mask=m_kv, other=0.0).to(tl.float32)

    x_k = (bos * H + i_h) * K  # the sequence's first row of a [B,T,H,K] tensor
    x_v = (bos * H + i_h) * V
    x_a = (bos * H + i_h) * BT
    for i_t in range(NT):
        o_t = i_t * BT + o_r
        m_t = o_t < T
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        p_tk = x_k + o_t[:, None] * (H * K) + o_k[None, :]
        p_tv = x_v + o_t[:, None] * (H * V) + o_v[None, :]
        i_last = tl.minimum(i_t * BT + BT, T) - 1
        b_gl = tl.load(gc + x_k + i_last.to(tl.int64) * (H * K) + o_k, mask=m_k, other=0.0).to(tl.float32)
        if SAVE_STATES:
            tl.store(h + ((boh + i_t) * H + i_h) * K * V + o_kv, b_h.to(h.dtype.element_ty), mask=m_kv)
        if FUSE_WY:  # fla's recompute_w_u_fwd for this chunk, its roundings included
            b_b = tl.load(beta + (bos + o_t) * H + i_h, mask=m_t, other=0.0)
            b_Akk = tl.load(Akk + x_a + o_t[:, None] * (H * BT) + o_r[None, :], mask=m_t[:, None], other=0.0)
            b_g = tl.load(gc + p_tk, mask=m_tk, other=0.0).to(tl.float32)
            b_k = tl.load(k + p_tk, mask=m_tk, other=0.0)
            b_kb = b_k * b_b[:, None]
            b_kb *= exp2(b_g)
            b_w = tl.dot(b_Akk, b_kb.to(b_k.dtype)).to(b_k.dtype)
            b_vv = tl.load(v + p_tv, mask=m_tv, other=0.0)
            b_u = tl.dot(b_Akk, (b_vv * b_b[:, None]).to(b_vv.dtype)).to(b_vv.dtype)
            b_q = tl.load(q + p_tk, mask=m_tk, other=0.0)
            b_qg = (b_q * exp2(b_g)).to(b_q.dtype)
            b_kp = tl.load(kappa + p_tk, mask=m_tk, other=0.0)
            b_kg = (b_kp * tl.where(m_t[:, None], exp2(b_gl[None, :] - b_g), 0)).to(b_kp.dtype)
            if SAVE_STATES:  # the first value block's program keeps the WY terms for the backward
                m_wy = m_tk & m_first[None, :]
                tl.store(w + p_tk, b_w, mask=m_wy)
                tl.store(qg + p_tk, b_qg, mask=m_wy)
                tl.store(kg + p_tk, b_kg, mask=m_wy)
            b_kg = tl.trans(b_kg)
        else:
            b_w = tl.load(w + p_tk, mask=m_tk, other=0.0)
            b_u = tl.load(u + p_tv, mask=m_tv, other=0.0)
            if USE_QG:
                b_qg = tl.load(qg + p_tk, mask=m_tk, other=0.0)
            else:
                b_q = tl.load(q + p_tk, mask=m_tk, other=0.0)
                b_qg = (b_q * exp2(tl.load(gc + p_tk, mask=m_tk, other=0.0).to(tl.float32))).to(b_q.dtype)
            b_kg = tl.load(kg + x_k + o_t[None, :] * (H * K) + o_k[:, None], mask=m_k[:, None] & m_t[None, :],
                           other=0.0)
        b_vn = b_u - tl.dot(b_w, b_h.to(b_w.dtype))
        if SAVE_STATES:
            tl.store(v_new + p_tv, b_vn.to(v_new.dtype.element_ty), mask=m_tv)
        b_vn = b_vn.to(b_u.dtype)  # fla's output reads v_new as stored, in u's dtype
        # the output of the chunk: its entering state through the gated queries, then the chunk's own tokens
        b_o = tl.dot(b_qg, b_h.to(b_qg.dtype)) * scale
        b_A = tl.load(Aqk + x_a + o_t[:, None] * (H * BT) + o_r[None, :], mask=m_t[:, None], other=0.0)
        b_A = tl.where(m_s, b_A, 0.0).to(b_vn.dtype)
        b_o = tl.dot(b_A, b_vn, b_o)
        tl.store(o + p_tv, b_o.to(o.dtype.element_ty), mask=m_tv)
        # the state at the chunk's end
        b_h *= exp2(b_gl)[:, None]
        b_h = tl.dot(b_kg, b_vn.to(b_kg.dtype), b_h)
    if STORE_FINAL_STATE:
        tl.store(ht + i_nh * K * V + o_kv, b_h.to(ht.dtype.element_ty), mask=m_kv)


KERNELS = ("auto", "wy", "fused", "fla")


def state_output_kernel(kernel: str | None = None, device: torch.device | None = None) -> str:
    """Which launches follow the memory's intra-chunk matrices on ``device``: ``"wy"`` (:func:`chunk_wy_state_output`:
    the WY terms, chunk states and output in one launch; not yet verified on a GPU, docs/results/recurrence.md),
    ``"fused"`` (fla's WY launch, then
    :func:`chunk_state_output`) or ``"fla"`` (fla's three). ``kernel`` ``"auto"`` (the default) takes ``"fused"`` on
    sm_90 and later, where it was measured faster (docs/results/recurrence.md), fla's elsewhere; None reads
    ``KDN_STATE_KERNEL``."""
    kernel = kernel_choice(kernel, "KDN_STATE_KERNEL", KERNELS, "state and output kernel")
    if kernel != "auto":
        return kernel
    hopper = device is not None and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
    return "fused" if hopper else "fla"


def _launch(ref: Tensor, u_or_v: Tensor, scale: float, initial_state: Tensor | None, output_final_state: bool,
            save_states: bool, cu_seqlens: Tensor | None, chunk_indices: Tensor | None, chunk_size: int,
            fuse_wy: bool, **tensors: Tensor | None) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """Allocate ``o`` and the kept states for keys shaped like ``ref [B,T,H,K]`` and values like ``u_or_v``, then
    launch :func:`_state_output_kernel` on ``tensors`` (its pointer arguments, None where unused)."""
    B, T, H, K, V = *ref.shape, u_or_v.shape[-1]
    BT = chunk_size
    if cu_seqlens is None:
        N, NT, offsets = B, triton.cdiv(T, BT), None
    else:
        offsets = prepare_chunk_offsets(cu_seqlens, BT)
        N, NT = len(cu_seqlens) - 1, int(offsets[-1]) if chunk_indices is None else len(chunk_indices)
    h = ref.new_empty(B, NT, H, K, V) if save_states else None
    v_new = torch.empty_like(u_or_v) if save_states else None
    o = torch.empty_like(u_or_v)
    ht = ref.new_empty(N, H, K, V, dtype=torch.float32) if output_final_state else None
    args = {n: tensors.get(n) for n in ("q", "qg", "gc", "kg", "w", "u", "k", "kappa", "v", "beta", "Akk", "Aqk")}

    def grid(meta: dict) -> tuple[int, int]:
        return triton.cdiv(V, meta["BV"]), N * H

    _state_output_kernel[grid](
        **args, h0=initial_state, h=h, v_new=v_new, o=o, ht=ht, cu_seqlens=cu_seqlens, chunk_offsets=offsets,
        scale=scale, T=T, H=H, K=K, V=V, BT=BT, BK=max(16, triton.next_power_of_2(K)),
        USE_QG=args["qg"] is not None and not fuse_wy, USE_INITIAL_STATE=initial_state is not None,
        STORE_FINAL_STATE=output_final_state, SAVE_STATES=save_states, FUSE_WY=fuse_wy,
        IS_VARLEN=cu_seqlens is not None)
    return o, h, v_new, ht


def chunk_state_output(
    q: Tensor, kg: Tensor, w: Tensor, u: Tensor, gc: Tensor, Aqk: Tensor, scale: float,
    initial_state: Tensor | None = None, output_final_state: bool = False, save_states: bool = True,
    qg: Tensor | None = None, cu_seqlens: Tensor | None = None, chunk_indices: Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """fla's ``chunk_gated_delta_rule_fwd_h`` + ``chunk_gla_fwd_o_gk`` in one launch (module docstring).

    Args:
        q, kg, w: ``[B,T,H,K]``; u: ``[B,T,H,V]``; gc: ``[B,T,H,K]`` FP32; Aqk: ``[B,T,H,BT]``.
        scale: multiplies the queries' inter-chunk term (``Aqk`` holds it already).
        initial_state: ``[N,H,K,V]`` FP32 or None. output_final_state: return ``S_T [N,H,K,V]`` (FP32).
        save_states: write ``h`` and ``v_new`` for the backward. qg: ``q exp2(gc)``, read instead of ``q, gc``.
        cu_seqlens: ``[N+1]`` packed sequences (``B = 1``); chunk_indices: fla's ``prepare_chunk_indices`` of them,
            whose length is the number of chunks (read from the offsets, a host sync, when not given).

    Returns:
        ``(o [B,T,H,V] in u's dtype, h [B,NT,H,K,V] in kg's dtype or None, v_new [B,T,H,V] or None, S_T or None)``.

    Example::

        o, h, v_new, S = chunk_state_output(q, kg, w, u, gc, Aqk, scale=K ** -0.5, output_final_state=True)
    """
    return _launch(kg, u, scale, initial_state, output_final_state, save_states, cu_seqlens, chunk_indices,
                   chunk_size, False, q=q, qg=qg, gc=gc, kg=kg, w=w, u=u, Aqk=Aqk)


def chunk_wy_state_output(
    q: Tensor, k: Tensor, kappa: Tensor, v: Tensor, beta: Tensor, gc: Tensor, Akk: Tensor, Aqk: Tensor,
    scale: float, initial_state: Tensor | None = None, output_final_state: bool = False, save_states: bool = True,
    cu_seqlens: Tensor | None = None, chunk_indices: Tensor | None = None, chunk_size: int = 64,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """fla's ``recompute_w_u_fwd`` + ``chunk_gated_delta_rule_fwd_h`` + ``chunk_gla_fwd_o_gk`` in one launch (module
    docstring).

    Args:
        q, k, kappa: ``[B,T,H,K]`` (queries, read and write keys); v: ``[B,T,H,V]``; beta: ``[B,T,H]``;
            gc: ``[B,T,H,K]`` FP32; Akk, Aqk: ``[B,T,H,BT]`` (fla's intra-chunk forward).
        scale, initial_state, output_final_state, cu_seqlens, chunk_indices: as :func:`chunk_state_output`.
        save_states: write ``h``, ``v_new`` and the WY terms ``w``, ``qg``, ``kg`` for the backward.

    Returns:
        ``(o, h, v_new, S_T, w, qg, kg)``: the first four as :func:`chunk_state_output`'s (``h`` in ``kappa``'s
        dtype), then ``w`` (``k``'s dtype), ``qg`` (``q``'s) and ``kg`` (``kappa``'s), each ``[B,T,H,K]`` or None
        unless ``save_states``.

    Example::

        o, h, v_new, S, w, qg, kg = chunk_wy_state_output(q, k, k, v, beta, gc, Akk, Aqk, scale=K ** -0.5)
    """
    wy = {n: torch.empty_like(x) if save_states else None for n, x in (("w", k), ("qg", q), ("kg", kappa))}
    o, h, v_new, ht = _launch(kappa, v, scale, initial_state, output_final_state, save_states, cu_seqlens,
                              chunk_indices, chunk_size, True, q=q, gc=gc, k=k, kappa=kappa, v=v, beta=beta,
                              Akk=Akk, Aqk=Aqk, **wy)
    return o, h, v_new, ht, wy["w"], wy["qg"], wy["kg"]
