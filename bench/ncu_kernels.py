"""Hardware counters of the recurrence's kernels under Nsight Compute: what bounds each one.

    python -m bench.ncu_kernels --mixers kdn_diag kdn_iso kda --T 8192 --out bench/results/ncu_kernels.json
    bash bench/gpu.sh "bench=ncu_kernels --mixers kdn_diag kda --T 8192"

For each mixer, one kernel-only forward + backward (``bench.mixer_throughput.kernel_fn``: the recurrence alone, the
Fig. 4 shape, 16 heads of 128, batch 4) runs in a child process under ``ncu`` after warm-up and autotuning outside
the profiled range (``cudaProfilerStart``/``Stop``). ``ncu`` leaves the clocks alone (``--clock-control none``) and
collects the sections that answer "what bounds it": SpeedOfLight (SM and memory throughput against peak),
Occupancy and LaunchStats (grid, block, registers, shared memory, waves), WarpStateStats (the stall reasons per
issued instruction) and ComputeWorkloadAnalysis (pipe utilisation, the tensor pipes among them). Its raw CSV is
parsed into one row per kernel launch and a summary per kernel name: total duration, share of the pass, the
throughputs, achieved occupancy, waves per SM and the three largest stall reasons. Prints a table; writes JSON.
The counters cost replays: a pass takes minutes under ``ncu``, against milliseconds without it.
"""
from __future__ import annotations

import argparse
import csv
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from bench import provenance
from trainer.checkpoint import write_json_atomic

SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats", "ComputeWorkloadAnalysis")
METRICS = ("regex:^smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio$",  # every stall reason
           "regex:^sm__pipe_tensor.*_cycles_active\\.avg\\.pct_of_peak_sustained_active$")  # the tensor pipes
STALL = re.compile(r"^smsp__average_warps?_issue_stalled_(\w+?)_per_issue_active\.ratio$")
COLUMNS = {  # summary field: the raw metrics it reads, the first one present
    "duration_us": ("gpu__time_duration.sum",),
    "sm_pct": ("sm__throughput.avg.pct_of_peak_sustained_elapsed",),
    "memory_pct": ("gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",),
    "dram_pct": ("gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
                 "dram__throughput.avg.pct_of_peak_sustained_elapsed"),
    "achieved_occupancy_pct": ("sm__warps_active.avg.pct_of_peak_sustained_active",),
    "theoretical_occupancy_pct": ("sm__maximum_warps_per_active_cycle_pct",),
    "registers": ("launch__registers_per_thread",),
    "waves_per_sm": ("launch__waves_per_multiprocessor",),
    "grid": ("launch__grid_size",),
    "block": ("launch__block_size",),
}
TENSOR = re.compile(r"^sm__pipe_tensor.*pct_of_peak_sustained_active$|^sm__inst_executed_pipe_tensor.*pct")
TIME_UNITS = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6}


def ncu_command(ncu: str, log: Path, child: list[str]) -> list[str]:
    """The ``ncu`` command line that profiles ``child``'s range between ``cudaProfilerStart`` and ``Stop``."""
    sections = [a for s in SECTIONS for a in ("--section", s)]
    return [ncu, "--clock-control", "none", "--profile-from-start", "off", "--target-processes", "all",
            *sections, "--metrics", ",".join(METRICS), "--page", "raw", "--csv", "--log-file", str(log), *child]


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def parse_raw_csv(text: str) -> list[dict]:
    """``ncu --page raw --csv`` output (a header row of metric names, a row of units, then one row per profiled
    launch; ``==PROF==`` lines and anything before the header are skipped) -> one dict per launch: ``kernel``
    (its name), the :data:`COLUMNS` fields (``duration_us`` in microseconds whatever the unit), ``tensor_pct`` (the
    busiest tensor pipe, when collected) and ``stalls`` (reason -> cycles per issued instruction)."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    if len(rows) < 2 or "Kernel Name" not in rows[0]:
        raise ValueError("no ncu raw CSV in the log (no header row with 'Kernel Name'); did ncu profile anything?")
    header, units, data = rows[0], rows[1], rows[2:]
    col = {name: i for i, name in enumerate(header)}
    out = []
    for row in data:
        rec: dict = {"kernel": row[col["Kernel Name"]]}
        for field, names in COLUMNS.items():
            metric = next((m for m in names if m in col), None)
            value = _number(row[col[metric]]) if metric is not None else None
            if field == "duration_us" and value is not None:
                value *= TIME_UNITS.get(units[col[metric]].strip(), 1e-3)  # ncu reports nanoseconds by default
            rec[field] = value
        tensor = [v for name, i in col.items() if TENSOR.match(name) and (v := _number(row[i])) is not None]
        rec["tensor_pct"] = max(tensor) if tensor else None
        rec["stalls"] = {m.group(1): v for name, i in col.items()
                         if (m := STALL.match(name)) and (v := _number(row[i])) is not None}
        out.append(rec)
    return out


def summarize(launches: list[dict]) -> list[dict]:
    """Per kernel name, by total duration: launches, total and share of the duration, the duration-weighted mean of
    every percentage and stall, registers, waves and the three largest stalls."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for rec in launches:
        groups[rec["kernel"]].append(rec)
    total = sum(r["duration_us"] or 0.0 for r in launches) or 1.0
    rows = []
    for name, recs in groups.items():
        dur = sum(r["duration_us"] or 0.0 for r in recs)
        w = [(r["duration_us"] or 0.0) / dur if dur else 1 / len(recs) for r in recs]

        def mean(field: str, rs: list[dict] = recs, ws: list[float] = w) -> float | None:
            vals = [(r[field], x) for r, x in zip(rs, ws) if r[field] is not None]
            return sum(v * x for v, x in vals) / sum(x for _, x in vals) if vals and sum(x for _, x in vals) else None

        stalls: dict[str, float] = defaultdict(float)
        for r, x in zip(recs, w):
            for reason, v in r["stalls"].items():
                stalls[reason] += v * x
        rows.append({"kernel": name, "launches": len(recs), "duration_us": dur, "share": dur / total,
                     **{f: mean(f) for f in ("sm_pct", "memory_pct", "dram_pct", "tensor_pct",
                                             "achieved_occupancy_pct", "theoretical_occupancy_pct", "waves_per_sm")},
                     "registers": recs[0]["registers"], "grid": recs[0]["grid"], "block": recs[0]["block"],
                     "top_stalls": sorted(stalls.items(), key=lambda kv: -kv[1])[:3]})
    return sorted(rows, key=lambda r: -r["duration_us"])


