"""KDA's gate as Diagonal KDN's training step needs it, forward, on CUDA: ours in one pass
(``kdn.ops.triton.gate.kda_gate_fwd``: ``g``, its chunk-local sums in log2 units and each token's steepest channel)
against the passes it replaced (fla's ``fused_kda_gate``, ``chunk_local_cumsum`` and ``kdn.ops.triton.safe_gate``' row
minimum) and against fla's fused gate + chunk sums (``kda_gate_chunk_cumsum``, which does not give ``g``).

Shapes as in a 750M step: 8 x 4096 tokens, 16 heads of 128, the gate's input in bf16. Prints a table (ms and the
bytes that must move per second) and writes ``--out`` (JSON).

    python -m bench.gate_throughput --out bench/results/gate_throughput.json
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from bench.mixer_throughput import write_atomic


def main() -> None:
    from fla.ops.kda.gate import fused_kda_gate, kda_gate_chunk_cumsum
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2
    from triton.testing import do_bench

    from kdn.ops.triton.gate import kda_gate_fwd
    from kdn.ops.triton.safe_gate import _steepest_triton
    from kdn.ops.validate import ASYM_CHUNK

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs=2, default=[8, 4096], metavar=("B", "T"))
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--out", default="bench/results/gate_throughput.json")
    a = ap.parse_args()
    (B, T), H, K = a.tokens, a.heads, a.head_dim
    f = (2 * torch.randn(B, T, H, K, device="cuda")).bfloat16()
    A_log = torch.rand(H, device="cuda").mul(15).add(1).log()
    dt_bias = torch.randn(H * K, device="cuda") - 3.0

    def three_passes() -> tuple[Tensor, ...]:
        g = fused_kda_gate(f, A_log, dt_bias)
        return g, chunk_local_cumsum(g, chunk_size=ASYM_CHUNK, scale=RCP_LN2), _steepest_triton(g)

    def fla_fused() -> tuple[Tensor, ...]:
        return (fused_kda_gate(f, A_log, dt_bias),
                kda_gate_chunk_cumsum(f, A_log, chunk_size=ASYM_CHUNK, scale=RCP_LN2, dt_bias=dt_bias))

    fns: dict[str, Callable[[], tuple[Tensor, ...]]] = {
        "ours: kda_gate_fwd (g, gc, steep)": lambda: kda_gate_fwd(f, A_log, dt_bias),
        "fla gate + chunk_local_cumsum + row min": three_passes,
        "fla gate + kda_gate_chunk_cumsum (g, gc)": fla_fused,
    }
    n = B * T * H * K
    moved = {"ours: kda_gate_fwd (g, gc, steep)": 2 * n + 8 * n + 4 * B * T * H,
             "fla gate + chunk_local_cumsum + row min": 2 * n + 4 * n + 8 * n + 4 * n + 4 * B * T * H,
             "fla gate + kda_gate_chunk_cumsum (g, gc)": 2 * n + 4 * n + 2 * n + 4 * n}
    rows, outs = [], {}
    for name, fn in fns.items():
        ms = do_bench(fn)
        outs[name] = fn()
        rows.append({"path": name, "ms": ms, "GBps": moved[name] / ms / 1e6})
    ours, ref = outs["ours: kda_gate_fwd (g, gc, steep)"], outs["fla gate + chunk_local_cumsum + row min"]
    diff = {n: ((o - r).norm() / r.norm()).item() for n, o, r in zip(("g", "gc", "steep"), ours, ref)}
    print(f"{'path':<42} {'ms':>8} {'GB/s':>6}")
    for r in rows:
        print(f"{r['path']:<42} {r['ms']:8.3f} {r['GBps']:6.0f}")
    print("relative difference, ours against fla's passes:", {n: f"{v:.1e}" for n, v in diff.items()})
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "B": B, "T": T, "H": H, "K": K,
              "results": rows, "relative_difference_vs_fla": diff}
    write_atomic(Path(a.out), json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
