"""The public functional API of KDN (docs/math.md §1–6): validation and dispatch.

``diagonal_kdn`` / ``isotropic_kdn`` validate their inputs, handle packed sequences (``cu_seqlens``) and dispatch
to a backend: ``"torch"`` (the chunked PyTorch path, :mod:`kdn.ops.torch_chunk`, any device) or ``"triton"`` (the CUDA
kernels, :mod:`kdn.ops.chunk`). ``*_gain`` run the gain scans alone, ``*_step`` one decoding token (the fused
Triton step, :mod:`kdn.ops.fused_recurrent`, on CUDA without autograd; else :mod:`kdn.ops.naive`), and
``exact_kalman_memory`` the dense-covariance reference. Computation is in FP32 (float64 when given float64);
outputs come back in ``v``'s dtype, states in the compute dtype. Every entry point takes the tensors
``q, k, v, g, omega, r`` first and its settings as keywords.

Dtypes: the inputs may mix bf16, fp16 and FP32 (the layers pass bf16 ``q, k, v`` beside FP32 gates), all computed in
FP32; float64 is the reference precision and must then be every input's dtype: a float64 tensor among lower-precision
ones is refused rather than silently rounded. ``mu`` and the initial state are cast to the compute dtype. Every size
(``B, T, H, K, V``) must be at least 1.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from kdn.ops import naive as _naive
from kdn.ops import torch_chunk as _chunk
from kdn.ops import torch_gain as _gain
from kdn.ops.gate import kda_gate
from kdn.ops.packing import repack, unpack
from kdn.ops.utils import State
from kdn.ops.validate import check_cu_seqlens, check_memory, check_precision, check_shape, check_values

BACKENDS = ("torch", "triton")


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _check_dtypes(tensors: dict[str, Tensor]) -> None:
    """Floating-point tensors, float64 for all of them or for none (see the module docstring)."""
    for name, x in tensors.items():
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    f64 = [n for n, x in tensors.items() if x.dtype == torch.float64]
    if f64 and len(f64) < len(tensors):
        other = next(n for n in tensors if n not in f64)
        raise ValueError(f"{f64[0]} is float64 but {other} is {tensors[other].dtype}: pass every tensor in float64 "
                         "(the reference precision) or none (bf16/fp16/FP32 mix, computed in FP32)")


def _check_sizes(names: str, shape: tuple[int, ...]) -> None:
    """Every size at least 1: ``names`` spells the dims of ``shape``, e.g. ``"B,T,H,K"``."""
    empty = [f"{n}=0" for n, s in zip(names.split(","), shape) if s == 0]
    if empty:
        raise ValueError(f"q has {', '.join(empty)} (shape [{names}] = {list(shape)}); every size must be at least 1")


def _mu_tensor(mu: float | Tensor | None, H: int, K: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``mu`` as an ``[H]`` tensor of ``dtype`` (on ``device`` unless given as a tensor); default ``K``."""
    if mu is None:
        mu = float(K)
    if isinstance(mu, Tensor):
        if mu.dim() == 0:
            mu = mu.expand(H)
        check_shape("mu", mu, (H,), "H")
        return mu.to(dtype)
    if not isinstance(mu, (int, float)):
        raise ValueError(f"mu must be a positive float or an [H] tensor, got {type(mu).__name__}")
    return torch.full((H,), float(mu), dtype=dtype, device=device)


def _check_inputs(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, omega: Tensor, r: Tensor, isotropic: bool
) -> tuple[int, int, int, int, int]:
    if not isinstance(q, Tensor) or q.dim() != 4:
        raise ValueError(f"q must be a [B,T,H,K] tensor, got shape {getattr(q, 'shape', None)}")
    B, T, H, K = q.shape
    if T == 0:
        raise ValueError("q has T=0 tokens; pass at least one token")
    _check_sizes("B,T,H,K", (B, T, H, K))
    check_shape("k", k, (B, T, H, K), "B,T,H,K")
    if not isinstance(v, Tensor) or v.dim() != 4 or tuple(v.shape[:3]) != (B, T, H):
        raise ValueError(f"v has shape {list(getattr(v, 'shape', []))}, expected [B,T,H,V] = [{B}, {T}, {H}, V]")
    check_shape("g", g, (B, T, H, K), "B,T,H,K")
    if isotropic:
        check_shape("omega", omega, (B, T, H), "B,T,H")
    else:
        check_shape("omega", omega, (B, T, H, K), "B,T,H,K")
    check_shape("r", r, (B, T, H), "B,T,H")
    if v.shape[-1] == 0:
        raise ValueError("v has V=0 value channels; every size must be at least 1")
    _check_dtypes({"q": q, "k": k, "v": v, "g": g, "omega": omega, "r": r})
    return B, T, H, K, v.shape[-1]


