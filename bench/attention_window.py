"""Sliding-window attention on one GPU: the layer and its core against full causal attention, compile costs, and
the bf16 error of the block-sparse path against the dense-mask path it replaces.

``python -m bench.attention_window [--T 2048 4096 8192 16384 32768] [--window 2048] [--seeds 20]`` prints three
tables and writes ``--out`` (default ``bench/results/attention_window.json``):

- **layer** (``models.layers.attention.Attention``, d 2048, 16 heads x 128, batch 4, bf16, fwd+bwd, median of
  ``--repeats``): the ``window`` layer on flex_attention's block masks, the same layer on SDPA's dense masks (up to
  ``--dense-max-T``), and the full causal layer (SDPA's flash kernel); ratios to the full layer.
- **core** (attention alone on ``[B, H, T, K]``): our block mask, flex_attention's own sliding-window
  ``create_block_mask``, and SDPA ``is_causal``.
- **compile**: the first training call of a shape (forward + backward compiled), and prompts of ``--prompt-lengths``
  under ``torch.no_grad`` (one dynamic-shape compilation), with Dynamo's count of compiled graphs.
- **errors**: over ``--seeds`` draws, ``||o - ref|| / ||ref||`` of outputs and input gradients against float64, for
  the block-sparse and the dense path (plain window and packed documents); the GPU tests' bounds come from these.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.mixer_throughput import RESULTS, time_ms, write_atomic
from eval.results import git_commit
from models.layers.attention import Attention
from models.layers.window_attention import block_mask_for, flex_windowed


def layer_row(T: int, window: int, B: int, repeats: int, dense_max_T: int) -> dict:
    """fwd+bwd of the windowed layer (flex, dense up to ``dense_max_T``) and the full causal layer at ``T``."""
    d, H, K = 2048, 16, 128
    x = torch.randn(B, T, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(B, T, d, device="cuda", dtype=torch.bfloat16)
    row: dict = {"T": T}
    for name, w, backend in (("window_flex", window, "auto"), ("window_dense", window, "sdpa"),
                             ("full", None, "auto")):
        if name == "window_dense" and T > dense_max_T:
            continue
        layer = Attention(d, H, K, window=w, layer_idx=0, backend=backend).cuda().to(torch.bfloat16)
        torch.cuda.reset_peak_memory_stats()
        row[f"{name}_ms"] = time_ms(lambda layer=layer: layer(x)[0].backward(dy), repeats)
        row[f"{name}_peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
        del layer
        torch.cuda.empty_cache()
    row["window_flex_over_full"] = row["window_flex_ms"] / row["full_ms"]
    if "window_dense_ms" in row:
        row["window_dense_over_full"] = row["window_dense_ms"] / row["full_ms"]
    print(json.dumps(row), flush=True)
    return row


def core_row(T: int, window: int, B: int, repeats: int, flex: Callable[..., torch.Tensor]) -> dict:
    """Attention alone at ``T``, fwd+bwd: our block mask, flex_attention's own sliding-window mask (``flex``
    compiled), SDPA causal."""
    from torch.nn.attention.flex_attention import create_block_mask

    torch._dynamo.reset()  # the shapes compile afresh here, far from Dynamo's recompile limit
    H, K = 16, 128
    q, k, v = (torch.randn(B, H, T, K, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    ours = block_mask_for(T, T, window, device=q.device)
    theirs = create_block_mask(lambda b, h, i, j: (j <= i) & (i - j < window), None, None, T, T, device="cuda")
    runs = {
        "ours_ms": lambda: flex_windowed(q, k, v, ours),
        "flex_sliding_ms": lambda: flex(q, k, v, block_mask=theirs),
        "sdpa_causal_ms": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    }
    row: dict = {"T": T}
    for name, fn in runs.items():
        row[name] = time_ms(lambda fn=fn: fn().backward(do), repeats)
    row["ours_over_flex"] = row["ours_ms"] / row["flex_sliding_ms"]
    print(json.dumps(row), flush=True)
    return row


def compile_rows(window: int, prompt_lengths: list[int]) -> dict:
    """Seconds of the first compiled calls: a training shape, then prompts of many lengths without gradients."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    d, H, K = 2048, 16, 128
    layer = Attention(d, H, K, window=window, layer_idx=0).cuda().to(torch.bfloat16)
    out: dict = {}
    x = torch.randn(1, 6000, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for label in ("first", "second"):
        torch.cuda.synchronize()
        t = time.perf_counter()
        layer(x)[0].sum().backward()
        torch.cuda.synchronize()
        out[f"train_{label}_call_s"] = time.perf_counter() - t
    prompts = []
    with torch.no_grad():
        for n in prompt_lengths:
            mask = torch.ones(2, n, dtype=torch.long, device="cuda")
            mask[1, : n // 3] = 0  # a left-padded row: the mask by position
            x = torch.randn(2, n, d, device="cuda", dtype=torch.bfloat16)
            torch.cuda.synchronize()
            t = time.perf_counter()
            layer(x, attention_mask=mask)
            torch.cuda.synchronize()
            prompts.append({"T": n, "s": time.perf_counter() - t})
    out["prompts"] = prompts
    out["graphs_compiled"] = dict(counters["stats"]).get("unique_graphs")
    print(json.dumps(out), flush=True)
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def error_rows(seeds: int, window: int) -> dict:
    """Errors against float64 of outputs and input gradients, block-sparse and dense, over ``seeds`` draws."""
    B, T, d, H, K = 2, 4096, 1024, 8, 128
    cases = {"window": None, "documents": torch.tensor([0, 700, 3000, 3001, T])}
    out: dict = {}
    for case, cu in cases.items():
        torch._dynamo.reset()
        errs: dict[str, list[float]] = {}
        b = 1 if cu is not None else B
        for seed in range(seeds):
            torch.manual_seed(seed)
            ref = Attention(d, H, K, window=window, layer_idx=0, backend="sdpa").cuda().double()
            x64 = torch.randn(b, T, d, device="cuda", dtype=torch.float64, requires_grad=True)
            dy = torch.randn(b, T, d, device="cuda", dtype=torch.float64)
            cu_dev = None if cu is None else cu.cuda()
            o64 = ref(x64, cu_seqlens=cu_dev)[0]
            (g64,) = torch.autograd.grad(o64, x64, dy)
            for backend in ("auto", "sdpa"):
                layer = Attention(d, H, K, window=window, layer_idx=0, backend=backend).cuda().to(torch.bfloat16)
                layer.load_state_dict(ref.state_dict())
                x = x64.detach().bfloat16().requires_grad_()
                o = layer(x, cu_seqlens=cu_dev)[0]
                (g,) = torch.autograd.grad(o, x, dy.bfloat16())
                name = "flex" if backend == "auto" else "dense"
                errs.setdefault(f"{name}_o", []).append(rel(o, o64))
                errs.setdefault(f"{name}_dx", []).append(rel(g, g64))
        out[case] = {key: {"max": max(v), "median": statistics.median(v)} for key, v in errs.items()}
        print(case, json.dumps(out[case]), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", nargs="+", type=int, default=[2048, 4096, 8192, 16384, 32768])
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--dense-max-T", type=int, default=16384, help="longest T timed with the dense masks")
    ap.add_argument("--prompt-lengths", nargs="+", type=int, default=[1000, 3001, 4500, 9000, 17000, 33000])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--parts", nargs="+", default=["layer", "core", "compile", "errors"],
                    choices=["layer", "core", "compile", "errors"])
    ap.add_argument("--out", type=Path, default=RESULTS / "attention_window.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.attention_window needs a CUDA device")
    import triton

    result: dict = {"header": {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "date": datetime.date.today().isoformat(), "commit": git_commit(), "window": args.window,
        "batch": args.batch, "repeats": args.repeats, "dtype": "bfloat16",
        "command": "python -m bench.attention_window " + " ".join(
            f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in vars(args).items() if k != "out"),
    }}

    def save() -> None:
        write_atomic(args.out, json.dumps(result, indent=1))

    if "compile" in args.parts:  # first, before any other call compiles the same shapes
        result["compile"] = compile_rows(args.window, args.prompt_lengths)
        save()
    if "layer" in args.parts:
        result["layer"] = [layer_row(T, args.window, args.batch, args.repeats, args.dense_max_T) for T in args.T]
        save()
    if "core" in args.parts:
        from torch.nn.attention.flex_attention import flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
        result["core"] = [core_row(T, args.window, args.batch, args.repeats, flex) for T in args.T]
        save()
    if "errors" in args.parts:
        result["errors"] = error_rows(args.seeds, args.window)
        save()
    print(f"\n{'T':>6}{'window ms':>11}{'dense ms':>10}{'full ms':>9}{'win/full':>9}{'core ms':>9}{'flex own':>9}"
          f"{'ours/own':>9}")
    core = {r["T"]: r for r in result.get("core", [])}
    for r in result.get("layer", []):
        c = core.get(r["T"], {})
        print(f"{r['T']:>6}{r['window_flex_ms']:>11.2f}{r.get('window_dense_ms', float('nan')):>10.2f}"
              f"{r['full_ms']:>9.2f}{r['window_flex_over_full']:>9.3f}{c.get('ours_ms', float('nan')):>9.2f}"
              f"{c.get('flex_sliding_ms', float('nan')):>9.2f}{c.get('ours_over_flex', float('nan')):>9.3f}")


if __name__ == "__main__":
    main()
