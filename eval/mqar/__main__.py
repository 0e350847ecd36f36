"""``python -m eval.mqar [key=value ...]``: train the MQAR grid, then write the results JSON, table and plot.

Keys are the fields of :class:`eval.mqar.config.MQARConfig` (lists comma-separated), e.g.
``python -m eval.mqar mixers=kdn_diag,kda widths=64 settings=64x4 seeds=0,1,2``; ``preset=smoke`` (or ``--quick``)
runs every mixer with one pass over 5 % of the tokens; ``train=false`` reports the jobs stored so far.
``init=authors`` (the authors' weight initialisation) and ``precision=fp32`` (the KDN mixers' gain path) make an arm
of their own that can share ``out`` with the others, e.g.
``python -m eval.mqar mixers=kdn_diag,kda widths=128 lrs=3e-4 seeds=0,1,2 epochs=12 init=authors precision=fp32``.
"""
from __future__ import annotations

import sys
import time
from dataclasses import fields
from pathlib import Path

import torch

from common import write_json_atomic
from eval.mqar.config import PRESETS, MQARConfig, parse_overrides
from eval.mqar.report import table, write_report
from eval.mqar.run import build_jobs, flatten, header, run_grid, runs_of, summarize
from eval.results import git_commit


def main(argv: list[str]) -> None:
    if {"-h", "--help", "help"} & set(argv):
        defaults = MQARConfig()
        print(__doc__)
        print("keys (defaults of preset=full; presets: " + ", ".join(PRESETS) + "):")
        for f in fields(MQARConfig):
            print(f"  {f.name}={getattr(defaults, f.name)}")
        return
    try:
        cfg, _ = parse_overrides(argv)
    except ValueError as err:
        raise SystemExit(f"eval.mqar: {err}") from None
    torch.set_num_threads(cfg.threads)
    commit, t0 = git_commit(), time.perf_counter()
    results, failed = run_grid(cfg)
    done = {res["job"] for res in results}
    missing = [job.name for job in build_jobs(cfg) if job.name not in done]
    records = [r for res in results for r in flatten(res)]
    runs = runs_of(cfg.out)
    data = {**header(cfg, time.perf_counter() - t0, commit), "jobs_wall_s": sum(r["wall_s"] for r in results),
            "runs": runs, "runs_wall_s": sum(r["wall_s"] for r in runs),
            "failed_jobs": failed, "missing_jobs": missing,
            "rows": summarize(records, cfg),
            "jobs": sorted(records, key=lambda r: (r["setting"], r["mixer"], r["width"], r["lr"], r["seed"])),
            "curves": sorted(({k: res[k] for k in ("job", "mixer", "width", "lr", "seed", "curve")} for res in results),
                             key=lambda r: r["job"])}
    write_json_atomic(Path(cfg.results), data)
    md, png = write_report(data, cfg.results)
    print(table(data))
    print(f"mqar: {len(results)} models in {data['wall_s']:.0f}s (their own times: {data['jobs_wall_s']:.0f}s; "
          f"the {len(runs)} training run(s) of {cfg.out}: {data['runs_wall_s']:.0f}s)")
    print(f"mqar: wrote {cfg.results}, {md}{'' if png is None else f' and {png}'}")
    if missing and not cfg.train:
        print(f"mqar: {len(missing)} of {len(missing) + len(results)} jobs have no result yet (missing_jobs); the "
              "table covers the others")
    if failed:
        raise SystemExit(f"mqar: {len(failed)} job(s) failed (listed in failed_jobs of {cfg.results}); rerun the "
                         "same command to retry them")


if __name__ == "__main__":
    main(sys.argv[1:])
