"""Compile a workload's Triton autotune configurations in parallel, so that its real run only benchmarks them.

A first call of fla's or our autotuned kernels compiles every configuration one after the other (a few seconds
each: minutes per fla op), then times each. This runs the same workload in ``--workers`` processes at once,
each compiling only its share of every kernel's configurations (``configs[w::N]``) and launching each once,
untimed; the compiled kernels land in the shared ``TRITON_CACHE_DIR``. The real run that follows finds them
there and spends its autotuning on the timings alone. Workers write no autotune results, and what they
compute is discarded (their kernels run with whatever configuration they were given).

    python -m bench.warm_triton --workers 12 -m bench.mixer_throughput --mixers deltanet --T 8192 --repeats 1 \
        --out /tmp/warm.json
    python -m bench.warm_triton --workers 8 -m pytest -q -m gpu tests/test_kdn_triton.py -k asymmetric

Everything after ``-m MODULE`` is that module's command line. The exit status is 0 once every worker has
ended (a worker's own failure, such as a test that fails on discarded values, does not count).
"""
from __future__ import annotations

import argparse
import os
import runpy
import subprocess
import sys
import time
from pathlib import Path


def patch_autotuner(worker: int, workers: int) -> None:
    """Make every Triton autotuner in this process try only configurations ``worker::workers`` (the first one
    when that share is empty), compile and launch each once without timing it, and keep no results on disk."""
    from triton.runtime import autotuner

    run = autotuner.Autotuner.run

    def sliced_run(self: autotuner.Autotuner, *args: object, **kwargs: object) -> object:
        if not getattr(self, "_warm_share", False):
            self.configs = self.configs[worker::workers] or self.configs[:1]
            self.cache_results = False
            self._warm_share = True
        return run(self, *args, **kwargs)

    def compile_once(self: autotuner.Autotuner, *args: object, config: autotuner.Config,
                     **meta: object) -> list[float]:
        try:
            self.fn.run(*args, **dict(meta, **config.all_kwargs()))
        except Exception:  # a configuration that does not fit (shared memory, registers): the real run skips it too
            return [float("inf")] * 3
        return [1.0] * 3

    autotuner.Autotuner.run = sliced_run
    autotuner.Autotuner._bench = compile_once


def _run_module(module: str, argv: list[str]) -> None:
    sys.argv = [module, *argv]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit:
        pass


def _files(folder: Path) -> int:
    return sum(1 for _ in folder.rglob("*")) if folder.exists() else 0


def split_workload(argv: list[str]) -> tuple[list[str], str, list[str]]:
    """``[own options..., "-m", MODULE, module args...]`` -> (own options, MODULE, module args): everything after
    the first ``-m MODULE`` belongs to the workload, its own ``-m`` included (``-m pytest -m gpu``)."""
    if "-m" not in argv or argv.index("-m") == len(argv) - 1:
        raise SystemExit("warm_triton: give the workload as -m MODULE [ARGS...]")
    i = argv.index("-m")
    return argv[:i], argv[i + 1], argv[i + 2:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 usage="%(prog)s [--workers N] -m MODULE [ARGS...]")
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2),
                    help="worker processes (default: CPU cores - 2)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # "w/N": this process is worker w of N
    own, module, rest = split_workload(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(own)
    args.module = module
    if args.worker:
        w, n = (int(x) for x in args.worker.split("/"))
        patch_autotuner(w, n)
        _run_module(args.module, rest)
        return 0
    if args.workers < 1:
        raise SystemExit(f"--workers must be >= 1, got {args.workers}")
    cache = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    before = _files(cache)
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-m", "bench.warm_triton", "--worker", f"{w}/{args.workers}",
                               "-m", args.module, *rest], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for w in range(args.workers)]
    failed = []
    for w, p in enumerate(procs):
        _, err = p.communicate()
        if p.returncode:
            failed.append(f"worker {w}: exit {p.returncode}: {err.decode(errors='replace').strip()[-300:]}")
    after = _files(cache)
    print(f"warm_triton: {args.workers} workers ran `-m {args.module} {' '.join(rest)}` in "
          f"{time.monotonic() - start:.0f} s; {after - before} new files in {cache}")
    for line in failed:
        print(line, file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
