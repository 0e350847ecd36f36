"""Diagonal KDN's gain as its training step runs it, on CUDA: the three-launch scan
(:mod:`kdn.ops.triton.gain_diagonal`) at the segments of :func:`kdn.ops.triton.utils.gain_segments`' rule and at
each ``--segments`` size, forward and backward, the backward adding the memory's gradients of ``k`` and ``g``
(``dg``'s reverse sums within chunks of 64) and taking KDA's gate's backward, as in ``chunk_diagonal_kdn``.

Inputs as the layer feeds them: ``k`` and omega's input in bf16, ``g`` and ``r`` in FP32, ``kappa`` out in bf16.
Prints a table (ms, and the bytes each direction must move at least, per second) with each path's largest relative
difference to the rule's segments and whether a second run is bitwise the same, and writes ``--out`` (JSON).

    python -m bench.gain_throughput --out bench/results/gain_throughput.json
"""
from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import torch
from torch import Tensor

from bench.mixer_throughput import write_atomic


def inputs(B: int, T: int, H: int, K: int) -> dict[str, Tensor]:
    """Layer-like gain inputs and upstream gradients on CUDA."""
    dev = torch.device("cuda")
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).bfloat16()
    return {
        "k": k, "g": -torch.rand(B, T, H, K, device=dev) * 0.5, "omega": torch.randn(B, T, H, K, device=dev).bfloat16(),
        "r": torch.rand(B, T, H, device=dev) + 0.1, "mu": torch.full((H,), float(K), device=dev),
        "p0": torch.ones(B, H, K, device=dev), "A_log": torch.zeros(H, device=dev),
        "dkappa": torch.randn(B, T, H, K, device=dev).bfloat16(), "dpT": torch.randn(B, H, K, device=dev),
        "dk_mem": torch.randn(B, T, H, K, device=dev).bfloat16(), "dg_mem": torch.randn(B, T, H, K, device=dev),
    }


def forward(x: dict[str, Tensor], seg: int | None) -> tuple:
    """The gain's forward as ``chunk_diagonal_kdn`` runs it: ``((kappa, p_T), saved)``."""
    from kdn.ops.triton.gain_diagonal import _diag_gain_fwd

    B, T = x["k"].shape[:2]
    return _diag_gain_fwd(x["k"], x["g"], x["omega"], x["r"], x["mu"], x["p0"], torch.bfloat16, False, None, B, T,
                          True, x["A_log"], seg)


def backward(x: dict[str, Tensor], saved: tuple, seg: int | None) -> tuple:
    """The gain's backward as ``chunk_diagonal_kdn`` runs it (the memory's gradients added, the gate's taken)."""
    from kdn.ops.triton.gain_diagonal import _diag_gain_bwd
    from kdn.ops.validate import ASYM_CHUNK

    B, T = x["k"].shape[:2]
    return _diag_gain_bwd(saved, (x["dkappa"], x["dpT"]), False, B, T, True, True, (x["dk_mem"], x["dg_mem"]),
                          torch.bfloat16, seg, ASYM_CHUNK)


def results(x: dict[str, Tensor], seg: int | None) -> tuple[list[Tensor], tuple]:
    """Every output and gradient (the gate's included), and what the backward takes."""
    outs, saved = forward(x, seg)
    grads = backward(x, saved, seg)
    return [t for t in (*outs, *grads[:6], *grads[6]) if t is not None], saved


def main() -> None:
    from triton.testing import do_bench

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["8x4096", "4x8192", "1x32768"], metavar="BxT")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--segments", type=int, nargs="*", default=[], help="tokens a segment, besides the rule's")
    ap.add_argument("--out", default="bench/results/gain_throughput.json")
    a = ap.parse_args()
    H, K = a.heads, a.head_dim
    rows = []
    print(f"{'B x T':>9} {'path':<18} {'fwd ms':>8} {'bwd ms':>8} {'fwd GB/s':>9} {'bwd GB/s':>9} {'diff':>8} bitwise")
    for shape in a.shapes:
        B, T = (int(v) for v in shape.split("x"))
        x = inputs(B, T, H, K)
        n = B * T * H * K
        moved_fwd = n * (2 + 4 + 2 + 2)  # k, g, omega's input in; kappa out
        moved_bwd = n * (2 + 4 + 2 + 2 + 2 + 4 + 2 + 2 + 2)  # the same, dkappa, dk_mem, dg_mem in; dk, df, domega out
        paths = {"rule": None} | {f"segments of {s}": s for s in a.segments}
        base = None
        for name, seg in paths.items():
            flat, saved = results(x, seg)
            bitwise = all(torch.equal(u, v) for u, v in zip(flat, results(x, seg)[0]))
            base = flat if base is None else base
            diff = max(((u.double() - v.double()).norm() / v.double().norm()).item() for u, v in zip(flat, base))
            ms_f = do_bench(partial(forward, x, seg))
            ms_b = do_bench(partial(backward, x, saved, seg))
            row = {"B": B, "T": T, "H": H, "K": K, "path": name, "segment": seg, "fwd_ms": ms_f, "bwd_ms": ms_b,
                   "fwd_GBps": moved_fwd / ms_f / 1e6, "bwd_GBps": moved_bwd / ms_b / 1e6,
                   "max_rel_diff_vs_rule": diff, "bitwise_repeat": bitwise}
            rows.append(row)
            print(f"{shape:>9} {name:<18} {ms_f:8.3f} {ms_b:8.3f} {row['fwd_GBps']:9.0f} {row['bwd_GBps']:9.0f} "
                  f"{diff:8.1e} {bitwise}")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": rows}
    write_atomic(Path(a.out), json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
