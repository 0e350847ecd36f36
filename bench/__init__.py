"""Benchmarks that print a table and write JSON under bench/results/."""
from __future__ import annotations

import sys


def provenance(module: str, argv: list[str] | None = None) -> dict:
    """What a GPU figure records beside it: the UTC date, this checkout's commit (``eval.results.git_commit``), the
    device, torch, Triton and fla versions (``None`` for fla when it is not installed), and the command that ran
    ``module`` with ``argv`` (default: this process's arguments)."""
    import datetime

    import torch
    import triton

    from eval.results import git_commit, versions

    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": git_commit(), "command": " ".join([f"python -m {module}",
                                                             *(sys.argv[1:] if argv is None else argv)]),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "triton": triton.__version__, "fla": versions()["fla"]}