def _resolve_backend(backend: str | None, device: torch.device, dtype: torch.dtype) -> str:
    """None picks Triton for CUDA tensors below float64, PyTorch otherwise."""
    if backend is None:
        fast = device.type == "cuda" and dtype != torch.float64 and _triton_available()
        return "triton" if fast else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS} or None")
    if backend == "triton" and (device.type != "cuda" or not _triton_available()):
        raise ValueError("backend='triton' needs CUDA tensors and the kdn Triton kernels; use backend='torch'")
    return backend


def _triton_available() -> bool:
    try:
        from kdn.ops import chunk  # noqa: F401
    except ImportError:
        return False
    return True


def _run(
    kind: str,
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, omega: Tensor, r: Tensor,
    mu: float | Tensor | None, initial_state: State | None, output_final_state: bool,
    cu_seqlens: Tensor | None, backend: str | None, validate: bool, scale: float, omega_softplus: bool,
    gate: tuple[Tensor, Tensor] | None, memory: str, chunk_size: int | None, recompute_states: bool, precision: str,
) -> tuple[Tensor, State | None]:
    isotropic = kind == "isotropic"
    check_memory(memory, chunk_size)
    check_precision(precision, memory)
    if not isinstance(recompute_states, bool):
        raise ValueError(f"recompute_states must be True or False, got {recompute_states!r}")
    B, T, H, K, V = _check_inputs(q, k, v, g, omega, r, isotropic)
    if gate is not None:
        if not isinstance(gate, (tuple, list)) or len(gate) != 2:
            raise ValueError("gate must be a pair (A_log [H], dt_bias [H*K])")
        check_shape("gate[0] (A_log)", gate[0], (H,), "H")
        check_shape("gate[1] (dt_bias)", gate[1], (H * K,), "H*K")
    n_seq = B
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, T, B)
        n_seq = cu_seqlens.numel() - 1
    dt = _compute_dtype(v)
    mu_t = _mu_tensor(mu, H, K, dt, q.device)
    if initial_state is not None:
        if not isinstance(initial_state, (tuple, list)) or len(initial_state) != 2:
            raise ValueError("initial_state must be a pair (S [N,H,K,V], p [N,H,K] or b [N,H])")
        S0, p0 = initial_state
        if S0 is not None:
            check_shape("initial_state[0] (S)", S0, (n_seq, H, K, V), "N,H,K,V")
        if isotropic:
            check_shape("initial_state[1] (b)", p0, (n_seq, H), "N,H")
        else:
            check_shape("initial_state[1] (p)", p0, (n_seq, H, K), "N,H,K")
    else:
        S0, p0 = None, q.new_ones((n_seq, H) if isotropic else (n_seq, H, K), dtype=dt)
    if not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale must be a positive float (q is multiplied by it), got {scale!r}")
    if validate and not torch.compiler.is_compiling():  # one host sync; callers with trusted inputs skip it
        values = {"q": q, "k": k, "v": v, "g": g, "omega": omega, "r": r, "mu": mu_t, "initial_state[1] (p/b)": p0}
        if S0 is not None:
            values["initial_state[0] (S)"] = S0
        check_values(values, nonpositive=() if gate is not None else ("g",),
                     nonnegative=() if omega_softplus else ("omega",), positive=("r", "mu", "initial_state[1] (p/b)"))
    backend = _resolve_backend(backend, q.device, dt)
    # both Triton KDNs apply KDA's gate themselves on the asymmetric memory (Isotropic KDN's only memory); every
    # other route gets g
    fused_gate = gate is not None and backend == "triton" and memory == "asym"
    if gate is not None and not fused_gate:
        g = kda_gate(g, *gate)
    # the Diagonal Triton gain applies omega's softplus itself (packed sequences too, unless they are unpacked
    # for the DPLR memory); every other route gets omega
    fused_softplus = omega_softplus and backend == "triton" and not isotropic and (
        cu_seqlens is None or memory == "asym")
    if omega_softplus and not fused_softplus:
        omega = F.softplus(omega.to(dt))
    if backend == "triton":  # kernels take bf16 operands as they come and keep FP32 gates and states
        from kdn.ops import chunk as _triton

        if isotropic:
            run = partial(_triton.chunk_isotropic_kdn, recompute_states=recompute_states, precision=precision,
                          gate=gate if fused_gate else None)
        else:
            run = partial(_triton.chunk_diagonal_kdn, memory=memory, chunk_size=chunk_size,
                          recompute_states=recompute_states, omega_softplus=fused_softplus,
                          gate=gate if fused_gate else None, precision=precision)
        # a zero initial memory travels as None: the memory kernels then skip reading it
        args, state = [q, k, v, g, omega, r], (None if S0 is None else S0.float(), p0.float())
        mu_t = mu_t.float()
        run = partial(run, scale=float(scale), output_final_state=output_final_state)
    else:
        fn: Callable = _chunk.torch_isotropic_kdn if isotropic else _chunk.torch_diagonal_kdn
        S0 = q.new_zeros(n_seq, H, K, V, dtype=dt) if S0 is None else S0.to(dt)
        args, state = [x.to(dt) for x in (q * scale if scale != 1.0 else q, k, v, g, omega, r)], (S0, p0.to(dt))
        run = partial(_without_autocast, fn)
    if cu_seqlens is None:
        o, final = run(*args, mu_t, state)
    elif backend == "triton" and (isotropic or memory == "asym"):  # the kernels take the offsets
        o, final = run(*args, mu_t, state, cu_seqlens=cu_seqlens.to(device=q.device, dtype=torch.long))
    else:  # the PyTorch path and fla's DPLR memory run packed sequences as a padded batch
        o, final = _varlen(run, args, mu_t, state, cu_seqlens)
    return o.to(v.dtype), (final if output_final_state else None)


