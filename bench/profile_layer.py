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
    ap.add_argument("--ops", action="store_true",
                    help="also the PyTorch operators (with input shapes) by the device time of their kernels")
    args = ap.parse_args()
    base, settings = variant(args.mixer)
    layer = build_layer(base, 2048, 16, 128, **settings)
    x = torch.randn(args.batch, args.T, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for _ in range(3):
        layer(x)[0].sum().backward()
    torch.cuda.synchronize()
    acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if args.ops else [])
    with profile(activities=acts, record_shapes=args.ops) as prof:
        layer(x)[0].sum().backward()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA] if args.ops else None
    if kernels is None:
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=70))
        return
    total = sum(e.self_device_time_total for e in kernels) / 1e3
    print(f"{'kernel':<72}{'calls':>6}{'ms':>9}  ({total:.2f} ms of CUDA time in all)")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:args.rows]:
        print(f"{e.key[:70]:<72}{e.count:>6}{e.self_device_time_total / 1e3:>9.3f}")
    ops = [e for e in prof.key_averages(group_by_input_shape=True)
           if e.key.startswith("aten::") and e.self_device_time_total > 0]
    print(f"\n{'operator (self device time)':<40}{'calls':>6}{'ms':>9}  input shapes")
    for e in sorted(ops, key=lambda e: -e.self_device_time_total)[:args.rows]:
        print(f"{e.key[:38]:<40}{e.count:>6}{e.self_device_time_total / 1e3:>9.3f}  {str(e.input_shapes)[:90]}")


if __name__ == "__main__":
    main()
