"""Where a whole model's training step goes: wall time, busy device time, allocator retries and top kernels.

``python -m bench.profile_step --size 750m --mixers kdn_diag kda --seq-len 4096 --batch 8`` builds each model
as train.py does (models.model_config, fp32 weights, bf16 autocast on CUDA, AdamW), times ``--steps`` steps of
forward + backward + optimiser step after warm-up, then profiles one. Per mixer it prints the step time, tokens/s,
the share of the step the device is busy (kernel time summed over the step; well under 100% means the host or a
sync starves it), the allocator's retries (cudaFree and retry, which synchronise), peak memory, and the top
kernels by device time (CPU: operators). Writes ``--out`` (default ``bench/results/profile_step.json``).
``--ffn-width 5546`` gives every layer one SwiGLU width instead of the parameter-matched aligned widths, to
measure what an unaligned width costs. On CUDA it uses train.py's matmul settings (TF32 for FP32 matmuls), reports
MFU as train.py counts it, sums every kernel of the profiled step into groups (matmul, recurrence and gates,
norms, element-wise PyTorch ops, ...) to show where a step's time goes, and lists the PyTorch operators whose own
kernels take the most device time (which op launches the copies and adds).
A layer that is fast alone (bench.mixer_throughput) but slow here shows which of these differs.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import models
from bench import provenance
from bench.mixer_throughput import RESULTS, write_atomic
from trainer.distributed import cuda_matmul_defaults
from trainer.metrics import peak_flops
from trainer.profiling import summarize


def step_fn(model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor):
    """One training step on ``ids [B, T]``: forward (bf16 autocast on CUDA), backward, AdamW step."""
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if ids.is_cuda else contextlib.nullcontext()

    def step() -> None:
        with amp:
            loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(size: str, mixer: str, backbone: str, vocab: int, B: int, T: int, steps: int, rows: int,
            device: torch.device, ffn_width: int | None = None, use_compile: bool = False,
            attention_backend: str = "auto") -> dict:
    """One mixer's row: timings, allocator figures and its top kernels (or CPU operators). ``ffn_width`` sets one
    SwiGLU width for every layer instead of the parameter-matched widths; ``use_compile`` runs the model through
    ``torch.compile`` (inductor), as ``trainer.compile=true`` does (the warm-up steps hold the compilation);
    ``attention_backend``: the attention layers' masked path (``models.KDNConfig``)."""
    torch.manual_seed(0)
    overrides: dict = {"attention_backend": attention_backend}
    if ffn_width is not None:
        overrides["intermediate_size"] = ffn_width
    cfg = models.model_config(size, mixer, backbone, vocab, **overrides)
    model = models.build_model(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    ids = torch.randint(3, vocab, (B, T), device=device)
    step = step_fn(torch.compile(model) if use_compile else model, opt, ids)
    for _ in range(3):  # warm-up: autotuning, allocator growth, optimiser state
        step()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        retries0 = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    ms = (time.perf_counter() - start) / steps * 1e3
    row = {"mixer": mixer, "size": size, "backbone": backbone, "batch": B, "seq_len": T, "compile": use_compile,
           "ffn_widths": sorted(set(cfg.ffn_width(i) for i in range(cfg.num_layers))),
           "params": sum(p.numel() for p in model.parameters()), "ms_step": ms, "tokens_per_s": B * T / ms * 1e3}
    peak = peak_flops(device, "bf16", None)
    if peak is not None:
        row["mfu"] = row["tokens_per_s"] * models.count_flops_per_token(cfg, T) / peak
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        row |= {"alloc_retries_per_step": (stats.get("num_alloc_retries", 0) - retries0) / steps,
                "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
                "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30}
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        sync(device)
    row |= {k: v for k, v in summarize(prof, ms, 1, rows).items() if k != "wall_ms"}  # busy share of the timed step
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def report(rows: list[dict]) -> None:
    print(f"\n{'mixer':<14}{'FFN widths':>12}{'ms/step':>10}{'tok/s':>10}{'MFU':>7}{'busy':>7}{'retries':>9}"
          f"{'peak GiB':>10}{'reserved':>10}")
    for r in rows:
        mfu = f"{r['mfu']:.1%}" if "mfu" in r else "-"
        busy = f"{r['device_busy_frac']:.0%}" if "device_busy_frac" in r else "-"
        retries = f"{r['alloc_retries_per_step']:.1f}" if "alloc_retries_per_step" in r else "-"
        peak = f"{r['peak_allocated_gib']:.1f}" if "peak_allocated_gib" in r else "-"
        res = f"{r['peak_reserved_gib']:.1f}" if "peak_reserved_gib" in r else "-"
        widths = "/".join(map(str, r["ffn_widths"]))
        print(f"{r['mixer']:<14}{widths:>12}{r['ms_step']:>10.1f}{r['tokens_per_s']:>10.0f}{mfu:>7}{busy:>7}{retries:>9}"
              f"{peak:>10}{res:>10}")
    grouped = [r for r in rows if "groups_ms" in r]
    if grouped:
        names = list(dict.fromkeys(g for r in grouped for g in r["groups_ms"]))
        print(f"\n{'device ms per step':<34}" + "".join(f"{r['mixer']:>12}" for r in grouped))
        for g in names:
            print(f"{g:<34}" + "".join(f"{r['groups_ms'].get(g, 0.0):>12.1f}" for r in grouped))
        for r in grouped:
            if r.get("misaligned_gemm_ms", 0.0) > 0:
                print(f"{r['mixer']}: {r['misaligned_gemm_ms']:.1f} ms a step in GEMMs on operands aligned to fewer "
                      "than 16 bytes (a width that is not a multiple of 8 in bf16)")
    for r in rows:
        print(f"\n{r['mixer']}: top {'kernels' if 'device_busy_ms' in r else 'operators'} in one step")
        for t in r["top"]:
            print(f"  {t['name'][:80]:<82}{t['calls']:>6}{t['ms']:>10.2f} ms")
        if r.get("top_ops"):
            print(f"\n{r['mixer']}: PyTorch operators by the device time of their own kernels")
            for t in r["top_ops"]:
                print(f"  {t['name'][:80]:<82}{t['calls']:>6}{t['ms']:>10.2f} ms")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="750m")
    ap.add_argument("--mixers", nargs="+", default=["kdn_diag", "kdn_iso", "kda"])
    ap.add_argument("--backbone", default="recurrent")
    ap.add_argument("--vocab", type=int, default=32768, help="the Mistral v1 tokenizer's 32768 by default")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--ffn-width", type=int, help="one SwiGLU width for every layer (e.g. an unaligned 5546)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (as trainer.compile=true)")
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "flex", "sdpa"],
                    help="attention layers' windows: flex_attention's block masks (auto, on CUDA) or dense SDPA masks")
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, default=RESULTS / "profile_step.json")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        cuda_matmul_defaults()
    header = {**provenance("bench.profile_step", argv),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "autocast": "bf16" if device.type == "cuda" else None, "steps": args.steps,
              "tf32": device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32,
              "backbone": args.backbone, "size": args.size, "batch": args.batch, "seq_len": args.seq_len,
              "attention_backend": args.attention_backend}
    rows: list[dict] = []
    for mixer in args.mixers:
        try:
            row = measure(args.size, mixer, args.backbone, args.vocab, args.batch, args.seq_len, args.steps,
                          args.rows, device, args.ffn_width, args.compile, args.attention_backend)
        except Exception as e:  # one mixer that cannot run here (kernels missing, out of memory) is its error row
            row = {"mixer": mixer, "error": f"{type(e).__name__}: {str(e)[:200]}"}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "top"}), flush=True)
        write_atomic(args.out, json.dumps({"header": header, "results": rows}, indent=1))
    report([r for r in rows if "error" not in r])


if __name__ == "__main__":
    main()
