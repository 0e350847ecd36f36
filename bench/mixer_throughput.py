"""Single-layer mixer throughput on one GPU (the paper's Fig. 4): fwd+bwd and fwd, kernel-only times.

``python -m bench.mixer_throughput [--T 2048 4096 ...] [--mixers kdn_diag kda ...] [--repeats 30]``
prints a table and writes ``bench/results/mixer_throughput.json`` (+ ``.png``). Settings follow the paper:
d_model 2048, 16 heads x 128, batch 4, bf16; medians over ``--repeats`` timed runs after warm-up.
``--merge a.json b.json --out c.json`` joins sweeps run side by side on GPUs of one machine.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from bench import roofline
from common import write_atomic
from eval.results import git_commit

RESULTS = Path(__file__).parent / "results"


class CausalSDPA(nn.Module):
    """Full causal multi-head attention through ``F.scaled_dot_product_attention`` (the throughput baseline)."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.H, self.D = num_heads, head_dim
        self.qkv = nn.Linear(hidden_size, 3 * num_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.H, self.D).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1)), None, None


BENCH_OPTIONS: dict[str, dict[str, object]] = {
    "mamba3_siso": {"state_size": 128, "backend": "kernels"},  # mamba-ssm's SISO kernel at its default d_state
    "mamba3_mimo": {"state_size": 128, "backend": "kernels"},  # TileLang, mimo_rank 4 (the layer's default)
}
"""Options the benchmark sets beyond a mixer's defaults (the registry matches Mamba-3's state to KDA's)."""
WINDOWS = {"attn_swa": 2048, "attn_full": None}
"""The attention variants: the model's attention mixer (RoPE; block-sparse window or full causal flash)."""


def build_layer(name: str, d: int, H: int, K: int, **settings: object) -> nn.Module:
    """A single mixer layer on CUDA in bf16, built as the models build it (:data:`models.MIXERS`); ``attn`` is the
    plain SDPA baseline. ``settings``: the mixer's options (Diagonal KDN's memory route, :func:`variant`, and the KDN
    memory's ``precision``). Raises ImportError when its kernels are not installed."""
    from models import MIXERS, KDNConfig

    if name == "attn":
        if settings:
            raise ValueError(f"the SDPA baseline takes no options, got {settings}")
        return CausalSDPA(d, H, K).cuda().to(torch.bfloat16)
    mixer = "attn" if name in WINDOWS else name
    cfg = KDNConfig(hidden_size=d, num_heads=H, head_dim=K, num_layers=1, mixer=mixer,
                    mixer_kwargs={**BENCH_OPTIONS.get(mixer, {}), **settings}, window=WINDOWS.get(name))
    return MIXERS[mixer].build(cfg, 0, cfg.mixer_kwargs).cuda().to(torch.bfloat16)


def kernel_call(name: str, B: int, T: int, H: int, K: int,
                **settings: object) -> tuple[tuple[torch.Tensor, ...], Callable[[], torch.Tensor]] | None:
    """``(leaves, run)``: the recurrent kernel of mixer ``name`` on layer-like inputs (``leaves``, each requiring its
    gradient) and a call of it returning its output, for the mixers we can call directly (None for the others);
    ``settings`` as in :func:`build_layer`. KDN runs as its layers call it, without the API's value checks
    (``validate=False``: a NaN/range pass over every input and a host sync, not the recurrence)."""
    import kdn
    from models.registry import KDN_MIXERS  # here, not at the top: `--help` need not import the models

    dev = torch.device("cuda")
    q = F.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).mul(K ** -0.5).bfloat16().requires_grad_()
    k = F.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).bfloat16().requires_grad_()
    v = torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
    g = (-torch.rand(B, T, H, K, device=dev) * 0.5).requires_grad_()
    r = (torch.rand(B, T, H, device=dev) + 0.1).requires_grad_()
    if name == "kda":
        from fla.ops.kda import chunk_kda

        beta = torch.rand(B, T, H, device=dev, dtype=torch.bfloat16, requires_grad=True)
        return (q, k, v, g, beta), lambda: chunk_kda(q, k, v, g, beta, scale=1.0)[0]
    if name in KDN_MIXERS:
        iso = name == "kdn_iso"
        omega = torch.rand(*((B, T, H) if iso else (B, T, H, K)), device=dev).requires_grad_()
        fn = partial(kdn.isotropic_kdn if iso else kdn.diagonal_kdn, validate=False, **settings)
        return (q, k, v, g, omega, r), lambda: fn(q, k, v, g, omega, r)[0]
    return None


