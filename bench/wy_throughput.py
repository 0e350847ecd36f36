"""The inter-chunk + WY backward of the Diagonal KDN memory on CUDA: fla's ``chunk_precond_kda_bwd_wy_dqkg``
against ours (``kdn.ops.triton.wy.chunk_asym_bwd_wy_dqkg``) with its key-block kernel in Triton and, on sm_90, in
TileLang (``kdn.ops.tilelang.wy``), at the shape of a training step's layer; then the key-block kernel alone, Triton's
against TileLang's at each ``--tiles`` setting (``BLOCK_K,BLOCK_V,THREADS,STAGES,WARP_SPECIALIZED``); then, on sm_90,
fla's fused WY backward of KDA's rule in Triton and in its TileLang backend (``fla_kda_wy_dqkg_fused``).

Inputs as the backward sees them: bf16 ``q, k, k_precond, v, v_new, do, dv``, the chunk states and their gradients
``h, dh``, the WY inverse ``A`` and ``beta`` (bf16, the dtype of k as fla's forward makes ``A``: fla's kernel
multiplies ``A`` with ``dv`` in one matmul, which needs both in one dtype), FP32 ``g`` (a per-chunk cumulative sum in
log2 space). Prints a table (ms, the bytes a pass must move per second, the speedup) and ours' largest relative
difference from fla per output, and writes ``--out`` (JSON).

    python -m bench.wy_throughput --batch 8 --seqlen 4096 --heads 16 --key-dim 128 --value-dim 128 \
        --tiles 64,128,128,1,0 64,64,128,2,0 64,128,256,1,1
"""
from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch
from torch import Tensor

from bench.mixer_throughput import write_atomic
from kdn.ops.tilelang import WYTiles

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


def _tiles(spec: str) -> WYTiles:
    """``BLOCK_K,BLOCK_V,THREADS,STAGES,WARP_SPECIALIZED`` as :class:`kdn.ops.tilelang.WYTiles`."""
    try:
        bk, bv, threads, stages, ws = (int(v) for v in spec.split(","))
    except ValueError:
        sys.exit(f"--tiles {spec!r}: give five integers BLOCK_K,BLOCK_V,THREADS,STAGES,WARP_SPECIALIZED")
    return WYTiles(block_k=bk, block_v=bv, threads=threads, stages=stages, warp_specialized=bool(ws))


