"""The inter-chunk + WY backward of the Diagonal KDN memory on CUDA: fla's ``chunk_precond_kda_bwd_wy_dqkg``
against ours (``kdn.ops.triton.wy.chunk_asym_bwd_wy_dqkg``), at the shape of a training step's layer.

Inputs as the backward sees them: bf16 ``q, k, k_precond, v, v_new, do, dv``, the chunk states and their gradients
``h, dh``, the WY inverse ``A`` and ``beta`` (bf16, the dtype of k as fla's forward makes ``A``: fla's kernel
multiplies ``A`` with ``dv`` in one matmul, which needs both in one dtype), FP32 ``g`` (a per-chunk cumulative sum in
log2 space). Prints a table (ms, the bytes a pass must move per second, the speedup) and ours' largest relative
difference from fla per output, and writes ``--out`` (JSON).

    python -m bench.wy_throughput --batch 8 --seqlen 4096 --heads 16 --key-dim 128 --value-dim 128
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import Tensor

from bench.mixer_throughput import write_atomic

NAMES = ("dq", "dk", "dkg", "dv2", "db", "dg", "dA")
BT = 64


def _inputs(B: int, T: int, H: int, K: int, V: int) -> dict[str, Tensor]:
    """Random inputs (never zeros) on CUDA."""
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    dev, bf16 = "cuda", torch.bfloat16
    NT = -(-T // BT)
    x = {n: torch.randn(B, T, H, K, device=dev, dtype=bf16) for n in ("q", "k", "k_precond")}
    x |= {n: torch.randn(B, T, H, V, device=dev, dtype=bf16) for n in ("v", "v_new", "do", "dv")}
    x["g"] = chunk_local_cumsum(-torch.nn.functional.softplus(torch.randn(B, T, H, K, device=dev)) * 0.3,
                                chunk_size=BT, scale=RCP_LN2)
    x["beta"] = (torch.rand(B, T, H, device=dev) + 0.1).to(bf16)
    tril = torch.ones(BT, BT, device=dev).tril()[torch.arange(T, device=dev) % BT][None, :, None]
    x["A"] = (torch.randn(B, T, H, BT, device=dev) * 0.3 * tril).to(bf16)
    x["h"] = (torch.randn(B, NT, H, K, V, device=dev) * 0.5).to(bf16)
    x["dh"] = (torch.randn(B, NT, H, K, V, device=dev) * 0.5).to(bf16)
    return x


def _moved_bytes(x: dict[str, Tensor], outs: tuple[Tensor, ...]) -> int:
    """Bytes a pass must move: every input read once, every output written once (our FP32 scratch not counted)."""
    return sum(t.numel() * t.element_size() for t in (*x.values(), *outs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--key-dim", type=int, default=128)
    ap.add_argument("--value-dim", type=int, default=128)
    ap.add_argument("--out", default="bench/results/wy_throughput.json")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench.wy_throughput needs a CUDA device (Triton's kernels are timed on the GPU).")
    from fla.ops.precond_kda.chunk_bwd import chunk_precond_kda_bwd_wy_dqkg
    from triton.testing import do_bench

    from kdn.ops.triton.wy import _dA_kernel, _dqkg_kernel, chunk_asym_bwd_wy_dqkg

    torch.manual_seed(0)
    x = _inputs(a.batch, a.seqlen, a.heads, a.key_dim, a.value_dim)
    scale = a.key_dim ** -0.5
    fns = {"fla chunk_precond_kda_bwd_wy_dqkg": chunk_precond_kda_bwd_wy_dqkg,
           "kdn.ops.triton.wy chunk_asym_bwd_wy_dqkg": chunk_asym_bwd_wy_dqkg}
    rows, outs = [], {}
    for name, fn in fns.items():
        outs[name] = fn(**x, scale=scale, chunk_size=BT)  # (autotunes)
        ms = do_bench(lambda fn=fn: fn(**x, scale=scale, chunk_size=BT))
        rows.append({"kernel": name, "ms": ms, "GBps": _moved_bytes(x, outs[name]) / ms / 1e6})
    ref, ours = outs.values()
    diff = {n: ((o.double() - r.double()).norm() / r.double().norm()).item() for n, o, r in zip(NAMES, ours, ref)}
    for r in rows:
        r["speedup"] = rows[0]["ms"] / r["ms"]
    print(f"{'kernel':<40} {'ms':>8} {'GB/s':>7} {'speedup':>8}")
    for r in rows:
        print(f"{r['kernel']:<40} {r['ms']:8.3f} {r['GBps']:7.0f} {r['speedup']:8.2f}")
    configs = {"dqkg": str(_dqkg_kernel.best_config), "dA": str(_dA_kernel.best_config)}
    print("ours' configs:", configs)
    print("relative difference, ours against fla:", {n: f"{v:.1e}" for n, v in diff.items()})
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "shape": {"B": a.batch, "T": a.seqlen, "H": a.heads, "K": a.key_dim, "V": a.value_dim, "BT": BT},
              "results": rows, "configs": configs, "relative_difference_vs_fla": diff}
    write_atomic(Path(a.out), json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
