"""The intra-chunk backward of the KDN memory on CUDA: fla's ``chunk_precond_kda_bwd_intra`` path (its kernel, then
``dg``'s reverse sum within the chunks) against ours (``kdn.ops.triton.intra.chunk_asym_bwd_intra``, the sum fused) at
each ``--block-k``, and with ``--tma`` its copy on tensor descriptors (``kdn.ops.triton.intra_tma``) too, at the shape
of a training step's layer.

Inputs as the memory's backward passes them: bf16 ``q, k, k_precond``, FP32 ``g`` (a per-chunk cumulative sum in log2
space, inside fla's safe envelope), ``beta``, ``dAqk, dAkk`` and the incoming ``dq, dk, dk_precond, db, dg``. Prints a
table (ms, the bytes a pass must move per second, the speedup) and ours' relative difference from fla per output, and
writes ``--out`` (JSON). ``--launch-once`` launches each once after a warm-up, for Nsight Compute.

    python -m bench.intra_throughput --batch 8 --seqlen 4096 --heads 16 --key-dim 128 --block-k 32 64 --tma
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import Tensor

from bench.mixer_throughput import write_atomic
from bench.wy_throughput import add_shape_args, relative_differences

NAMES = ("dq", "dk", "dkp", "db", "dg")
BT = 64


def _inputs(B: int, T: int, H: int, K: int) -> dict[str, Tensor]:
    """Random inputs (never zeros) on CUDA."""
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    dev = "cuda"
    x = {n: torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16) for n in ("q", "k", "k_precond")}
    x |= {n: torch.randn(B, T, H, K, device=dev) for n in ("dq", "dk", "dk_precond", "dg")}
    x["g"] = chunk_local_cumsum(-torch.nn.functional.softplus(torch.randn(B, T, H, K, device=dev)) * 0.3,
                                chunk_size=BT, scale=RCP_LN2)
    x["beta"] = torch.rand(B, T, H, device=dev) + 0.1
    x["db"] = torch.randn(B, T, H, device=dev)
    x["dAqk"], x["dAkk"] = (torch.randn(B, T, H, BT, device=dev) * 0.3 for _ in range(2))
    return x


def _fla(x: dict[str, Tensor]) -> tuple[Tensor, ...]:
    from kdn.ops.triton.memory import _asym_intra_bwd

    return _asym_intra_bwd(x["q"], x["k"], x["k_precond"], x["g"], x["beta"], x["dAqk"], x["dAkk"], x["dq"], x["dk"],
                           x["dk_precond"], x["db"], x["dg"], True, {"cu_seqlens": None, "chunk_indices": None},
                           False, kernel="fla")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(ap)
    ap.add_argument("--block-k", type=int, nargs="*", default=[32, 64])
    ap.add_argument("--launch-once", action="store_true",
                    help="launch fla's kernel and ours at each --block-k (and with --tma the descriptor copy's) once "
                         "each after a warm-up call, and time nothing: for Nsight Compute (ncu -k regex:intra)")
    ap.add_argument("--tma", action="store_true",
                    help="also time kdn.ops.triton.intra_tma.chunk_asym_bwd_intra_tma (tiles through tensor "
                         "descriptors) at each --block-k")
    ap.add_argument("--out", default="bench/results/intra_throughput.json")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench.intra_throughput needs a CUDA device (Triton's kernels are timed on the GPU).")
    from triton.testing import do_bench

    from kdn.ops.triton.intra import _intra_bwd_kernel, chunk_asym_bwd_intra
    from kdn.ops.triton.intra_tma import _intra_bwd_tma_kernel, chunk_asym_bwd_intra_tma

    torch.manual_seed(0)
    x = _inputs(a.batch, a.seqlen, a.heads, a.key_dim)
    fns = {"fla chunk_precond_kda_bwd_intra (+ dg chunk sums)": lambda: _fla(x)}
    for bk in a.block_k:
        fns[f"kdn.ops.triton.intra chunk_asym_bwd_intra, block_k {bk}"] = \
            lambda bk=bk: chunk_asym_bwd_intra(**x, block_k=bk)
    if a.tma:
        for bk in a.block_k:
            fns[f"kdn.ops.triton.intra_tma chunk_asym_bwd_intra_tma, block_k {bk}"] = \
                lambda bk=bk: chunk_asym_bwd_intra_tma(**x, block_k=bk)
    if a.launch_once:
        for fn in fns.values():
            fn()
            fn()
        torch.cuda.synchronize()
        return
    rows, outs, configs = [], {}, {}
    moved = sum(t.numel() * t.element_size() for t in x.values())
    for name, fn in fns.items():
        outs[name] = fn()  # (autotunes)
        ms = do_bench(fn)
        if name.startswith("kdn"):
            kernel = _intra_bwd_tma_kernel if "intra_tma" in name else _intra_bwd_kernel
            configs[name] = str(kernel.best_config)
        written = sum(t.numel() * t.element_size() for t in outs[name])
        rows.append({"kernel": name, "ms": ms, "GBps": (moved + written) / ms / 1e6})
    for r in rows:
        r["speedup"] = rows[0]["ms"] / r["ms"]
    ref = next(iter(outs.values()))
    diff = relative_differences(outs, ref, NAMES)
    print(f"{'kernel':<66} {'ms':>8} {'GB/s':>7} {'speedup':>8}")
    for r in rows:
        print(f"{r['kernel']:<66} {r['ms']:8.3f} {r['GBps']:7.0f} {r['speedup']:8.2f}")
    print("ours' configs:", configs)
    for name, d in diff.items():
        print(f"relative difference against fla, {name}:", {n: f"{v:.1e}" for n, v in d.items()})
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "shape": {"B": a.batch, "T": a.seqlen, "H": a.heads, "K": a.key_dim, "BT": BT},
              "results": rows, "configs": configs, "relative_difference_vs_fla": diff}
    write_atomic(Path(a.out), json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