def _without_autocast(fn: Callable, *args: object, **kwargs: object) -> tuple[Tensor, State]:
    """The PyTorch path in its own dtype (FP32 or float64) even inside an autocast region."""
    with torch.autocast("cuda", enabled=False), torch.autocast("cpu", enabled=False):
        return fn(*args, **kwargs)


def _varlen(fn: Callable, args: list[Tensor], mu: Tensor, state: tuple, cu_seqlens: Tensor) -> tuple[Tensor, State]:
    """Unpack ``[1, T]`` packed sequences into a right-padded batch and back.

    Padding steps are exact identities (zero key and value, ``g = 0``, ``omega = 0``, ``r = 1``), so
    each sequence's final state is read after its last real token.
    """
    fills = (0.0, 0.0, 0.0, 0.0, 0.0, 1.0)  # q, k, v, g, omega, r
    o, final = fn(*(unpack(x, cu_seqlens, f) for x, f in zip(args, fills)), mu, state)
    return repack(o, cu_seqlens), final


def diagonal_kdn(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, omega: Tensor, r: Tensor, *,
    mu: float | Tensor | None = None,
    initial_state: State | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    backend: str | None = None,
    validate: bool = True,
    scale: float = 1.0,
    omega_softplus: bool = False,
    gate: tuple[Tensor, Tensor] | None = None,
    memory: str = "asym",
    chunk_size: int | None = None,
    recompute_states: bool = False,
    precision: str = "bf16",
) -> tuple[Tensor, State | None]:
    """Diagonal KDN (docs/math.md §3): per-channel uncertainty ``p [K]`` per head, gain ``kappa`` on the write side.

    Args:
        q, k, g, omega: ``[B,T,H,K]`` (``g = log(alpha) <= 0``, ``omega >= 0``); v: ``[B,T,H,V]``;
            r: ``[B,T,H]`` (``> 0``).
        mu: float or ``[H]`` (default ``K``).
        initial_state: ``(S [N,H,K,V], p [N,H,K])`` (default ``S = 0, p = 1``; ``S = None`` means a zero memory).
        output_final_state: return the final ``(S, p)``.
        cu_seqlens: ``[N+1]`` offsets of packed sequences (``B = 1``); else ``N = B``.
        backend: ``"torch"``, ``"triton"`` or ``None`` (Triton for CUDA tensors below float64).
        validate: ``False`` skips the value checks (NaN/Inf and ranges; shapes are always checked), which cost
            one host sync: for callers whose inputs are valid by construction, such as the layers.
        scale: multiplies ``q`` (the kernels fold it in; the layers pass ``K^-0.5``).
        omega_softplus: ``omega`` is given before its softplus (any real values; the Diagonal CUDA kernels apply it
            in FP32 and save a pass over ``[B,T,H,K]`` each way; other routes apply it first).
        gate: ``(A_log [H], dt_bias [H*K])``: ``g`` holds the input ``f`` of KDA's gate (any real values) and
            ``g = -exp(A_log) softplus(f + dt_bias)`` (:func:`kdn.ops.gate.kda_gate`, differentiable in both
            parameters). The CUDA kernels of both KDNs (on the asymmetric memory) apply it in FP32 in one pass with
            the memory's chunk sums (:mod:`kdn.ops.triton.gate`) and take its backward into the gain's (as fla's
            ``chunk_kda(use_gate_in_kernel=True)`` does for KDA); other routes apply it first.
        memory: the CUDA memory route, ``"asym"`` (fla's asymmetric chunk-64 kernels, the faster) or ``"dplr"``
            (fla's DPLR kernels); checked on every backend, used by ``"triton"``.
        chunk_size: the memory's chunk: ``None`` or 64 for ``"asym"``, 16 (default) or 32 for ``"dplr"``.
        recompute_states: the ``"asym"`` memory's backward recomputes its WY terms and chunk states instead of
            keeping them from the forward (less memory, slower; ``"triton"`` only).
        precision: the CUDA memory's, ``"bf16"`` (operands and gain in the inputs' dtype, bf16 from the layers; the
            faster) or ``"fp32"`` (FP32 operands and gain, TF32x3 dots; ``memory="asym"`` only): docs/kernels.md,
            "Precision". Checked on every backend, used by ``"triton"`` (the PyTorch path computes in FP32).

    Returns:
        ``o [B,T,H,V]`` in ``v``'s dtype and, if ``output_final_state``, the final ``(S, p)`` (else ``None``).

    Example::

        B, T, H, K = 2, 64, 4, 32
        q, k = (F.normalize(torch.randn(B, T, H, K), dim=-1) for _ in range(2))
        v = torch.randn(B, T, H, K)
        g = -0.1 * torch.rand(B, T, H, K)
        o, (S, p) = kdn.diagonal_kdn(q, k, v, g, torch.rand(B, T, H, K), torch.ones(B, T, H),
                                     output_final_state=True)
    """
    return _run("diagonal", q, k, v, g, omega, r, mu, initial_state, output_final_state, cu_seqlens, backend,
                validate, scale, omega_softplus, gate, memory, chunk_size, recompute_states, precision)