def kernel_fn(name: str, B: int, T: int, H: int, K: int, **settings: object) -> Callable[[], None] | None:
    """The recurrent kernel alone (fwd+bwd) of :func:`kernel_call`, for the mixers it can call. Every mixer's input
    gradients are handed over, not summed into the previous call's (``.grad`` cleared first), as in a layer whose
    gradients flow on to the projections."""
    call = kernel_call(name, B, T, H, K, **settings)
    return None if call is None else fwdbwd_step(*call)


def fwdbwd_step(leaves: tuple[torch.Tensor, ...], run: Callable[[], torch.Tensor]) -> Callable[[], None]:
    """One forward + backward of ``run`` (:func:`kernel_call`), its leaves' gradients cleared first."""

    def step() -> None:
        for x in leaves:
            x.grad = None
        run().sum().backward()

    return step


def time_ms(fn: Callable[[], None], repeats: int, warmup: int = 5) -> float:
    """Median wall time of ``fn`` in ms, by CUDA events, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def variant(name: str) -> tuple[str, dict[str, object]]:
    """``(base mixer name, settings)`` of the mixer ``name``. Diagonal KDN memory variants (the ``memory`` and
    ``chunk_size`` arguments of :class:`kdn.DiagonalKDN`): ``kdn_diag@asym`` fla's asymmetric chunk-64 kernels,
    ``kdn_diag@dplr`` fla's DPLR kernels at chunk 16, ``kdn_diag@c32`` at chunk 32 (16 or 32; 64 is refused)."""
    if "@" not in name:
        return name, {}
    base, tag = name.split("@")
    if tag in ("asym", "dplr"):
        return base, {"memory": tag}
    if tag in ("c16", "c32"):
        return base, {"memory": "dplr", "chunk_size": int(tag[1:])}
    raise ValueError(f"unknown variant {tag!r} in {name!r}; known: asym, dplr, c16, c32")


