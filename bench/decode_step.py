"""One-token decoding step of KDN: the fused Triton kernel against the PyTorch step, on CUDA.

``python -m bench.decode_step`` prints a table and writes ``bench/results/decode_step.json``
(B = 4 and 64 sequences, 16 heads x 128, FP32 state; median of 100 steps).
"""
from __future__ import annotations

import json
import statistics
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

import kdn
from kdn.ops import fused_recurrent, naive


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench.decode_step needs a CUDA device")
    H, K = 16, 128
    rows = []
    for B in (4, 64):
        for iso in (False, True):
            x = {"q": F.normalize(torch.randn(B, H, K, device="cuda"), dim=-1),
                 "k": F.normalize(torch.randn(B, H, K, device="cuda"), dim=-1),
                 "v": torch.randn(B, H, K, device="cuda"), "g": -torch.rand(B, H, K, device="cuda"),
                 "omega": torch.rand(*((B, H) if iso else (B, H, K)), device="cuda"),
                 "r": torch.rand(B, H, device="cuda") + 0.1}
            state = (torch.randn(B, H, K, K, device="cuda"), torch.rand(*((B, H) if iso else (B, H, K)), device="cuda"))
            mu = torch.full((H,), float(K), device="cuda")
            ref = naive.isotropic_kdn_step_ref if iso else naive.diagonal_kdn_step_ref
            step = kdn.isotropic_kdn_step if iso else kdn.diagonal_kdn_step
            step_kernel = (fused_recurrent.fused_recurrent_isotropic_kdn if iso
                           else fused_recurrent.fused_recurrent_diagonal_kdn)
            fused = partial(step_kernel, *(t[:, None] for t in x.values()), mu, state)
            for name, fn in (("fused", fused), ("torch", partial(ref, *x.values(), mu, state)),
                             ("api", partial(step, **x, state=state))):
                times = []
                with torch.no_grad():
                    for i in range(120):
                        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        s.record()
                        fn()
                        e.record()
                        e.synchronize()
                        if i >= 20:
                            times.append(s.elapsed_time(e) * 1e3)
                rows.append({"variant": "isotropic" if iso else "diagonal", "B": B, "impl": name,
                             "us_per_step": statistics.median(times)})
    out = Path(__file__).parent / "results" / "decode_step.json"
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    for r in rows:
        print(f"{r['variant']:<10} B={r['B']:<3} {r['impl']:<6} {r['us_per_step']:8.1f} us")


if __name__ == "__main__":
    main()
