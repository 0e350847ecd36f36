"""Error distributions of the GPU suite's kernel-against-reference comparisons over many seeds, from which the suite's
tolerances are set (each a stated margin over the measured maximum of its tensors).

    python -m bench.gpu_tolerances --seeds 20 --out bench/results/gpu_tolerances.json
    bash bench/gpu.sh "bench=gpu_tolerances --seeds 20"

Each seed is a fresh random layer or input. Comparisons (``||out - ref|| / ||ref||`` of each tensor):
``delta_fla[<rule>]``: ``tests/test_mixers_gpu.py``'s fla path against the PyTorch path of every delta rule,
output and every gradient; ``kdn_triton[<memory>]``: ``tests/test_kdn_triton.py``'s CUDA backend (bf16 ``q, k, v``)
against the float64 reference at T = 1000, 4 heads of 64. Prints a table (comparison, tensor, the constant that
bounds it, max / p99 / median) and the largest error under each constant; writes it all as JSON to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from bench import provenance

TESTS = Path(__file__).resolve().parents[1] / "tests"
Comparison = Callable[[int], dict[str, float]]
Bound = Callable[[str], str]


def comparisons() -> dict[str, tuple[Comparison, Bound]]:
    """Every comparison by name: (errors of each tensor for a seed, the name of the constant bounding a tensor)."""
    sys.path.insert(0, str(TESTS))
    import test_kdn_triton
    import test_mixers_gpu

    from models.layers.delta import DELTA_MIXERS

    out: dict[str, tuple[Comparison, Bound]] = {}
    for rule in sorted(DELTA_MIXERS):
        out[f"delta_fla[{rule}]"] = (lambda seed, r=rule: test_mixers_gpu.delta_fla_errors(r, seed),
                                     lambda tensor, r=rule: test_mixers_gpu.delta_tolerance(r, tensor)[0])
    for iso in (False, True):
        def kdn_errors(seed: int, iso: bool = iso) -> dict[str, float]:
            case = test_kdn_triton._case(2, 1000, 4, 64, iso, seed=seed, g_min=-2.0)
            return test_kdn_triton._compare(iso, case, {"seed": seed})

        out[f"kdn_triton[{'iso' if iso else 'diag'}]"] = (kdn_errors, lambda t: f"TOL[{t.removeprefix('d')!r}]")
    return out


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (linear between order statistics)."""
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = math.floor(pos)
    return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (pos - lo)


def summarize(errors: dict[str, dict[str, list[float]]], bounds: dict[str, dict[str, str]]) -> list[dict]:
    """Rows of the table: one per comparison and tensor, from ``errors[comparison][tensor]`` (one value a seed) and
    ``bounds[comparison][tensor]`` (the constant's name)."""
    return [{"comparison": c, "tensor": t, "bound": bounds[c][t], "seeds": len(v), "max": max(v),
             "p99": quantile(v, 0.99), "median": quantile(v, 0.5)}
            for c, per_tensor in errors.items() for t, v in per_tensor.items()]


def by_bound(rows: Iterable[dict]) -> dict[str, dict]:
    """The largest error under each constant, and where it was measured."""
    worst: dict[str, dict] = {}
    for r in rows:
        if r["bound"] not in worst or r["max"] > worst[r["bound"]]["max"]:
            worst[r["bound"]] = {"max": r["max"], "comparison": r["comparison"], "tensor": r["tensor"]}
    return dict(sorted(worst.items()))


def format_table(rows: list[dict]) -> str:
    """The rows as a fixed-width table, then the largest error under each constant."""
    lines = [f"{'comparison':<20} {'tensor':<28} {'bound':<24} {'max':>9} {'p99':>9} {'median':>9}"]
    lines += [f"{r['comparison']:<20} {r['tensor']:<28} {r['bound']:<24} {r['max']:9.2e} {r['p99']:9.2e} "
              f"{r['median']:9.2e}" for r in rows]
    lines += ["", "largest error under each constant:"]
    lines += [f"  {name:<24} {w['max']:9.2e}  ({w['comparison']} {w['tensor']})" for name, w in by_bound(rows).items()]
    return "\n".join(lines)


def write_json(path: Path, header: dict, rows: list[dict]) -> None:
    """``{"header", "rows", "by_bound"}`` to ``path``, through a temporary file renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"header": header, "rows": rows, "by_bound": by_bound(rows)}, indent=1) + "\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=20, help="fresh random inputs per comparison")
    p.add_argument("--only", default="", help="run only the comparisons whose name contains this")
    p.add_argument("--out", type=Path, default=Path("bench/results/gpu_tolerances.json"))
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench.gpu_tolerances needs a CUDA GPU: run it on the GPU machine "
                         "(bash bench/gpu.sh \"bench=gpu_tolerances\")")
    if args.seeds < 1:
        raise SystemExit(f"--seeds {args.seeds}: give at least 1")
    chosen = {n: c for n, c in comparisons().items() if args.only in n}
    if not chosen:
        raise SystemExit(f"--only {args.only!r} matches no comparison; names: {', '.join(comparisons())}")
    errors: dict[str, dict[str, list[float]]] = {}
    bounds: dict[str, dict[str, str]] = {}
    start = time.perf_counter()
    for name, (errs_of, bound) in chosen.items():
        for seed in range(args.seeds):
            for tensor, e in errs_of(seed).items():
                errors.setdefault(name, {}).setdefault(tensor, []).append(e)
        bounds[name] = {t: bound(t) for t in errors[name]}
        print(f"{name}: {args.seeds} seeds, {time.perf_counter() - start:.0f} s", flush=True)
    rows = summarize(errors, bounds)
    print(format_table(rows))
    header = {**provenance("bench.gpu_tolerances", argv), "seeds": args.seeds,
              "seconds": round(time.perf_counter() - start, 1)}
    write_json(args.out, header, rows)


if __name__ == "__main__":
    main()
