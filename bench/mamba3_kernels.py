"""mamba-ssm's Mamba-3 kernels (Triton SISO, TileLang MIMO) against our PyTorch reference, one shape per process.

``python -m bench.mamba3_kernels [--cases mimo:256:32:64:8x64 siso:256:32:64:4x512 ...] [--timeout 120] [--jobs 4]``
prints a table and writes ``bench/results/mamba3_kernels.json`` after every case. A case is
``kind:hidden:state:head_dim:BxT``; each runs in its own process (``--jobs`` at once) under
``CUDA_LAUNCH_BLOCKING=1``, so a kernel that faults or fails to compile is reported with its error and the
innermost frame of its traceback (``where``: the launch that faulted), and the other cases still run. Per
case: the relative error ``||kernel - torch|| / ||torch||`` of the output and of every gradient (input and
parameters) of one bf16 forward and backward of :class:`models.layers.mamba3.Mamba3`, and the seconds it took,
compilation included. The defaults are the MQAR benchmark's Mamba-3 layers (width 256, ``d_state`` 32, heads
of 64) at its shortest and longest training sequences, and the shape of ``tests/test_mixers_gpu.py``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from common.device import device_name
from eval.results import git_commit, versions
from trainer.checkpoint import write_json_atomic

RESULTS = Path(__file__).parent / "results"
DEFAULT_CASES = ["mimo:256:32:64:512x64", "siso:256:32:64:512x64", "mimo:256:32:64:64x512", "siso:256:32:64:64x512",
                 "mimo:512:64:64:2x256", "siso:512:64:64:2x256"]


def parse_case(case: str) -> dict:
    """``kind:hidden:state:head_dim:BxT`` as a dict; raises ValueError naming the expected form."""
    try:
        kind, hidden, state, head_dim, bt = case.split(":")
        batch, seq = bt.split("x")
        out = {"kind": kind, "hidden": int(hidden), "state": int(state), "head_dim": int(head_dim),
               "batch": int(batch), "seq_len": int(seq)}
    except ValueError:
        raise ValueError(f"bad case {case!r}; expected kind:hidden:state:head_dim:BxT, "
                         "e.g. mimo:256:32:64:8x64") from None
    if kind not in ("siso", "mimo"):
        raise ValueError(f"bad case {case!r}: kind must be siso or mimo")
    return out


def run_case(case: dict) -> dict:
    """One forward and backward of each backend on the same layer and input; the relative errors."""
    from models.layers.mamba3 import Mamba3

    torch.manual_seed(0)
    dev = torch.device("cuda")
    layer = Mamba3(case["hidden"], state_size=case["state"], head_dim=case["head_dim"], is_mimo=case["kind"] == "mimo",
                   mimo_rank=4, layer_idx=0).to(dev)
    x = torch.randn(case["batch"], case["seq_len"], case["hidden"], device=dev)
    dy = torch.randn_like(x)
    outs = {}
    for backend in ("torch", "kernels"):
        layer.backend = backend
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(xi)[0]
        y.float().backward(dy)
        torch.cuda.synchronize()
        grads = {"input": xi.grad.float()} | {n: p.grad.float() for n, p in layer.named_parameters()
                                              if p.grad is not None}
        outs[backend] = (y.float(), grads, time.perf_counter() - t0)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm().clamp_min(1e-30))

    (y_t, g_t, s_t), (y_k, g_k, s_k) = outs["torch"], outs["kernels"]
    errs = {n: rel(g_k[n], g_t[n]) for n in g_t}
    return {**case, "out_rel_err": rel(y_k, y_t), "grad_rel_err_max": max(errs.values()),
            "grad_worst": max(errs, key=errs.get), "grad_rel_err": errs, "torch_s": s_t, "kernels_s": s_k}


def where(stderr: str) -> str | None:
    """The innermost frame of a traceback in ``stderr`` outside Triton's and torch's own code (under
    ``CUDA_LAUNCH_BLOCKING``: the launch that faulted), as ``path, line N, in fn`` with the path shortened to its
    package; the innermost frame when every frame is theirs."""
    frames = []
    for line in stderr.splitlines():
        if line.strip().startswith('File "'):
            path, _, rest = line.strip()[len('File "'):].partition('"')
            for root in ("site-packages/", "/tmp/site/"):
                path = path.split(root)[-1]
            frames.append(f"{path}{rest}")
    ours = [f for f in frames if not f.startswith(("triton/", "torch/"))]
    return (ours or frames or [None])[-1]


def check(text: str, case: dict, timeout: float) -> dict:
    """One case in a child process under ``CUDA_LAUNCH_BLOCKING=1``: its row, or its error and where it arose."""
    env = {**os.environ, "CUDA_LAUNCH_BLOCKING": "1"}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "bench.mamba3_kernels", "--one", text], capture_output=True,
                              text=True, timeout=timeout, env=env)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode == 0 and lines:
            row = json.loads(lines[-1])
        else:
            err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
            row = {**case, "error": next((ln for ln in reversed(err) if "Error" in ln), err[-1] if err else "?"),
                   "where": where(proc.stderr)}
    except subprocess.TimeoutExpired:
        row = {**case, "error": f"timed out after {timeout:.0f} s"}
    row["wall_s"] = time.perf_counter() - t0
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=DEFAULT_CASES)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per case, compilation included")
    ap.add_argument("--jobs", type=int, default=1, help="cases run at once, each in its own process")
    ap.add_argument("--out", type=Path, default=RESULTS / "mamba3_kernels.json")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # the child process: run one case, print its JSON
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(run_case(parse_case(args.one))), flush=True)
        return
    cases = [parse_case(c) for c in args.cases]
    header = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["python -m bench.mamba3_kernels", *(sys.argv[1:] if argv is None else argv)]),
              "git_commit": git_commit(), "device": device_name("cuda") if torch.cuda.is_available() else None,
              "versions": versions(("mamba_ssm", "tilelang"))}
    rows: list[dict] = []
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        for row in pool.map(lambda tc: check(*tc, args.timeout), zip(args.cases, cases)):
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "grad_rel_err"}), flush=True)
            write_json_atomic(args.out, {"header": header, "rows": rows})  # a run cut short keeps its cases
    print(f"\n{'case':<26}{'out err':>10}{'grad err':>10}  worst grad / error")
    for r in rows:
        name = f"{r['kind']}:{r['hidden']}:{r['state']}:{r['head_dim']}:{r['batch']}x{r['seq_len']}"
        if "error" in r:
            at = f" at {r['where']}" if r.get("where") else ""
            print(f"{name:<26}{'-':>10}{'-':>10}  {r['error'][:90]}{at}")
        else:
            print(f"{name:<26}{r['out_rel_err']:>10.2e}{r['grad_rel_err_max']:>10.2e}  {r['grad_worst']}")


if __name__ == "__main__":
    main()
