"""The front end's short convolutions of a training step, ours fused (``kdn.modules.conv.front_conv``) against fla's
kernels (``causal_conv1d`` per stream on views of the joint projection, ``l2norm`` on ``q`` and ``k``, and
autograd's ``cat`` of the views' gradients), forward and forward + backward, on CUDA.

Shapes as in a 750M step: 8 x 4096 tokens, 16 heads of 128, the joint projection 6544 wide (``q, k, v`` and
Diagonal KDN's other projections), bf16. Our kernels run at each ``--configs`` entry ``L_FWD,L_BWD,HEADS`` (tokens
per program forward and backward, heads per program at most). Prints a table (ms and the bytes that must move per
second) and writes ``--out`` (JSON).

    python -m bench.conv_throughput --configs 64,64,4 128,128,2 --out bench/results/conv_throughput.json
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from bench.mixer_throughput import write_atomic


def fla_front(y: Tensor, w: Tensor, H: int, K: int, V: int) -> tuple[Tensor, ...]:
    """fla's path, as ``DeltaFrontEnd.inputs`` took it before the fusion: ``(q, k, v, rest)``."""
    from fla.modules.causal_conv1d import causal_conv1d
    from fla.modules.norm.l2norm import l2norm

    B, T, _ = y.shape
    widths = [H * K, H * K, H * V]
    *streams, rest = y.split([*widths, y.shape[-1] - sum(widths)], -1)
    outs, at = [], 0
    for x, n in zip(streams, widths):
        outs.append(causal_conv1d(x, w[at:at + n].to(x.dtype), activation="silu")[0])
        at += n
    q, k, v = outs
    return l2norm(q.view(B, T, H, K), eps=1e-12), l2norm(k.view(B, T, H, K), eps=1e-12), v.view(B, T, H, V), rest


def main() -> None:
    from triton.testing import do_bench

    from kdn.modules.conv import front_conv

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs=2, default=[8, 4096], metavar=("B", "T"))
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rest", type=int, default=400, help="columns of the joint projection after q, k, v")
    ap.add_argument("--configs", nargs="+", default=["64,64,4", "128,128,4", "64,64,2", "128,64,1", "256,128,4"])
    ap.add_argument("--out", default="bench/results/conv_throughput.json")
    a = ap.parse_args()
    (B, T), H, K = a.tokens, a.heads, a.head_dim
    C = 3 * H * K
    y = torch.randn(B, T, C + a.rest, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(C, 4, device="cuda") / 2).requires_grad_()
    grads = [torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    grads.append(torch.randn(B, T, a.rest, device="cuda", dtype=torch.bfloat16))

    def ours(cfg: str) -> Callable[[], tuple[Tensor, ...]]:
        def run() -> tuple[Tensor, ...]:
            tokens_fwd, tokens_bwd, heads = (int(c) for c in cfg.split(","))
            return front_conv(y, w, H, K, K, 1e-12, tokens_fwd=tokens_fwd, tokens_bwd=tokens_bwd, heads=heads)
        return run

    fns = {"fla causal_conv1d x3 + l2norm x2": lambda: fla_front(y, w, H, K, K)}
    fns |= {f"ours L_FWD,L_BWD,HEADS={c}": ours(c) for c in a.configs}
    moved = {"fwd": 2 * B * T * (C + C + a.rest * 2), "bwd": 2 * B * T * (C + C + C + a.rest * 2)}
    rows, outs = [], {}
    for name, fn in fns.items():
        fwd = do_bench(lambda fn=fn: fn())
        both = do_bench(lambda fn=fn: torch.autograd.backward(fn(), grads), grad_to_none=[y, w])
        torch.autograd.backward(fn(), grads)
        outs[name] = [t.detach().float() for t in (*fn(), y.grad, w.grad)]
        y.grad = w.grad = None
        rows.append({"path": name, "fwd_ms": fwd, "fwd_bwd_ms": both, "fwd_GBps": moved["fwd"] / fwd / 1e6,
                     "bwd_GBps": moved["bwd"] / (both - fwd) / 1e6})
    ref, *rest = outs.values()
    names = ("q", "k", "v", "rest", "dy", "dw")
    diff = {n: max(((o[i] - ref[i]).norm() / ref[i].norm()).item() for o in rest) for i, n in enumerate(names)}
    print(f"{'path':<36} {'fwd ms':>8} {'GB/s':>6} {'fwd+bwd ms':>11} {'bwd GB/s':>9}")
    for r in rows:
        print(f"{r['path']:<36} {r['fwd_ms']:8.3f} {r['fwd_GBps']:6.0f} {r['fwd_bwd_ms']:11.3f} {r['bwd_GBps']:9.0f}")
    print("largest relative difference, ours against fla:", {n: f"{v:.1e}" for n, v in diff.items()})
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "B": B, "T": T, "H": H, "K": K,
              "rest": a.rest, "results": rows, "relative_difference_vs_fla": diff}
    write_atomic(Path(a.out), json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