def _key_block_rows(x: dict[str, Tensor], scale: float, tiles: list[str], timed: bool = True) -> list[dict]:
    """The key-block kernel alone: Triton's (autotuned) against TileLang's at each tile setting, with the first
    run's time (TileLang compiles there, or loads from its disk cache), and the largest relative difference of the
    six outputs from Triton's. ``timed=False``: each kernel runs twice (warm-up, then the launch to profile)."""
    import time

    from triton.testing import do_bench

    from kdn.ops.tilelang.wy import wy_dqkg_tilelang
    from kdn.ops.triton.wy import _dqkg_kernel

    B, T, H, K = x["k"].shape
    NT, BK = -(-T // BT), 64
    NK = K // BK
    args = [x[n] for n in ("q", "k", "k_precond", "v_new", "g", "beta", "A", "h", "do", "dh", "dv")]
    outs = [torch.empty_like(x["k"], dtype=torch.float) for _ in range(4)]
    parts = [x["k"].new_empty(NK, B * NT, H, BT, BT, dtype=torch.float),
             x["k"].new_empty(NK, B * NT, H, BT, dtype=torch.float)]

    def triton_fn() -> None:
        _dqkg_kernel[(NK * NT, B * H)](*args, *outs, *parts, None, None, scale, T, B * NT, H=H, K=K,
                                       V=x["v"].shape[-1], BT=BT, BK=BK, IS_VARLEN=False)

    triton_fn()
    if not timed:
        triton_fn()
        for spec in tiles:
            t = _tiles(spec)
            for _ in range(2):
                wy_dqkg_tilelang(*args, scale, None, None, tiles=t)
        torch.cuda.synchronize()
        return []
    ref = [t.clone() for t in outs] + [p.sum(0, keepdim=True) for p in parts]
    rows = [{"kernel": "triton _dqkg_kernel", "config": str(_dqkg_kernel.best_config), "ms": do_bench(triton_fn)}]
    for spec in tiles:
        t = _tiles(spec)
        t0 = time.perf_counter()
        try:
            got = wy_dqkg_tilelang(*args, scale, None, None, tiles=t)
        except Exception as e:  # a setting TileLang cannot lower is a row of the table, not the end of the sweep
            rows.append({"kernel": "tilelang", "config": spec, "error": f"{type(e).__name__}: {str(e)[-300:]}"})
            continue
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        ms = do_bench(lambda t=t: wy_dqkg_tilelang(*args, scale, None, None, tiles=t))
        got = (*got[:4], *(p.sum(0, keepdim=True) for p in got[4:]))  # the shares summed over key blocks
        diff = max(((o.double() - r.double()).norm() / r.double().norm()).item() for o, r in zip(got, ref))
        rows.append({"kernel": "tilelang", "config": spec, "ms": ms, "first_run_s": first,
                     "max_rel_diff_vs_triton": diff})
    print(f"{'key-block kernel':<22} {'config':<46} {'ms':>8} {'vs triton':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['kernel']:<22} {r['config'][:46]:<46} {r['error'][-120:]}")
            continue
        print(f"{r['kernel']:<22} {r['config'][:46]:<46} {r['ms']:8.3f} {rows[0]['ms'] / r['ms']:8.2f}x"
              + (f"  first run {r['first_run_s']:.1f} s, diff {r['max_rel_diff_vs_triton']:.1e}"
                 if "first_run_s" in r else ""))
    return rows


KDA_NAMES = ("dq", "dk", "dv2", "db", "dg", "dA")


def _fla_kda_rows(x: dict[str, Tensor], scale: float) -> list[dict]:
    """fla 0.6.0's fused WY backward of KDA's rule (``chunk_kda_bwd_wy_dqkg_fused``: no preconditioned key, so one
    input and one output fewer than ours), its Triton kernel against its TileLang backend, at the same shape: the
    role our ``chunk_asym_bwd_wy_dqkg`` plays for KDN. The Triton arm is the function fla's backend dispatch falls
    back to, reached through its ``__wrapped__`` chain, so that no environment switch picks it."""
    import inspect

    from fla.ops.kda.backends.tilelang.chunk_bwd_dqkg import chunk_kda_bwd_wy_dqkg_fused_tilelang
    from fla.ops.kda.chunk_bwd import chunk_kda_bwd_wy_dqkg_fused
    from triton.testing import do_bench

    args = {n: x[n] for n in ("q", "k", "v", "v_new", "g", "beta", "A", "h", "do", "dh", "dv")}
    fns = {"fla chunk_kda_bwd_wy_dqkg_fused, Triton": inspect.unwrap(chunk_kda_bwd_wy_dqkg_fused),
           "fla chunk_kda_bwd_wy_dqkg_fused, TileLang": chunk_kda_bwd_wy_dqkg_fused_tilelang}
    rows, outs = [], {}
    for name, fn in fns.items():
        try:
            outs[name] = fn(**args, scale=scale, chunk_size=BT)
        except Exception as e:  # a backend that cannot run here is a row of the table, not the end of the run
            rows.append({"kernel": name, "error": f"{type(e).__name__}: {str(e)[-300:]}"})
            continue
        rows.append({"kernel": name, "ms": do_bench(lambda fn=fn: fn(**args, scale=scale, chunk_size=BT))})
    if len(outs) == 2:
        ref, got = outs.values()
        rows[1]["relative_difference_vs_triton"] = {
            n: ((o.double() - r.double()).norm() / r.double().norm()).item() for n, o, r in zip(KDA_NAMES, got, ref)}
    for r in rows:
        print(f"{r['kernel']:<40} " + (f"{r['ms']:8.3f}" if "ms" in r else r["error"][-120:]))
    return rows


def add_shape_args(ap: argparse.ArgumentParser) -> None:
    """The layer shape of a training step's recurrence: ``--batch --seqlen --heads --key-dim``."""
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--key-dim", type=int, default=128)


def relative_differences(outs: dict[str, tuple[Tensor, ...]], ref: tuple[Tensor, ...],
                         names: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """``||out - ref|| / ||ref||`` (float64) of each output named in ``names``, for every entry of ``outs`` but
    ``ref`` itself."""
    return {name: {n: ((o.double() - r.double()).norm() / r.double().norm()).item() for n, o, r in zip(names, out, ref)}
            for name, out in outs.items() if out is not ref}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(ap)
    ap.add_argument("--value-dim", type=int, default=128)
    ap.add_argument("--tiles", nargs="*", default=["64,128,128,1,0"],
                    help="TileLang settings to time, each BLOCK_K,BLOCK_V,THREADS,STAGES,WARP_SPECIALIZED (sm_90)")
    ap.add_argument("--launch-once", action="store_true",
                    help="launch Triton's key-block kernel and TileLang's at each --tiles setting once each, after a "
                         "warm-up call, and time nothing: for Nsight Compute (ncu -k regex:dqkg_kernel)")
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
    if a.launch_once:
        _key_block_rows(x, scale, a.tiles, timed=False)
        return
    fns = {"fla chunk_precond_kda_bwd_wy_dqkg": chunk_precond_kda_bwd_wy_dqkg,
           "kdn.ops.triton.wy chunk_asym_bwd_wy_dqkg": partial(chunk_asym_bwd_wy_dqkg, kernel="triton")}
    hopper = torch.cuda.get_device_capability() == (9, 0)
    if hopper:
        fns["kdn.ops.triton.wy chunk_asym_bwd_wy_dqkg, TileLang key blocks"] = partial(chunk_asym_bwd_wy_dqkg,
                                                                                      kernel="tilelang")
    rows, outs = [], {}
    for name, fn in fns.items():
        outs[name] = fn(**x, scale=scale, chunk_size=BT)  # (autotunes)
        ms = do_bench(lambda fn=fn: fn(**x, scale=scale, chunk_size=BT))
        rows.append({"kernel": name, "ms": ms, "GBps": _moved_bytes(x, outs[name]) / ms / 1e6})
    ref = outs["fla chunk_precond_kda_bwd_wy_dqkg"]
    diff = relative_differences(outs, ref, NAMES)
    for r in rows:
        r["speedup"] = rows[0]["ms"] / r["ms"]
    print(f"{'kernel':<40} {'ms':>8} {'GB/s':>7} {'speedup':>8}")
    for r in rows:
        print(f"{r['kernel']:<40} {r['ms']:8.3f} {r['GBps']:7.0f} {r['speedup']:8.2f}")
    configs = {"dqkg": str(_dqkg_kernel.best_config), "dA": str(_dA_kernel.best_config)}
    print("ours' configs:", configs)
    for name, d in diff.items():
        print(f"relative difference against fla, {name}:", {n: f"{v:.1e}" for n, v in d.items()})
    key_blocks = _key_block_rows(x, scale, a.tiles) if hopper else []
    fla_kda = _fla_kda_rows(x, scale) if hopper else []
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "shape": {"B": a.batch, "T": a.seqlen, "H": a.heads, "K": a.key_dim, "V": a.value_dim, "BT": BT},
              "results": rows, "configs": configs, "relative_difference_vs_fla": diff, "key_block_kernel": key_blocks,
              "fla_kda_wy_dqkg_fused": fla_kda}
    write_atomic(Path(a.out), json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
