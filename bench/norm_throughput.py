"""The pre-norm residual add + RMSNorm of a training step, ours (``kdn.modules.norm``) against fla's fused prenorm
kernel (``rms_norm(..., residual=..., prenorm=True, residual_in_fp32=True)``), forward and backward, on CUDA.

Shapes as in a 750M step: rows = batch x sequence (8 x 4096), width 2048, a bf16 sublayer output on an FP32
stream with an FP32 weight. Prints a table (ms and the bytes moved per second) and writes ``--out`` (JSON).

    python -m bench.norm_throughput --rows 32768 --width 2048 --out bench/results/norm_throughput.json
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from bench.mixer_throughput import write_atomic


def _moved_bytes(rows: int, width: int, backward: bool) -> int:
    """Bytes a pass must move: forward reads x (bf16) and the stream (FP32), writes the stream and the output;
    backward reads the stream, the output's and the stream's gradients, writes both input gradients."""
    x, s = 2 * rows * width, 4 * rows * width
    return (s + x + s + s + x) if backward else (x + s + s + x)


def _fns(block_rows: list[int]) -> dict[str, Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]]:
    """fla's kernel, then ours at each backward ``ROWS`` (rows per program)."""
    from fla.modules.norm.layernorm import rms_norm

    from kdn.modules.norm import add_rms_norm

    def ours(n: int) -> Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]:
        def run(x: Tensor, s: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
            return add_rms_norm(x, s, w, 1e-5, rows=n)
        return run

    fns = {"fla rms_norm(prenorm)": lambda x, s, w: rms_norm(x, w, None, residual=s, eps=1e-5, prenorm=True,
                                                             residual_in_fp32=True)}
    return fns | {f"kdn.modules.norm ROWS={n}": ours(n) for n in block_rows}


def main() -> None:
    from triton.testing import do_bench

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8 * 4096)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--block-rows", type=int, nargs="+", default=[64], help="our backward's rows per program")
    ap.add_argument("--out", default="bench/results/norm_throughput.json")
    a = ap.parse_args()
    dev = "cuda"
    x = torch.randn(a.rows, a.width, device=dev, dtype=torch.bfloat16, requires_grad=True)
    s = torch.randn(a.rows, a.width, device=dev, dtype=torch.float32, requires_grad=True)
    w = torch.rand(a.width, device=dev, requires_grad=True)
    dy, ds = torch.randn_like(x), torch.randn_like(s)
    rows, outs = [], {}
    for name, fn in _fns(a.block_rows).items():
        y, r = fn(x, s, w)  # (ours: sets ROWS, which the backward reads)
        fwd = do_bench(lambda fn=fn: fn(x, s, w))
        bwd = do_bench(lambda y=y, r=r: torch.autograd.backward((y, r), (dy, ds), retain_graph=True),
                       grad_to_none=[x, s, w])
        torch.autograd.backward((y, r), (dy, ds))
        outs[name] = [t.detach().float() for t in (y, r, x.grad, s.grad, w.grad)]
        x.grad = s.grad = w.grad = None
        rows.append({"kernel": name, "fwd_ms": fwd, "bwd_ms": bwd,
                     "fwd_GBps": _moved_bytes(a.rows, a.width, False) / fwd / 1e6,
                     "bwd_GBps": _moved_bytes(a.rows, a.width, True) / bwd / 1e6})
    ref, *ours = outs.values()
    names = ("y", "stream", "dx", "dstream", "dw")
    diff = {n: max(((o[i] - ref[i]).norm() / ref[i].norm()).item() for o in ours) for i, n in enumerate(names)}
    print(f"{'kernel':<24} {'fwd ms':>8} {'fwd GB/s':>9} {'bwd ms':>8} {'bwd GB/s':>9}")
    for r in rows:
        print(f"{r['kernel']:<24} {r['fwd_ms']:8.3f} {r['fwd_GBps']:9.0f} {r['bwd_ms']:8.3f} {r['bwd_GBps']:9.0f}")
    print("largest relative difference, ours against fla:", {n: f"{v:.1e}" for n, v in diff.items()})
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": a.rows, "width": a.width,
              "results": rows, "relative_difference_vs_fla": diff}
    write_atomic(Path(a.out), json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