def host_ms(fn: Callable[[], None], repeats: int = 3) -> float:
    """Mean host (CPU) time in ms to enqueue one call of ``fn``, from an idle GPU. When it approaches the
    device time, launches (Python, autograd, Triton's launcher) rather than kernels bound the layer."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / repeats * 1e3


def measure(name: str, B: int, T: int, d: int, H: int, K: int, repeats: int, precision: str | None = None) -> dict:
    """One row (``name`` may carry a :func:`variant` tag; ``precision``: the KDN memory's, recorded in the row)."""
    base, settings = variant(name)
    if precision is not None:
        settings["precision"] = precision
    layer = build_layer(base, d, H, K, **settings)
    n_params = sum(p.numel() for p in layer.parameters())
    x = torch.randn(B, T, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(B, T, d, device="cuda", dtype=torch.bfloat16)

    def fwdbwd() -> None:
        layer(x)[0].backward(dy)

    def fwd() -> None:
        with torch.no_grad():
            layer(x)

    torch.cuda.reset_peak_memory_stats()
    ms_fb = time_ms(fwdbwd, repeats)
    peak = torch.cuda.max_memory_allocated() / 2**30
    ms_f = time_ms(fwd, repeats)
    ms_host = host_ms(fwdbwd)
    kf = kernel_fn(base, B, T, H, K, **settings)
    ms_kernel = time_ms(kf, repeats) if kf is not None else None
    linear_flops = 6 * n_params * B * T  # projections, fwd+bwd
    row = {
        "mixer": name, **({} if precision is None else {"precision": precision}), "T": T, "ms_fwdbwd": ms_fb,
        "ms_fwd": ms_f, "ms_kernel_fwdbwd": ms_kernel,
        "ms_host_fwdbwd": ms_host,
        "tokens_per_s": B * T / (ms_fb / 1e3), "peak_mem_gb": peak, "params": n_params,
        "linear_tflops": linear_flops / (ms_fb / 1e3) / 1e12,
    }
    if ms_kernel is not None:  # the kernel-only run against the analytic floors (bench.roofline)
        row.update(roofline.achieved(name.split("@")[0], B, T, H, K, K, ms_kernel, torch.cuda.get_device_name()))
    return row


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(r["mixer"] for r in rows):
        pts = [(r["T"], r["tokens_per_s"] / 1e6) for r in rows if r["mixer"] == name and "error" not in r]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length T")
    ax.set_ylabel("M tokens / s (fwd+bwd, 1 layer)")
    ax.set_title("Mixer throughput, one H200, B=4, d=2048, bf16")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, path)


def report(rows: list[dict], device: str) -> None:
    """Print the table of ``rows`` measured on ``device``; the ``x KDA`` column is each row's tokens/s over KDA's at
    the same T."""
    ref = {r["T"]: r["tokens_per_s"] for r in rows if r["mixer"] == "kda" and "error" not in r}
    print(f"\n{'mixer':<14}{'T':>7}{'fwd+bwd ms':>12}{'fwd ms':>9}{'host ms':>9}{'kernel ms':>11}{'Mtok/s':>9}"
          f"{'x KDA':>7}{'peak GB':>9}{'kern TF/s':>11}{'kern GB/s':>11}")
    for r in rows:
        label = r["mixer"] + (f"/{r['precision']}" if "precision" in r else "")
        if "error" in r:
            print(f"{label:<14}{r['T']:>7}  {r['error'][:70]}")
            continue
        kern = f"{r['ms_kernel_fwdbwd']:.2f}" if r["ms_kernel_fwdbwd"] is not None else "-"
        ratio = r["tokens_per_s"] / ref[r["T"]] if r["T"] in ref else math.nan
        tf = f"{r['kernel_tflops']:.1f}" if "kernel_tflops" in r else "-"
        gb = f"{r['kernel_gbps']:.0f}" if "kernel_gbps" in r else "-"
        print(f"{label:<14}{r['T']:>7}{r['ms_fwdbwd']:>12.2f}{r['ms_fwd']:>9.2f}{r['ms_host_fwdbwd']:>9.2f}{kern:>11}"
              f"{r['tokens_per_s'] / 1e6:>9.3f}{ratio:>7.2f}{r['peak_mem_gb']:>9.2f}{tf:>11}{gb:>11}")
    peak = roofline.ceilings(device)
    print((f"{device}'s ceilings: {peak[0]:.0f} TFLOP/s bf16 dense, {peak[1]} TB/s HBM" if peak else
           f"no ceilings known for {device}") + " (kernel columns: bench.roofline's analytic FLOPs and compulsory "
          "bytes over the kernel-only time); host ms: CPU time to enqueue one fwd+bwd")


def merge(paths: list[Path], out: Path) -> None:
    """Join the results of sweeps that ran at the same time on GPUs of one machine (e.g. through
    bench/gpu_pair.sh) into one file at ``out`` (+ ``.png``): the first file's header, with every header
    under ``"merged_from"``; rows ordered by T, then by the order in which the mixers first appear."""
    runs = [json.loads(p.read_text()) for p in paths]
    rows = [r for run in runs for r in run["results"]]
    order = {m: i for i, m in enumerate(dict.fromkeys(r["mixer"] for r in rows))}
    rows.sort(key=lambda r: (r["T"], order[r["mixer"]]))
    header = {**runs[0]["header"], "merged_from": [run["header"] for run in runs]}
    write_atomic(out, json.dumps({"header": header, "results": rows}, indent=1))
    plot(rows, out.with_suffix(".png"))
    report(rows, header["device"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mixers", nargs="+",
                    default=["kdn_diag", "kdn_iso", "kda", "deltanet", "gdn", "gdn2", "mamba3_siso", "mamba3_mimo",
                             "attn"])
    ap.add_argument("--T", nargs="+", type=int, default=[2048, 4096, 8192, 16384, 32768])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--precision", nargs="+", choices=["bf16", "fp32"],
                    help="time the KDN mixers at each of these memory precisions (default: the layers' default)")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", type=Path, default=RESULTS / "mixer_throughput.json")
    ap.add_argument("--merge", nargs="+", type=Path, metavar="JSON",
                    help="join these result files into --out instead of measuring (no GPU needed)")
    args = ap.parse_args()
    if args.merge:
        merge(args.merge, args.out)
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench.mixer_throughput needs a CUDA device")
    import fla
    import triton

    d, H, K = 2048, 16, 128
    rows: list[dict] = []
    header = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "fla": fla.__version__, "date": datetime.date.today().isoformat(), "batch": args.batch,
        "d_model": d, "heads": H, "head_dim": K, "dtype": "bfloat16", "repeats": args.repeats,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "commit": git_commit(),
    }
    for T in args.T:
        for name, precision in [(n, p) for n in args.mixers
                                for p in (args.precision if args.precision and n.startswith("kdn") else [None])]:
            try:
                row = measure(name, args.batch, T, d, H, K, args.repeats, precision)
            except Exception as e:  # kernels missing, refused or out of resources here: a row that says so
                row = {"mixer": name, **({} if precision is None else {"precision": precision}), "T": T,
                       "error": f"{type(e).__name__}: {str(e)[:200]}"}
            torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps(row), flush=True)
            # after every row, so that a sweep stopped by a time limit keeps what it measured
            write_atomic(args.out, json.dumps({"header": header, "results": rows}, indent=1))
    plot(rows, args.out.with_suffix(".png"))
    report(rows, header["device"])


if __name__ == "__main__":
    main()
