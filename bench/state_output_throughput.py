"""The memory's forward after its intra-chunk matrices on CUDA: fla's three launches (``recompute_w_u_fwd``,
``chunk_gated_delta_rule_fwd_h``, ``chunk_gla_fwd_o_gk``) against fla's first + ours for the other two and against
ours for all three (``kdn.ops.triton.state_output``), alone and inside the recurrence.

1. The launches alone, at a training layer's shape (bf16, ``q, k, kappa, v, beta, gc, Akk, Aqk`` as the intra-chunk
   forward leaves them): keeping the states (``h``, ``v_new``, and the WY terms) for the backward (training) and
   keeping nothing (a forward without gradients).
2. The recurrence as the layers call it (``bench.mixer_throughput.kernel_call``), under each kernel that
   ``KDN_STATE_KERNEL`` chooses (a run per choice, e.g. stages of ``bench/gpu.sh`` with ``env=KDN_STATE_KERNEL=fused``
   or ``wy`` between them): Diagonal and Isotropic KDN, forward + backward and forward alone without gradients (as
   evaluation's prefill runs it), against fla's ``chunk_kda`` in the same process.

Prints the tables (ms, ratios; GB/s: the bytes each path moves, by its inputs, outputs and intermediates, over its
time) and our paths' relative difference from fla per output, and writes ``--out`` (JSON, with the provenance of
``bench.provenance``).

    python -m bench.state_output_throughput --batch 4 --T 8192 32768 --out bench/results/state_output.json
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from bench import provenance
from bench.mixer_throughput import fwdbwd_step, kernel_call, time_ms, write_atomic
from kdn.ops.validate import ASYM_CHUNK as BT


def _launch_inputs(B: int, T: int, H: int, K: int) -> dict[str, Tensor]:
    """Random bf16 ``q, k, kappa, v, beta, Aqk`` and ``Akk`` (unit lower triangular within each chunk, as the WY
    inverse) and FP32 ``gc`` (log2, chunk-local), never zeros."""
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    dev, bf = "cuda", torch.bfloat16
    x = {n: (torch.randn(B, T, H, K, device=dev) * s).to(bf) for n, s in (("q", 1.0), ("k", 0.1), ("kappa", 0.1),
                                                                          ("v", 1.0))}
    x["gc"] = chunk_local_cumsum(-F.softplus(torch.randn(B, T, H, K, device=dev)) * 0.1, chunk_size=BT,
                                 scale=RCP_LN2)
    x["Aqk"] = (torch.randn(B, T, H, BT, device=dev) * 0.1).to(bf)
    x["beta"] = (torch.rand(B, T, H, device=dev) * 0.8 + 0.1).to(bf)
    row, col = (torch.arange(T, device=dev) % BT)[:, None, None], torch.arange(BT, device=dev)
    x["Akk"] = torch.where(col < row, torch.randn(B, T, H, BT, device=dev) * 0.1, (col == row).float()).to(bf)
    return x


def _rel(x: Tensor, ref: Tensor) -> float:
    """``||x - ref|| / ||ref||``."""
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def launch_rows(B: int, T: int, H: int, K: int) -> tuple[list[dict], dict[str, dict[str, float]]]:
    """Section 1: a row per (path, states kept) of the launches after the intra-chunk matrices, and our paths'
    relative difference from fla's outputs."""
    from triton.testing import do_bench

    from kdn.ops import fla_internals
    from kdn.ops.triton.state_output import chunk_state_output, chunk_wy_state_output

    x = _launch_inputs(B, T, H, K)
    scale = K ** -0.5

    def wy(keep: bool) -> tuple[Tensor | None, ...]:
        return fla_internals.recompute_w_u_fwd(k=x["k"], k_precond=x["kappa"], v=x["v"], beta=x["beta"], A=x["Akk"],
                                               gk=x["gc"], q=x["q"], output_qg=keep, output_kg=True)

    def fla() -> tuple[Tensor, ...]:
        w, u, qg, kg = wy(True)
        h, v_new, S = fla_internals.chunk_gated_delta_rule_fwd_h(k=kg, w=w, u=u, gk=x["gc"],
                                                                 output_final_state=True, chunk_size=BT)
        return fla_internals.chunk_gla_fwd_o_gk(q=x["q"], v=v_new, g=x["gc"], A=x["Aqk"], h=h, scale=scale,
                                                chunk_size=BT), h, v_new, S, w, qg, kg

    def fused(keep: bool) -> tuple[Tensor | None, ...]:
        w, u, qg, kg = wy(keep)
        return chunk_state_output(x["q"], kg, w, u, x["gc"], x["Aqk"], scale, None, True, save_states=keep, qg=qg)

    def one(keep: bool) -> tuple[Tensor | None, ...]:
        return chunk_wy_state_output(x["q"], x["k"], x["kappa"], x["v"], x["beta"], x["gc"], x["Akk"], x["Aqk"],
                                     scale, None, True, save_states=keep)

    n, nt = B * T * H * K, B * -(-T // BT) * H * K * K
    base = 2 * 4 * n + 4 * n + 2 * B * T * H * (2 * BT + 1) + 2 * n  # q, k, kappa, v, gc, Aqk, Akk, beta; o
    kept = 2 * nt + 2 * n  # h, v_new written for the backward
    paths: dict[str, tuple[Callable[[], tuple], int]] = {
        "fla: WY, states, output (3 launches)": (fla, base + 2 * 4 * 2 * n + 2 * kept),
        "fla WY + fused, states kept": (partial(fused, True), base + 2 * 4 * 2 * n + kept),
        "fla WY + fused, nothing kept": (partial(fused, False), base + 2 * 3 * 2 * n),
        "wy (1 launch), states kept": (partial(one, True), base + 3 * 2 * n + kept),
        "wy (1 launch), nothing kept": (partial(one, False), base),
    }
    rows = []
    for name, (fn, moved) in paths.items():
        ms = do_bench(fn)
        rows.append({"T": T, "path": name, "ms": ms, "GBps": moved / ms / 1e6})
    ref = fla()
    names = ("o", "h", "v_new", "S", "w", "qg", "kg")
    diff = {"fused": {n: _rel(a, b) for n, a, b in zip(names, fused(True), ref)},
            "wy": {n: _rel(a, b) for n, a, b in zip(names, one(True), ref)}}
    diff["fused"]["o_nothing_kept"] = _rel(fused(False)[0], ref[0])
    diff["wy"]["o_nothing_kept"] = _rel(one(False)[0], ref[0])
    return rows, diff


def recurrence_rows(B: int, T: int, H: int, K: int, repeats: int) -> list[dict]:
    """Section 2: a row per recurrence under the state kernel that ``KDN_STATE_KERNEL`` chooses (recorded in the
    row): fwd+bwd and forward-alone ms, and each over fla's ``chunk_kda`` in the same process."""
    from kdn.ops.triton.state_output import state_output_kernel

    kernel, rows = state_output_kernel(device=torch.device("cuda")), []
    for name in ("kda", "kdn_diag", "kdn_iso"):
        leaves, run = kernel_call(name, B, T, H, K)
        fwdbwd = fwdbwd_step(leaves, run)

        def fwd(run: Callable[[], Tensor] = run) -> None:
            with torch.no_grad():
                run()

        rows.append({"T": T, "recurrence": "fla chunk_kda" if name == "kda" else name,
                     "state_kernel": "fla" if name == "kda" else kernel,
                     "ms_fwdbwd": time_ms(fwdbwd, repeats), "ms_fwd_no_grad": time_ms(fwd, repeats)})
        del fwdbwd, leaves, run
    for r in rows:
        r["fwdbwd_over_chunk_kda"] = r["ms_fwdbwd"] / rows[0]["ms_fwdbwd"]
        r["fwd_over_chunk_kda"] = r["ms_fwd_no_grad"] / rows[0]["ms_fwd_no_grad"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--T", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--no-launches", action="store_true", help="section 2 only (the launches were timed already)")
    ap.add_argument("--out", default="bench/results/state_output.json")
    a = ap.parse_args()
    B, H, K = a.batch, a.heads, a.head_dim
    launches, diffs, recurrences = [], {}, []
    for T in a.T:
        if not a.no_launches:
            rows, diffs[str(T)] = launch_rows(B, T, H, K)
            launches += rows
        recurrences += recurrence_rows(B, T, H, K, a.repeats)
        torch.cuda.empty_cache()
    print(f"{'T':>6} {'launches':<40} {'ms':>8} {'GB/s':>6}")
    for r in launches:
        print(f"{r['T']:>6} {r['path']:<40} {r['ms']:8.3f} {r['GBps']:6.0f}")
    for T, d in diffs.items():
        for path, e in d.items():
            print(f"relative difference from fla's launches, {path}, T={T}:", {n: f"{v:.1e}" for n, v in e.items()})
    print(f"{'T':>6} {'recurrence':<15} {'state kernel':<12} {'fwd+bwd ms':>10} {'/ chunk_kda':>11} "
          f"{'fwd ms':>8} {'/ chunk_kda':>11}")
    for r in recurrences:
        print(f"{r['T']:>6} {r['recurrence']:<15} {r['state_kernel']:<12} {r['ms_fwdbwd']:10.3f} "
              f"{r['fwdbwd_over_chunk_kda']:11.3f} {r['ms_fwd_no_grad']:8.3f} {r['fwd_over_chunk_kda']:11.3f}")
    result = {**provenance("bench.state_output_throughput"), "B": B, "H": H, "K": K, "launches": launches,
              "relative_difference_vs_fla": diffs, "recurrences": recurrences}
    write_atomic(Path(a.out), json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
