"""Host time of one TileLang kernel lookup in Mamba-3 MIMO, as mamba-ssm asks for it and through
:class:`models.layers._mamba_kernels.ShapeStableJit`.

``python -m bench.tilelang_dispatch [--hidden 256 --state 32 --head-dim 64 --batch 512 --seq-len 64] [--calls 20]``
runs one bf16 forward and backward of the MIMO layer (which compiles, or loads from TileLang's cache, every kernel
it needs), then times, for every kernel it looked up, ``--calls`` lookups each way: mamba-ssm's (the TileLang
factory called with new ``T.dynamic`` variables, which misses its compiled-kernel cache) and the wrapper's. It also
times the layer's eager forward and backward. Prints a table; writes ``bench/results/tilelang_dispatch.json``.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from common.device import device_name
from eval.results import git_commit, versions
from trainer.checkpoint import write_json_atomic

RESULTS = Path(__file__).parent / "results"


def _median_s(fn: Callable[[], object], calls: int) -> float:
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def lookups(calls: int) -> list[dict]:
    """Per kernel the wrapper holds: the median seconds of a lookup through TileLang's factory with new symbolic
    variables (mamba-ssm's call) and through the wrapper."""
    import tilelang.language as T

    from models.layers._mamba_kernels import MIMO_KERNEL_MODULES, ShapeStableJit

    rows = []
    for name in MIMO_KERNEL_MODULES:
        module = importlib.import_module(name)
        for attr, factory in vars(module).items():
            if not isinstance(factory, ShapeStableJit):
                continue
            for key in list(factory.kernels):
                def call(fn: Callable[..., object], key: tuple = key) -> object:
                    args, kwargs = ShapeStableJit.arguments(key, T.dynamic)
                    return fn(*args, **kwargs)

                rows.append({"kernel": f"{name.rsplit('.', 1)[-1]}.{attr}",
                             "upstream_ms": 1e3 * _median_s(lambda c=call, f=factory: c(f.factory), calls),
                             "wrapped_ms": 1e3 * _median_s(lambda c=call, f=factory: c(f), calls)})
    return rows


def main(argv: list[str] | None = None) -> None:
    from models.layers.mamba3 import Mamba3

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--state", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--out", type=Path, default=RESULTS / "tilelang_dispatch.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.tilelang_dispatch needs a CUDA GPU with mamba-ssm and TileLang; run it on one")
    dev = torch.device("cuda")
    layer = Mamba3(args.hidden, state_size=args.state, head_dim=args.head_dim, is_mimo=True, mimo_rank=4,
                   layer_idx=0, backend="kernels").to(dev)
    x = torch.randn(args.batch, args.seq_len, args.hidden, device=dev, requires_grad=True)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)[0]
        y.float().square().mean().backward()
        torch.cuda.synchronize()

    t0 = time.perf_counter()
    step()  # compiles or loads every kernel
    first_s = time.perf_counter() - t0
    step_ms = 1e3 * _median_s(step, args.calls)
    rows = lookups(args.calls)
    header = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "git_commit": git_commit(), "device": device_name("cuda"),
              "versions": versions(("mamba_ssm", "tilelang")),
              "command": "python -m bench.tilelang_dispatch " + " ".join(sys.argv[1:] if argv is None else argv),
              "shape": {k: v for k, v in vars(args).items() if k != "out"},
              "first_step_s": first_s, "eager_step_ms": step_ms}
    print(f"MIMO layer {args.hidden}:{args.state}:{args.head_dim} at {args.batch}x{args.seq_len}: first step "
          f"{first_s:.1f} s, then an eager forward + backward {step_ms:.2f} ms (median of {args.calls})")
    print(f"{'kernel':<40} {'mamba-ssm lookup ms':>20} {'wrapped lookup ms':>18}")
    for r in rows:
        print(f"{r['kernel']:<40} {r['upstream_ms']:>20.2f} {r['wrapped_ms']:>18.4f}")
    write_json_atomic(args.out, {"header": header, "rows": rows})


if __name__ == "__main__":
    main()
