"""One MQAR training step on one GPU: eager against CUDA-graph replay, per mixer, width and setting.

``python -m bench.mqar_step [--mixers kda kdn_diag attn] [--widths 128 256] [--settings 64x4 512x64] [--steps 20]``
prints a table and writes ``bench/results/mqar_step.json``. Each row trains the MQAR benchmark's own model
(:func:`eval.mqar.train.model_config`) with its own step (:class:`eval.mqar.step.TrainStep`) on full batches of
``batch_tokens`` tokens, one process, nothing else on the GPU. Three ways, each from the same initial model:

- ``eager``: the step as the CPU runs it (the KDA-family kernels read their safe-gate check on the host);
- ``eager_exact``: eager under ``kdn.ops.triton.exact_only``, the kernels a graph records;
- ``graph``: warm-up, capture, then replays;
- ``profile``: ``eager_exact`` under the PyTorch profiler, summed per kernel (``trainer.profiling.summarize``):
  the device time a step's kernels take one after another (``device_busy_ms``), their count, their groups and the
  top kernels. Set beside ``graph``'s milliseconds it says how much of a replayed step is kernel time, the floor
  that models replayed side by side share. ``profile_eager``: the same for ``eager`` (the KDA-family kernels
  take fla's tensor-core diagonal blocks where the safe-gate check allows): what the exact token loop costs.

Per way: the median milliseconds per step (host clock around a synchronised step, after warm-up), tokens per
second, whether every loss was finite, the last loss, and the device memory the step added (peak allocated).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import statistics
import time
from pathlib import Path

import torch

from eval.mqar.data import MQARSetting, MQARSplit
from eval.mqar.step import WARMUP, TrainStep
from eval.mqar.train import MixerChoice, model_config
from eval.results import git_commit
from models import build_model
from trainer.checkpoint import write_json_atomic
from trainer.optim import build_optimizer

RESULTS = Path(__file__).parent / "results"


def measure(mixer: str, width: int, setting: MQARSetting, way: str, steps: int, batch_tokens: int) -> dict:
    """Time ``steps`` training steps of one way (``eager``, ``eager_exact``, ``graph``) after warm-up."""
    from kdn.ops.triton import exact_only

    device = torch.device("cuda")
    torch.manual_seed(0)
    model = build_model(model_config(MixerChoice.parse(mixer), width, 64, setting.vocab_size)).to(device)
    opt = build_optimizer(model, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
    step = TrainStep(model, opt, 1.0, device, graphs=way == "graph")
    batch = max(1, batch_tokens // setting.seq_len)
    warm = WARMUP + 2
    split = MQARSplit(setting, "train", batch * (warm + steps), batch)
    batches = list(split.batches(device))
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    if way in ("profile", "profile_eager"):
        return profile_steps(mixer, width, setting, step, batches, warm, way == "profile", base)
    with exact_only() if way == "eager_exact" else contextlib.nullcontext():
        for k, b in enumerate(batches):
            t0 = time.perf_counter()
            loss, _ = step(*b)
            torch.cuda.synchronize()
            if k >= warm:
                times.append(time.perf_counter() - t0)
            losses.append(loss)
    losses = torch.stack(losses).float()
    ms = 1e3 * statistics.median(times)
    return {"mixer": mixer, "width": width, "setting": setting.name, "way": way, "ms": ms,
            "tokens_per_s": batch * setting.seq_len / ms * 1e3, "finite": bool(torch.isfinite(losses).all()),
            "last_loss": float(losses[-1]), "added_mem_gb": (torch.cuda.max_memory_allocated() - base) / 2**30,
            "captured": bool(step.captured), "fallback": step.fallback}


def profile_steps(mixer: str, width: int, setting: MQARSetting, step: TrainStep, batches: list, warm: int,
                  exact: bool, base: int) -> dict:
    """Kernel time of the eager steps after ``warm``; ``exact``: under ``exact_only``, the kernels a graph records;
    ``base``: the bytes allocated before the first step (for the memory a step adds)."""
    from torch.profiler import ProfilerActivity, profile

    from kdn.ops.triton import exact_only
    from trainer.profiling import summarize

    with exact_only() if exact else contextlib.nullcontext():
        for b in batches[:warm]:
            step(*b)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            losses = [step(*b)[0] for b in batches[warm:]]
            torch.cuda.synchronize()
            wall_ms = 1e3 * (time.perf_counter() - t0)
    n = len(batches) - warm
    summary = summarize(prof, wall_ms, n, rows=12)
    kernels = sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA) / n
    losses = torch.stack(losses).float()
    return {"mixer": mixer, "width": width, "setting": setting.name, "way": "profile" if exact else "profile_eager",
            "ms": summary["device_busy_ms"], "tokens_per_s": batches[0][0].numel() / summary["device_busy_ms"] * 1e3,
            "finite": bool(torch.isfinite(losses).all()), "last_loss": float(losses[-1]),
            "added_mem_gb": (torch.cuda.max_memory_allocated() - base) / 2**30,
            "captured": False, "fallback": None, "kernels_per_step": kernels, **summary}


def write(path: Path, args: argparse.Namespace, rows: list[dict]) -> None:
    """The results so far, atomically: a sweep cut off by a time limit keeps every row it measured."""
    import triton

    write_json_atomic(path, {
        "benchmark": "mqar_step", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(), "device": torch.cuda.get_device_name(),
        "versions": {"torch": torch.__version__, "triton": triton.__version__}, "args": {
            k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "rows": rows})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mixers", nargs="+", default=["kda", "kdn_diag", "kdn_iso", "deltanet", "mamba3_siso", "attn"])
    ap.add_argument("--widths", nargs="+", type=int, default=[256])
    ap.add_argument("--settings", nargs="+", default=["64x4", "512x64"])
    ap.add_argument("--ways", nargs="+", default=["eager", "eager_exact", "graph"],
                    help="eager, eager_exact, graph, profile, profile_eager (kernel time per step, top kernels)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-tokens", type=int, default=32_768)
    ap.add_argument("--out", type=Path, default=RESULTS / "mqar_step.json")
    args = ap.parse_args()
    rows: list[dict] = []
    print(f"{'mixer':<14}{'width':>6}{'setting':>10}{'way':>13}{'ms/step':>10}{'Mtok/s':>9}{'finite':>8}"
          f"{'loss':>8}{'+GB':>7}")
    for mixer in args.mixers:
        for width in args.widths:
            for name in args.settings:
                for way in args.ways:
                    try:
                        r = measure(mixer, width, MQARSetting.parse(name), way, args.steps, args.batch_tokens)
                        print(f"{mixer:<14}{width:>6}{name:>10}{way:>13}{r['ms']:>10.2f}"
                              f"{r['tokens_per_s'] / 1e6:>9.2f}{str(r['finite']):>8}{r['last_loss']:>8.3f}"
                              f"{r['added_mem_gb']:>7.2f}{'' if r['fallback'] is None else '  ' + r['fallback']}",
                              flush=True)
                        if way.startswith("profile"):
                            groups = ", ".join(f"{g} {ms:.2f}" for g, ms in r["groups_ms"].items())
                            top = "; ".join(f"{k['name'][:60]} {k['ms']:.3f}" for k in r["top"][:6])
                            print(f"    {r['kernels_per_step']:.0f} kernels a step; ms: {groups}\n    top: {top}",
                                  flush=True)
                    except Exception as err:  # noqa: BLE001 - a row that fails is reported, the sweep goes on
                        r = {"mixer": mixer, "width": width, "setting": name, "way": way,
                             "error": f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"}
                        print(f"{mixer:<14}{width:>6}{name:>10}{way:>13}  {r['error']}", flush=True)
                    rows.append(r)
                    write(args.out, args, rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