def isotropic_kdn(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, omega: Tensor, r: Tensor, *,
    mu: float | Tensor | None = None,
    initial_state: State | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    backend: str | None = None,
    validate: bool = True,
    scale: float = 1.0,
    omega_softplus: bool = False,
    gate: tuple[Tensor, Tensor] | None = None,
    recompute_states: bool = False,
    precision: str = "bf16",
) -> tuple[Tensor, State | None]:
    """Isotropic KDN (docs/math.md §4): one uncertainty scalar ``b`` per head, gain ``kappa = beta k``.

    Args:
        q, k, g: ``[B,T,H,K]``; v: ``[B,T,H,V]``; omega, r: ``[B,T,H]``.
        initial_state: ``(S [N,H,K,V], b [N,H])``. Every other argument as in :func:`diagonal_kdn` (the memory is
            always fla's asymmetric chunk-64 kernels on CUDA).

    Returns:
        ``o [B,T,H,V]`` and, if asked, the final ``(S, b)``.

    Example::

        o, _ = kdn.isotropic_kdn(q, k, v, g, torch.rand(B, T, H), torch.ones(B, T, H))
    """
    return _run("isotropic", q, k, v, g, omega, r, mu, initial_state, output_final_state, cu_seqlens, backend,
                validate, scale, omega_softplus, gate, "asym", None, recompute_states, precision)