def format_table(mixer: str, rows: list[dict]) -> str:
    """A plain-text table of :func:`summarize`'s rows."""
    def f(v: float | None, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    lines = [f"{mixer}: {sum(r['duration_us'] for r in rows) / 1e3:.2f} ms of kernels in one forward + backward",
             f"{'kernel':<46}{'n':>3}{'us':>9}{'share':>7}{'SM%':>6}{'mem%':>6}{'dram%':>6}{'tc%':>6}{'occ%':>6}"
             f"{'waves':>7}{'regs':>5}  top stalls (cycles per issued instruction)"]
    for r in rows:
        stalls = ", ".join(f"{k} {v:.1f}" for k, v in r["top_stalls"])
        lines.append(f"{r['kernel'][:45]:<46}{r['launches']:>3}{r['duration_us']:>9.0f}{r['share']:>7.1%}"
                     f"{f(r['sm_pct'], '.0f'):>6}{f(r['memory_pct'], '.0f'):>6}{f(r['dram_pct'], '.0f'):>6}"
                     f"{f(r['tensor_pct'], '.0f'):>6}{f(r['achieved_occupancy_pct'], '.0f'):>6}"
                     f"{f(r['waves_per_sm'], '.2f'):>7}{f(r['registers'], '.0f'):>5}  {stalls}")
    return "\n".join(lines)


def child(mixer: str, B: int, T: int, H: int, K: int) -> None:
    """The profiled process: warm-up (compilation, autotuning) outside the range, then one pass inside it."""
    import torch

    from bench.mixer_throughput import kernel_fn

    fn = kernel_fn(mixer, B, T, H, K)
    if fn is None:
        raise SystemExit(f"bench.ncu_kernels: no kernel-only pass for mixer {mixer!r}; use kdn_diag, kdn_iso or kda")
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mixers", nargs="+", default=["kdn_diag", "kdn_iso", "kda"])
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--ncu", default=os.environ.get("NCU", "ncu"), help="the ncu executable (env NCU)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/ncu_kernels.json"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, args.batch, args.T, args.heads, args.head_dim)
        return 0
    ncu = shutil.which(args.ncu)
    if ncu is None:
        raise SystemExit(f"bench.ncu_kernels: {args.ncu!r} is not on PATH; install Nsight Compute or pass --ncu PATH")
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench.ncu_kernels needs a CUDA GPU: run it on the GPU machine "
                         "(bash bench/gpu.sh \"bench=ncu_kernels\")")
    result: dict = {"header": {**provenance("bench.ncu_kernels", argv), "B": args.batch, "T": args.T,
                               "H": args.heads, "K": args.head_dim, "sections": list(SECTIONS)}, "mixers": {}}
    for mixer in args.mixers:
        with tempfile.TemporaryDirectory() as tmp:
            log = Path(tmp) / "ncu.csv"
            cmd = ncu_command(ncu, log, [sys.executable, "-m", "bench.ncu_kernels", "--child", mixer,
                                         "--T", str(args.T), "--batch", str(args.batch), "--heads", str(args.heads),
                                         "--head-dim", str(args.head_dim)])
            proc = subprocess.run(cmd, capture_output=True, text=True)
            text = log.read_text() if log.exists() else ""
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise SystemExit(f"bench.ncu_kernels: ncu on {mixer} exited {proc.returncode}: {tail[0]}")
        launches = parse_raw_csv(text)
        rows = summarize(launches)
        print(format_table(mixer, rows), flush=True)
        result["mixers"][mixer] = {"kernels": rows, "launches": launches}
        write_json_atomic(args.out, result)  # a run cut short keeps every mixer it finished
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
