"""Sweeps when SLURM cannot tell a recorded job's state (``squeue`` missing, failing or not answering, and nothing
from ``sacct``): the job may still be queued or running, so training and evaluation sweeps refuse in one line naming
the commands that settle it, and submit nothing; ``resubmit_unknown=true`` submits anyway. A scheduler that answers
(a job not in the queue, an ended job in the accounting) lets the run be resubmitted as before."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import timeout_s
from test_slurm import fake_tools

import slurm.jobs
from slurm import expand
from slurm.jobs import UNKNOWN, record_job, scheduler_state
from slurm.status import main as status_main
from slurm.sweep import main as sweep_main

BASE_PATH = os.environ["PATH"]
RUNS = ("table5_learned", "table5_fixed_r", "table5_fixed_r_omega")
NOT_QUEUED = 'echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1'
NO_CONTROLLER = 'echo "slurm_load_jobs error: Unable to contact slurm controller (connect failure)" >&2; exit 1'
# that limit: what a hung query costs, and ample time for a fake that answers (a bash script) on a loaded machine
QUERY_S = timeout_s(0.5)
HUNG = f"exec sleep {30 * QUERY_S:g}"  # a squeue that does not answer within the limit, whatever the suite's factor


def tools(tmp: Path, name: str, monkeypatch: pytest.MonkeyPatch, **bodies: str) -> None:
    """PATH: a folder with the fake sbatch of :func:`test_slurm.fake_tools` (its ids continue) and ``bodies``
    (``squeue=..., sacct=...``; a tool left out is missing), then the test's own PATH."""
    folder = tmp / name
    folder.mkdir()
    sbatch = f'echo "$@" >> {tmp}/sbatch.log; n=$(wc -l < {tmp}/sbatch.log); echo "$((1000 + n));cluster"'
    for tool, body in {"sbatch": sbatch, **bodies}.items():
        (folder / tool).write_text(f"#!/bin/bash\n{body}\n")
        (folder / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}:{BASE_PATH}")


@pytest.fixture
def submitted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> list[str]:
    """The training sweep table5_noise submitted once (jobs 1001-1003) under ``tmp_path/runs``; returns the sweep's
    arguments."""
    monkeypatch.setenv("PATH", f"{fake_tools(tmp_path)}:{BASE_PATH}")
    args = ["table5_noise", f"cluster.runs_root={tmp_path / 'runs'}", "trainer.max_steps=4"]
    assert sweep_main(args) == 0
    capsys.readouterr()
    return args


def n_submitted(tmp: Path) -> int:
    return len((tmp / "sbatch.log").read_text().splitlines())


def refusal(capsys: pytest.CaptureFixture) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("case", ["squeue missing, sacct empty", "squeue not answering, sacct empty",
                                  "squeue failing, sacct missing", "neither on PATH"])