def _gain_common(
    isotropic: bool, k: Tensor, g: Tensor, omega: Tensor, r: Tensor, mu: float | Tensor | None,
    initial_state: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    if not isinstance(k, Tensor) or k.dim() != 4:
        raise ValueError(f"k must be a [B,T,H,K] tensor, got shape {getattr(k, 'shape', None)}")
    B, T, H, K = k.shape
    if 0 in (B, T, H, K):
        raise ValueError(f"k has shape [B,T,H,K] = {list(k.shape)}; every size must be at least 1")
    check_shape("g", g, (B, T, H, K), "B,T,H,K")
    if isotropic:
        check_shape("omega", omega, (B, T, H), "B,T,H")
    else:
        check_shape("omega", omega, (B, T, H, K), "B,T,H,K")
    check_shape("r", r, (B, T, H), "B,T,H")
    _check_dtypes({"k": k, "g": g, "omega": omega, "r": r})
    dt = _compute_dtype(k)
    mu_t = _mu_tensor(mu, H, K, dt, k.device)
    if initial_state is None:
        p0 = k.new_ones((B, H) if isotropic else (B, H, K), dtype=dt)
    else:
        check_shape("initial_state", initial_state, (B, H) if isotropic else (B, H, K),
                    "B,H" if isotropic else "B,H,K")
        p0 = initial_state.to(dt)
    check_values({"k": k, "g": g, "omega": omega, "r": r, "mu": mu_t, "initial_state": p0},
                 nonpositive=("g",), nonnegative=("omega",), positive=("r", "mu", "initial_state"))
    return k.to(dt), g.to(dt), omega.to(dt), r.to(dt), mu_t, p0


def diagonal_kdn_gain(
    k: Tensor, g: Tensor, omega: Tensor, r: Tensor, *, mu: float | Tensor | None = None,
    initial_state: Tensor | None = None, output_final_state: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Diagonal KDN gains alone (docs/math.md §3), the chunked Möbius scan in PyTorch (any device).

    Args:
        k, g, omega: ``[B,T,H,K]``; r: ``[B,T,H]``; mu: float or ``[H]`` (default ``K``).
        initial_state: ``p0 [B,H,K]`` (default ones). output_final_state: return the final ``p``.

    Returns:
        ``kappa [B,T,H,K]`` and, if asked, the final ``p [B,H,K]`` (FP32, float64 for float64 ``k``).

    Example::

        kappa, p = kdn.diagonal_kdn_gain(k, g, omega, r, output_final_state=True)
    """
    kappa, p = _gain.diagonal_gain(*_gain_common(False, k, g, omega, r, mu, initial_state))
    return kappa, (p if output_final_state else None)


def isotropic_kdn_gain(
    k: Tensor, g: Tensor, omega: Tensor, r: Tensor, *, mu: float | Tensor | None = None,
    initial_state: Tensor | None = None, output_final_state: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Isotropic KDN gains alone (docs/math.md §4): as :func:`diagonal_kdn_gain` with ``omega [B,T,H]`` and
    ``initial_state = b0 [B,H]``.

    Returns:
        ``beta [B,T,H]`` (``kappa = beta k``) and, if asked, the final ``b [B,H]``.
    """
    beta, b = _gain.isotropic_gain(*_gain_common(True, k, g, omega, r, mu, initial_state))
    return beta, (b if output_final_state else None)


def _step(
    isotropic: bool, q: Tensor, k: Tensor, v: Tensor, g: Tensor, omega: Tensor, r: Tensor,
    state: State, mu: float | Tensor | None, validate: bool,
) -> tuple[Tensor, State]:
    if not isinstance(q, Tensor) or q.dim() != 3:
        raise ValueError(f"q must be a one-token [B,H,K] tensor, got shape {getattr(q, 'shape', None)}")
    B, H, K = q.shape
    _check_sizes("B,H,K", (B, H, K))
    check_shape("k", k, (B, H, K), "B,H,K")
    check_shape("g", g, (B, H, K), "B,H,K")
    if not isinstance(v, Tensor) or v.dim() != 3 or tuple(v.shape[:2]) != (B, H):
        raise ValueError(f"v must be [B,H,V] = [{B}, {H}, V], got {list(getattr(v, 'shape', []))}")
    check_shape("omega", omega, (B, H) if isotropic else (B, H, K), "B,H" if isotropic else "B,H,K")
    check_shape("r", r, (B, H), "B,H")
    S, p = state
    check_shape("state[0] (S)", S, (B, H, K, v.shape[-1]), "B,H,K,V")
    check_shape("state[1]", p, (B, H) if isotropic else (B, H, K), "B,H" if isotropic else "B,H,K")
    if v.shape[-1] == 0:
        raise ValueError("v has V=0 value channels; every size must be at least 1")
    _check_dtypes({"q": q, "k": k, "v": v, "g": g, "omega": omega, "r": r})
    dt = _compute_dtype(v)
    mu_t = _mu_tensor(mu, H, K, dt, q.device)
    if validate and not torch.compiler.is_compiling():
        check_values({"q": q, "k": k, "v": v, "g": g, "omega": omega, "r": r, "mu": mu_t},
                     nonpositive=("g",), nonnegative=("omega",), positive=("r", "mu"))
    inputs = (q, k, v, g, omega, r, S, p)
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (*inputs, mu_t))
    if _resolve_backend(None, q.device, dt) == "triton" and not needs_grad:  # one fused kernel on CUDA
        from kdn.ops import fused_recurrent as _fused

        fused = _fused.fused_recurrent_isotropic_kdn if isotropic else _fused.fused_recurrent_diagonal_kdn
        o, new = fused(*(x[:, None] for x in inputs[:6]), mu_t, (S, p))
        return o[:, 0].to(v.dtype), new
    fn = _naive.isotropic_kdn_step_ref if isotropic else _naive.diagonal_kdn_step_ref
    o, new = fn(*(x.to(dt) for x in inputs[:6]), mu_t, (S.to(dt), p.to(dt)))
    return o.to(v.dtype), new


def diagonal_kdn_step(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, omega: Tensor, r: Tensor, state: State, *,
    mu: float | Tensor | None = None, validate: bool = True,
) -> tuple[Tensor, State]:
    """One decoding token of Diagonal KDN (docs/math.md §3). On CUDA without autograd it runs one fused Triton
    kernel (:func:`kdn.ops.fused_recurrent.fused_recurrent_diagonal_kdn`), else the PyTorch step.

    Args:
        q, k, g, omega: ``[B,H,K]``; v: ``[B,H,V]``; r: ``[B,H]``; state: ``(S [B,H,K,V], p [B,H,K])``.
        mu: float or ``[H]`` (default ``K``). validate: as in :func:`diagonal_kdn`.

    Returns:
        ``o [B,H,V]`` in ``v``'s dtype and the new state.

    Example::

        o, state = kdn.diagonal_kdn_step(q[:, -1], k[:, -1], v[:, -1], g[:, -1], omega[:, -1], r[:, -1], state)
    """
    return _step(False, q, k, v, g, omega, r, state, mu, validate)


def isotropic_kdn_step(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, omega: Tensor, r: Tensor, state: State, *,
    mu: float | Tensor | None = None, validate: bool = True,
) -> tuple[Tensor, State]:
    """One decoding token of Isotropic KDN (docs/math.md §4): as :func:`diagonal_kdn_step` with ``omega, r [B,H]``
    and ``state = (S [B,H,K,V], b [B,H])``. Returns ``o [B,H,V]`` and the new state."""
    return _step(True, q, k, v, g, omega, r, state, mu, validate)


def exact_kalman_memory(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, omega: Tensor, r: Tensor, *,
    initial_state: State | None = None, output_final_state: bool = False,
) -> tuple[Tensor, State | None]:
    """Exact Kalman associative memory with dense covariance (docs/math.md §2), O(K^2) state per head.

    A reference: token-by-token, for tests and small probes.

    Args:
        q, k, g: ``[B,T,H,K]``; v: ``[B,T,H,V]``; omega: ``[B,T,H,K]``, the diagonal of the process noise;
            r: ``[B,T,H]``.
        initial_state: ``(S [B,H,K,V], P [B,H,K,K])`` (default ``S = 0``, ``P = I``).

    Returns:
        ``o [B,T,H,V]`` and, if ``output_final_state``, the final ``(S, P)``.

    Example::

        o, (S, P) = kdn.exact_kalman_memory(q, k, v, g, omega, r, output_final_state=True)
    """
    B, T, H, K, V = _check_inputs(q, k, v, g, omega, r, isotropic=False)
    dt = _compute_dtype(v)
    if initial_state is None:
        S0 = q.new_zeros(B, H, K, V, dtype=dt)
        P0 = torch.eye(K, dtype=dt, device=q.device).expand(B, H, K, K)
    else:
        S0, P0 = initial_state
        check_shape("initial_state[0] (S)", S0, (B, H, K, V), "B,H,K,V")
        check_shape("initial_state[1] (P)", P0, (B, H, K, K), "B,H,K,K")
    check_values({"q": q, "k": k, "v": v, "g": g, "omega": omega, "r": r},
                 nonpositive=("g",), nonnegative=("omega",), positive=("r",))
    o, final = _naive.exact_kalman_recurrent(
        *(x.to(dt) for x in (q, k, v, g, omega, r)), (S0.to(dt), P0.to(dt)))
    return o.to(v.dtype), (final if output_final_state else None)
