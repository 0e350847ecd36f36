"""Analytic floors for the kernel-only timings of ``bench.mixer_throughput``: FLOPs and compulsory bytes.

The model (stated, not measured): a chunked delta-rule memory with chunk ``C`` spends, per token and head,
``6CK + 4CV + 2C^2/3 + 6KV`` FLOPs forward (intra-chunk key/query products and the UT transform, the
triangular solve, the pseudo-values, the state read, output and update) and twice that backward. Compulsory
traffic is each kernel-only input read once forward and once backward, the output written once, the output
gradient read once and every input gradient written once (q, k, v in bf16; gates, noise and gains in FP32).
Achieved rates are these counts over the measured time; the ceilings are the GPU's dense bf16 tensor-core rate and
its HBM bandwidth (:func:`ceilings`, by the device's name).
"""
from __future__ import annotations

# (name fragment, dense bf16 TFLOP/s, HBM TB/s) from NVIDIA's data sheets, the first match wins
CEILINGS = (("H200", 989.0, 4.8), ("H100 PCIe", 756.0, 2.0), ("H100 NVL", 835.0, 3.9), ("H100", 989.0, 3.35))

BF16, FP32 = 2, 4


def memory_flops(B: int, T: int, H: int, K: int, V: int, chunk: int = 64) -> float:
    """FLOPs of one chunked delta-rule memory pass, forward + backward (backward = 2x forward)."""
    C = chunk
    per_token_head = 6 * C * K + 4 * C * V + 2 * C * C / 3 + 6 * K * V
    return 3.0 * per_token_head * B * T * H


def kernel_bytes(mixer: str, B: int, T: int, H: int, K: int, V: int) -> float:
    """Compulsory HBM bytes of the kernel-only fwd+bwd of ``mixer`` (``kdn_diag``, ``kdn_iso`` or ``kda``)."""
    n = B * T * H
    qkv = n * (2 * K + V) * BF16
    extra = {  # per-token inputs beyond q, k, v: the log-retention g plus each mixer's write strength
        "kdn_diag": n * K * FP32 + n * K * FP32 + n * FP32,  # g, omega [B,T,H,K], r
        "kdn_iso": n * K * FP32 + n * FP32 + n * FP32,  # g, omega [B,T,H], r
        "kda": n * K * FP32 + n * BF16,  # g, beta
    }
    if mixer not in extra:
        raise ValueError(f"no byte model for mixer {mixer!r}; known: {sorted(extra)}")
    inputs = qkv + extra[mixer]
    out = n * V * BF16
    # forward: read inputs, write o; backward: read inputs and do, write one gradient per input
    return (inputs + out) + (inputs + out + inputs)


def ceilings(device: str) -> tuple[float, float] | None:
    """``(dense bf16 TFLOP/s, HBM TB/s)`` of the GPU named ``device`` (``torch.cuda.get_device_name()``), or ``None``
    for a GPU not in :data:`CEILINGS`."""
    return next(((tf, tb) for frag, tf, tb in CEILINGS if frag in device), None)


def achieved(mixer: str, B: int, T: int, H: int, K: int, V: int, ms: float, device: str) -> dict[str, float]:
    """Achieved TFLOP/s and GB/s of a kernel-only fwd+bwd that took ``ms``, and their fractions of ``device``'s
    ceilings (:func:`ceilings`; no fractions for a GPU it does not know)."""
    if not ms > 0:
        raise ValueError(f"the measured time must be positive, got {ms} ms")
    tflops = memory_flops(B, T, H, K, V) / (ms / 1e3) / 1e12
    gbps = kernel_bytes(mixer, B, T, H, K, V) / (ms / 1e3) / 1e9
    peak = ceilings(device)
    fracs = {} if peak is None else {"tflops_frac": tflops / peak[0], "hbm_frac": gbps / (peak[1] * 1e3)}
    return {"kernel_tflops": tflops, "kernel_gbps": gbps, **fracs}