def test_a_training_sweep_refuses_while_a_jobs_state_is_unknown(
        case: str, submitted: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    bodies = {"squeue missing, sacct empty": {"sacct": "exit 0"},
              "squeue not answering, sacct empty": {"squeue": HUNG, "sacct": "exit 0"},
              "squeue failing, sacct missing": {"squeue": NO_CONTROLLER},
              "neither on PATH": {}}[case]
    monkeypatch.setattr(slurm.jobs, "QUERY_TIMEOUT_S", QUERY_S)
    tools(tmp_path, "now", monkeypatch, **bodies)
    assert ("squeue" in bodies) == (shutil.which("squeue") is not None)
    assert ("sacct" in bodies) == (shutil.which("sacct") is not None)
    assert sweep_main(submitted) == 2
    err = refusal(capsys)
    assert err == ("error: table5_noise-table5_learned-seed0: SLURM could not tell the state of job 1001 (squeue "
                   "missing, failing or not answering, and no sacct record), so it may still be queued or running: "
                   "check with squeue -j 1001 or sacct -j 1001 and run the same command again once they answer, or "
                   "add resubmit_unknown=true to submit anyway")
    assert n_submitted(tmp_path) == 3  # nothing submitted again
    ledger = tmp_path / "runs" / "table5_noise" / RUNS[0] / "seed0" / "submit" / "jobs.jsonl"
    assert [json.loads(x)["job_id"] for x in ledger.read_text().splitlines()] == ["1001"]
    # the explicit flag submits every run again
    assert sweep_main([*submitted, "resubmit_unknown=true"]) == 0
    assert n_submitted(tmp_path) == 6


@pytest.mark.parametrize("bodies,live", [
    ({"squeue": NOT_QUEUED, "sacct": "exit 0"}, {}),  # squeue answers that it no longer holds the jobs
    ({"squeue": "exit 0"}, {}),  # squeue answers with nothing, and there is no accounting
    ({"sacct": 'case "$4" in 1001) echo RUNNING;; 1002) echo PENDING;; *) echo "CANCELLED by 0";; esac'},
     {"1001": "running", "1002": "pending"}),  # squeue missing: sacct knows every job
    ({"squeue": HUNG, "sacct": 'case "$4" in 1001) echo RUNNING;; *) echo FAILED;; esac'},
     {"1001": "running"}),  # squeue not answering: sacct knows every job
])
def test_a_scheduler_that_answers_lets_ended_runs_be_resubmitted(
        bodies: dict[str, str], live: dict[str, str], submitted: list[str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(slurm.jobs, "QUERY_TIMEOUT_S", QUERY_S)
    tools(tmp_path, "now", monkeypatch, **bodies)
    assert sweep_main(submitted) == 0
    out = capsys.readouterr().out
    for job_id, state in live.items():
        assert f"skip ({state}: job {job_id})" in out
    assert n_submitted(tmp_path) == 6 - len(live)


def test_an_eval_sweep_refuses_while_an_evaluations_state_is_unknown(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    runs = tmp_path / "runs"
    run = expand("table5_noise", seeds=1, runs_root=runs, overrides=[])[0].run_dir
    (run / "submit").mkdir(parents=True)
    (run / "submit" / "job.json").write_text(json.dumps({"total_steps": 4}))
    (run / "checkpoints" / "step_000000004").mkdir(parents=True)
    record_job(run, {"job_id": "990", "kind": "train"})  # the finished training job: not asked about
    record_job(run, {"job_id": "991", "kind": "eval"})
    tools(tmp_path, "now", monkeypatch, sacct="exit 0")
    args = ["eval", "of=table5_noise", f"cluster.runs_root={runs}"]
    assert sweep_main(args) == 2
    err = refusal(capsys)
    assert err.startswith("error: eval-table5_noise-table5_learned-seed0: SLURM could not tell the state of job 991 ")
    assert "squeue -j 991 or sacct -j 991" in err and not (tmp_path / "sbatch.log").exists()
    assert status_main(["eval", "of=table5_noise", f"cluster.runs_root={runs}"]) == 0
    row = capsys.readouterr().out.splitlines()[1].split()
    assert row[1:4] == ["unknown", "991", "unknown"] and row[-1] == "991:unknown"
    assert sweep_main([*args, "resubmit_unknown=true"]) == 0 and n_submitted(tmp_path) == 1


def test_scheduler_state_tells_unknown_from_over(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``None``: squeue answered that the job is not queued and sacct has no record; :data:`UNKNOWN`: nothing
    answered; a state wherever one answered."""
    monkeypatch.setattr(slurm.jobs, "QUERY_TIMEOUT_S", QUERY_S)
    cases = [({}, UNKNOWN), ({"squeue": "exit 0"}, None), ({"squeue": NOT_QUEUED}, None),
             ({"squeue": NO_CONTROLLER, "sacct": "exit 0"}, UNKNOWN), ({"squeue": HUNG}, UNKNOWN),
             ({"squeue": "echo RUNNING", "sacct": "exit 1"}, "RUNNING"),
             ({"squeue": NO_CONTROLLER, "sacct": "echo COMPLETED+"}, "COMPLETED"),
             ({"squeue": "exit 0", "sacct": 'echo "slurmdbd: down" >&2; exit 1'}, None)]
    for i, (bodies, want) in enumerate(cases):
        tools(tmp_path, f"case{i}", monkeypatch, **bodies)
        assert scheduler_state("77") == want, bodies
