"""Where a mixer layer's time goes: the top CUDA kernels of one fwd+bwd under the PyTorch profiler.

``python -m bench.profile_layer --mixer kdn_iso --T 8192`` prints a table of kernels by total CUDA time.
"""
from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from bench.mixer_throughput import build_layer, variant


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mixer", default="kdn_iso", help="bench.mixer_throughput name (kdn_diag@asym)")
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rows", type=int, default=25)
    args = ap.parse_args()
    with variant(args.mixer) as base:
        layer = build_layer(base, 2048, 16, 128)
        x = torch.randn(args.batch, args.T, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3):
            layer(x)[0].sum().backward()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            layer(x)[0].sum().backward()
            torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=70))


if __name__ == "__main__":
    main()
