"""Named SLURM sweeps: expansion, rendered scripts, submission through a fake sbatch, the multi-node launch path
(two "nodes" on localhost with gloo against one process) and a requeue that resumes."""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import free_port, timeout_s

from slurm import expand, expand_nodelist, load_cluster, plan, rendezvous
from slurm.jobs import record_job, recorded_jobs
from slurm.status import main as status_main
from slurm.sweep import main as sweep_main
from slurm.sweeps import Job, SweepError

ROOT = Path(__file__).resolve().parents[1]
# more steps than a toy run takes within any test's time limit: a run the tests signal or kill is stopped by that,
# never by reaching its end first, however slowly the test itself is scheduled
ENDLESS = 10 ** 9
TOY = ["model=toy", "logging=quiet", "data.seq_len=64", "trainer.micro_batch_size=2",
       "trainer.global_batch_tokens=256", "trainer.eval_batches=2", "trainer.eval_every=0", "trainer.export=false"]
COUNTS = {"table1_750m": 4, "table1_1.3b": 8, "table2_extra": 9, "table4_mu": 5, "table5_noise": 3}


def fake_tools(tmp: Path) -> Path:
    """sbatch, squeue, sacct, srun and scontrol stand-ins that record their calls under ``tmp``."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    scripts = {
        "sbatch": f'echo "$@" >> {tmp}/sbatch.log; n=$(wc -l < {tmp}/sbatch.log); echo "$((1000 + n));cluster"',
        # a job's state: a "ID STATE" line of queue (squeue) or accounting (sacct) under tmp, as a test writes it
        "squeue": f'grep -s "^$3 " {tmp}/queue | cut -d" " -f2; case "$3" in 1006) echo RUNNING;; esac',
        "sacct": f'grep -s "^$4 " {tmp}/accounting | cut -d" " -f2; case "$4" in 1007) echo FAILED;; esac',
        "srun": 'while [[ "$1" == --* ]]; do shift; done; exec "$@"',
        "scontrol": f'echo "$@" >> {tmp}/scontrol.log',
    }
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text(f"#!/bin/bash\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return bin_dir


@pytest.fixture
def cluster_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PATH", f"{fake_tools(tmp_path)}:{os.environ['PATH']}")
    return tmp_path


@pytest.mark.parametrize("name,n", sorted(COUNTS.items()))
def test_every_sweep_expands_to_its_runs_and_seeds_multiply(tmp_path: Path, name: str, n: int) -> None:
    jobs = expand(name, seeds=1, runs_root=tmp_path, overrides=["trainer.max_steps=9"])
    assert len(jobs) == n and len({j.run_dir for j in jobs}) == n
    for j in jobs:
        assert j.overrides[0] == f"experiment={j.experiment}" and (ROOT / "conf/experiment" / f"{j.experiment}.yaml"
                                                                   ).is_file()
        assert f"run_dir={tmp_path / name / j.experiment / 'seed0'}" in j.overrides
        assert "seed=0" in j.overrides and j.overrides[-1] == "trainer.max_steps=9"
    three = expand(name, seeds=3, runs_root=tmp_path, overrides=[])
    assert len(three) == 3 * n and sorted({j.seed for j in three}) == [0, 1, 2]
    assert {(j.experiment, j.seed) for j in three} == {(j.experiment, k) for j in jobs for k in range(3)}


def test_table4_is_the_five_mu_values() -> None:
    mus = set()
    for j in expand("table4_mu", seeds=1, runs_root=Path("/r"), overrides=[]):
        text = (ROOT / "conf/experiment" / f"{j.experiment}.yaml").read_text()
        mus.add(text.split("mu:")[1].split()[0].strip("'"))
    assert mus == {"1", "sqrt", "dk", "4dk", "learned"}


def test_dry_run_prints_jobs_and_scripts_with_the_resources_and_submits_nothing(
        cluster_env: Path, capsys: pytest.CaptureFixture) -> None:
    rc = sweep_main(["table5_noise", "--dry-run", f"cluster.runs_root={cluster_env / 'runs'}", "cluster.nodes=2",
                     "cluster.gpus_per_node=4", "cluster.partition=gpu", "cluster.account=proj", "cluster.qos=high",
                     "cluster.constraint=h200", "cluster.timeout_min=600", "cluster.signal_delay_s=300"])
    out = capsys.readouterr().out
    assert rc == 0 and not (cluster_env / "sbatch.log").exists()
    assert out.count("#!/bin/bash") == 3 and out.count("dry-run ") == 3
    for line in ("--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=4", "--partition=gpu", "--account=proj",
                 "--qos=high", "--constraint=h200", "--time=600", "--signal=USR1@300", "--requeue", "--exclusive"):
        assert out.count(f"#SBATCH {line}") == 3, line
    assert "exec bash slurm/requeue.sh" in out and "slurm.launch train.py experiment=table5_fixed_r " in out


def test_submit_freezes_the_run_skips_finished_runs_and_refuses_a_changed_config(
        cluster_env: Path, capsys: pytest.CaptureFixture) -> None:
    runs = cluster_env / "runs"
    args = ["table5_noise", f"cluster.runs_root={runs}", "trainer.max_steps=4"]
    assert sweep_main(args) == 0
    out = capsys.readouterr().out
    assert [ln.split()[-1] for ln in out.splitlines() if ln.startswith("submitted")] == ["1001", "1002", "1003"]
    run = runs / "table5_noise" / "table5_fixed_r" / "seed0"
    job = json.loads((run / "submit" / "job.json").read_text())
    assert job["total_steps"] == 4 and len(job["git_commit"]) >= 7
    assert json.loads((run / "submit" / "config.json").read_text())["mixer"]["noise"] == "fixed_r"
    assert (run / "submit" / "train.sbatch").read_text().startswith("#!/bin/bash")
    # a changed experiment is refused, naming the key; force=true re-freezes it
    assert sweep_main([*args[:-1], "trainer.max_steps=4", "optim.lr=1e-3"]) == 2
    err = capsys.readouterr().err
    assert "submitted with another config" in err and "optim.lr: 0.0004 -> 0.001" in err
    # a finished run (checkpoint at the last step) is skipped
    (run / "checkpoints" / "step_000000004").mkdir(parents=True)
    assert sweep_main(args) == 0
    out = capsys.readouterr().out
    assert "skip (finished)" in out and out.count("submitted") == 2
    assert sweep_main([*args, "optim.lr=1e-3", "force=true"]) == 0  # re-frozen; the finished run stays skipped
    out = capsys.readouterr().out
    assert "skip (finished)" in out and out.count("submitted") == 2
    # the status reads the run directories and the scheduler
    (run.parent.parent / "table5_learned" / "seed0" / "metrics.jsonl").write_text(
        '{"step": 3, "loss": 7.5}\n{"step": 4, "lo')
    assert status_main(["table5_noise", f"cluster.runs_root={runs}"]) == 0
    rows = {ln.split()[0].split("/")[-2]: ln.split() for ln in capsys.readouterr().out.splitlines()[1:]}
    assert rows["table5_fixed_r"][1:3] == ["finished", "1002"]
    assert rows["table5_learned"][1:] == ["running", "1006", "RUNNING", "3", "7.5000", "1001:?,1004:?,1006:RUNNING"]
    assert rows["table5_fixed_r_omega"][1:4] == ["failed", "1007", "FAILED"]


def _submitted(out: str) -> list[str]:
    return [ln.split()[-1] for ln in out.splitlines() if ln.startswith("submitted")]


def test_a_second_sweep_command_skips_runs_with_a_live_job_and_status_shows_every_job(
        cluster_env: Path, capsys: pytest.CaptureFixture) -> None:
    runs = cluster_env / "runs"
    args = ["table5_noise", f"cluster.runs_root={runs}", "trainer.max_steps=4"]
    assert sweep_main(args) == 0 and _submitted(capsys.readouterr().out) == ["1001", "1002", "1003"]
    (cluster_env / "queue").write_text("1001 RUNNING\n1002 PENDING\n")
    (cluster_env / "accounting").write_text("1003 CANCELLED\n")
    assert sweep_main(args) == 0
    out = capsys.readouterr().out
    assert _submitted(out) == ["1004"]  # only the run whose job ended is submitted again
    assert "skip (running: job 1001)" in out and "skip (pending: job 1002)" in out
    assert len((cluster_env / "sbatch.log").read_text().splitlines()) == 4
    dirs = [runs / "table5_noise" / e / "seed0" for e in ("table5_learned", "table5_fixed_r", "table5_fixed_r_omega")]
    ledgers = [[json.loads(x)["job_id"] for x in (d / "submit" / "jobs.jsonl").read_text().splitlines()]
               for d in dirs]
    assert ledgers == [["1001"], ["1002"], ["1003", "1004"]]
    assert not list(runs.rglob("*.tmp"))
    # a duplicate queued beside the running job (e.g. submitted by hand) is shown, with the scancel that removes it
    record_job(dirs[0], {"job_id": "1009", "kind": "train"})
    (cluster_env / "queue").write_text("1001 RUNNING\n1002 PENDING\n1004 PENDING\n1009 PENDING\n")
    assert sweep_main(args) == 0 and _submitted(capsys.readouterr().out) == []
    assert status_main(["table5_noise", f"cluster.runs_root={runs}"]) == 0
    captured = capsys.readouterr()
    rows = {ln.split()[0].split("/")[-2]: ln.split() for ln in captured.out.splitlines()[1:]}
    assert rows["table5_learned"][1:4] == ["running", "1001", "RUNNING"]
    assert rows["table5_learned"][-1] == "1001:RUNNING,1009:PENDING"
    assert rows["table5_fixed_r_omega"][-1] == "1003:CANCELLED,1004:PENDING"
    assert rows["table5_fixed_r"][-1] == "1002:PENDING"
    assert captured.err.strip() == ("warning: runs/table5_noise/table5_learned/seed0 has 2 live jobs (1001, 1009); "
                                    "keep the oldest: scancel 1009").replace("runs/", f"{runs}/", 1)


def test_two_sweep_commands_at_once_submit_each_run_once(tmp_path: Path) -> None:
    """Two `python -m slurm.sweep` of one sweep started together: each run is submitted once, and the second
    waits, then skips. The first sbatch call holds its job until the other command says it waits (the window in
    which both would plan before either records a job, held open)."""
    tools = fake_tools(tmp_path)
    sbatch, go = tools / "sbatch", tmp_path / "go"
    hold = f'while [ ! -e {go} ]; do sleep 0.05; done; echo "$((1000 + n));cluster"'
    sbatch.write_text(sbatch.read_text().replace('echo "$((1000 + n));cluster"', hold))
    (tmp_path / "queue").write_text("".join(f"{1000 + n} PENDING\n" for n in range(1, 7)))  # every job stays queued
    env = {**os.environ, "PATH": f"{tools}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "slurm.sweep", "table5_noise", f"cluster.runs_root={tmp_path / 'runs'}",
           "trainer.max_steps=4"]
    errs = [tmp_path / f"err{i}" for i in range(2)]
    procs = []
    for err in errs:
        with err.open("w") as f:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=f, text=True))
    try:
        deadline = time.monotonic() + timeout_s(300)
        while not any("waiting: another sweep command is submitting" in e.read_text() for e in errs):
            calls = (tmp_path / "sbatch.log").read_text().splitlines() if (tmp_path / "sbatch.log").is_file() else []
            assert len(calls) <= 1, f"both commands submitted at once: {calls}"
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, \
                [e.read_text()[-2000:] for e in errs]
            time.sleep(0.05)
    finally:
        go.touch()
    outs = [(p.communicate(timeout=timeout_s(300))[0], e.read_text()) for p, e in zip(procs, errs)]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert len((tmp_path / "sbatch.log").read_text().splitlines()) == 3
    assert sorted(len(_submitted(out)) for out, _ in outs) == [0, 3]


def _tools_dir(tmp: Path, name: str, sbatch: str | None) -> Path:
    """A PATH folder with squeue and sacct that know no job, and ``sbatch`` with body ``sbatch`` (None: none)."""
    bin_dir = tmp / name
    bin_dir.mkdir()
    bodies = {"squeue": "exit 0", "sacct": "exit 0"} | ({"sbatch": sbatch} if sbatch is not None else {})
    for tool, body in bodies.items():
        (bin_dir / tool).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / tool).chmod(0o755)
    return bin_dir


def test_a_refused_submission_freezes_nothing_and_a_corrected_one_is_accepted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    import shutil

    runs = tmp_path / "runs"
    args = ["table5_noise", f"cluster.runs_root={runs}", "trainer.max_steps=4"]
    monkeypatch.setenv("PATH", f"{_tools_dir(tmp_path, 'none', None)}:{os.environ['PATH']}")
    assert shutil.which("sbatch") is None
    assert sweep_main(args) == 2
    assert "sbatch is not on PATH" in capsys.readouterr().err
    assert [p.name for p in runs.iterdir()] == [".submit.lock"]  # no run directory: nothing frozen
    refuse = 'echo "sbatch: error: invalid partition specified: gpu" >&2; exit 1'
    monkeypatch.setenv("PATH", f"{_tools_dir(tmp_path, 'refuse', refuse)}:{os.environ['PATH']}")
    assert sweep_main([*args, "cluster.partition=gpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert "sbatch refused the job (sbatch: error: invalid partition specified: gpu)" in err
    assert len(err.splitlines()) == 1
    assert [p.name for p in runs.iterdir()] == [".submit.lock"]  # not even the run directories
    accept = f'echo "$@" >> {tmp_path}/sbatch.log; echo "2001;cluster"'
    monkeypatch.setenv("PATH", f"{_tools_dir(tmp_path, 'accept', accept)}:{os.environ['PATH']}")
    assert sweep_main([*args, "optim.lr=1e-3"]) == 0  # another setting: accepted, as nothing was submitted before
    assert _submitted(capsys.readouterr().out) == ["2001"] * 3
    run = runs / "table5_noise" / "table5_learned" / "seed0" / "submit"
    assert json.loads((run / "config.json").read_text())["optim"]["lr"] == 0.001
    assert (run / "train.sbatch").read_text().startswith("#!/bin/bash") and not list(run.glob("*.pending"))


@pytest.mark.parametrize("args,match", [
    (["table4_mu", "cluster.gpus_per_node=0"], "cluster.gpus_per_node=0: must be at least 1"),
    (["table4_mu", "cluster.timeout_min=20"], "lower trainer.ckpt_every or raise cluster.timeout_min"),
    (["table4_mu", "cluster.gpus_per_node=3"], "is not a multiple of micro_batch_size x seq_len x world_size"),
    (["table9"], "unknown sweep 'table9'; known sweeps: eval, table1_1.3b"),
    (["table4_mu", "cluster.gpu=1"], "cluster.gpu: unknown key (valid keys: "),
    (["table4_mu", "cluster.gpus_per_nod=1"], "cluster.gpus_per_nod: unknown key (did you mean 'gpus_per_node'?)"),
    (["table4_mu", "cluster.nodes=two"], "cluster.nodes='two' is not an int"),
    (["table4_mu", "sedds=3"], "sedds: unknown key (did you mean 'seeds'?)"),
    (["table4_mu", "resubmit_unknwn=true"], "resubmit_unknwn: unknown key (did you mean 'resubmit_unknown'?)"),
    (["table4_mu", "trainer.max_stepz=3"], "trainer.max_stepz: unknown key (did you mean 'max_steps'?)"),
    (["eval", "of=table4_mu", "ruler.sample_per_cell=3"], "ruler.sample_per_cell: unknown key (did you mean "
                                                          "'samples_per_cell'?)"),
    (["eval", "oof=table4_mu"], "oof: unknown key (did you mean 'of'?)"),
    *((["table4_mu", f"{key}={word}"], f"{key}='{word}' is not a boolean: write {key}=true or {key}=false")
      for key in ("resubmit_unknown", "force") for word in ("yes", "True", "1")),
    (["eval"], "add of=<sweep>"),
    (["table4_mu", "seeds=0"], "give at least one training seed"),
    (["table4_mu", "mixer.mu"], "arguments are key=value"),
])
def test_bad_settings_are_refused_in_one_line(args: list[str], match: str, cluster_env: Path,
                                              capsys: pytest.CaptureFixture) -> None:
    assert sweep_main([*args, "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert match in err and len(err.splitlines()) == 1


def test_eval_sweep_covers_the_finished_runs(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    cluster = load_cluster([f"runs_root={runs}"])
    train_jobs = expand("table5_noise", seeds=1, runs_root=runs, overrides=["trainer.max_steps=4"])
    done = train_jobs[1]
    (done.run_dir / "submit").mkdir(parents=True)
    (done.run_dir / "submit" / "job.json").write_text(json.dumps({"total_steps": 4}))
    (done.run_dir / "checkpoints" / "step_000000004").mkdir(parents=True)
    jobs = expand("eval", seeds=1, runs_root=runs, overrides=[], of="table5_noise")
    assert [j.run_dir for j in jobs] == [done.run_dir]
    assert jobs[0].command()[1:] == ["evaluate.py", f"model={done.run_dir}", "suites=[lm,ruler,retrieval]",
                                     "preset=paper"]
    script = plan(jobs[0], cluster).script
    assert "#SBATCH --gpus-per-node=1" in script and "#SBATCH --nodes=1" in script


def _finished_training(runs: Path, n: int) -> list[Path]:
    """The run directories of table5_noise's first ``n`` runs, finished (a checkpoint at their last step) by a
    training job that is over."""
    dirs = []
    for i, job in enumerate(expand("table5_noise", seeds=1, runs_root=runs, overrides=[])[:n]):
        (job.run_dir / "submit").mkdir(parents=True)
        (job.run_dir / "submit" / "job.json").write_text(json.dumps({"total_steps": 4}))
        (job.run_dir / "checkpoints" / "step_000000004").mkdir(parents=True)
        record_job(job.run_dir, {"job_id": str(900 + i), "kind": "train"})
        dirs.append(job.run_dir)
    return dirs


def test_the_eval_sweep_skips_runs_whose_evaluation_is_queued_or_running(
        cluster_env: Path, capsys: pytest.CaptureFixture) -> None:
    """``python -m slurm.sweep eval of=SWEEP`` twice submits each evaluation once while it is queued or running, and
    again once it has ended; its jobs share the run's ledger with the training jobs, told apart by kind."""
    runs = cluster_env / "runs"
    dirs = _finished_training(runs, 2)
    args = ["eval", "of=table5_noise", f"cluster.runs_root={runs}"]
    assert sweep_main(args) == 0 and _submitted(capsys.readouterr().out) == ["1001", "1002"]
    (cluster_env / "queue").write_text("1001 PENDING\n1002 RUNNING\n")
    assert sweep_main(args) == 0
    out = capsys.readouterr().out
    assert _submitted(out) == [] and "skip (pending: job 1001)" in out and "skip (running: job 1002)" in out
    assert len((cluster_env / "sbatch.log").read_text().splitlines()) == 2
    (cluster_env / "queue").write_text("1001 RUNNING\n")
    (cluster_env / "accounting").write_text("1002 FAILED\n")
    assert sweep_main(args) == 0
    out = capsys.readouterr().out
    assert _submitted(out) == ["1003"] and "skip (running: job 1001)" in out
    ledgers = [[(r["job_id"], r["kind"]) for r in recorded_jobs(d)] for d in dirs]
    assert ledgers == [[("900", "train"), ("1001", "eval")], [("901", "train"), ("1002", "eval"), ("1003", "eval")]]
    assert not (dirs[0] / "submit" / "config.json").exists()  # an evaluation freezes no training config
    # the status of the evaluations: 1003 is neither queued nor in the accounting: ended, no record of how
    assert status_main(args) == 0
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines()[1:]]
    assert [r[1:4] + r[-1:] for r in rows] == [["running", "1001", "RUNNING", "1001:RUNNING"],
                                               ["ended", "1003", "-", "1002:FAILED,1003:?"]]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_sweep_stopped_while_sbatch_runs_records_the_accepted_job(tmp_path: Path, signum: int) -> None:
    """A signal that arrives while sbatch submits (a ``kill``, a closed terminal) stops the sweep once the accepted
    job is recorded: the next sweep command sees it and does not submit the run twice."""
    tools = fake_tools(tmp_path)
    sbatch = tools / "sbatch"
    # kill(2) has made the signal pending on the sweep before sbatch goes on to accept the job: it arrives
    # mid-submission however the two processes are scheduled
    stop = f"#!/bin/bash\nkill -{int(signum)} $PPID\n"
    sbatch.write_text(sbatch.read_text().replace("#!/bin/bash\n", stop))
    env = {**os.environ, "PATH": f"{tools}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT)}
    runs = tmp_path / "runs"
    # the sweep starts with the signal's default action, as from a terminal: a test run under nohup (SIGHUP
    # ignored) or a runner that ignores SIGTERM would hand its children that disposition, which the sweep keeps
    start = f"import runpy, signal; signal.signal({int(signum)}, signal.SIG_DFL); runpy.run_module('slurm.sweep', " \
            "run_name='__main__', alter_sys=True)"
    proc = subprocess.run([sys.executable, "-c", start, "table5_noise", f"cluster.runs_root={runs}",
                           "trainer.max_steps=4"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout_s(120))
    assert proc.returncode == -signum, proc.stderr[-2000:]
    assert len((tmp_path / "sbatch.log").read_text().splitlines()) == 1  # stopped after the first submission
    ledger = runs / "table5_noise" / "table5_learned" / "seed0" / "submit" / "jobs.jsonl"
    assert ledger.is_file(), "the accepted job 1001 was not recorded"
    assert [json.loads(x)["job_id"] for x in ledger.read_text().splitlines()] == ["1001"]
    assert (ledger.parent / "train.sbatch").is_file() and (ledger.parent / "job.json").is_file()


def test_multi_node_rendezvous_from_slurm_variables() -> None:
    assert expand_nodelist("gpu[01-03,7],login") == ["gpu01", "gpu02", "gpu03", "gpu7", "login"]
    env = {"SLURM_JOB_ID": "123456", "SLURM_JOB_NODELIST": "node[08-11]", "SLURM_NNODES": "4", "SLURM_NODEID": "2"}
    r = rendezvous(env, nproc_per_node=8)
    assert (r.master_addr, r.master_port, r.world_size) == ("node08", 20000 + 123456 % 20000, 32)
    e = r.env(3)
    assert (e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["GROUP_RANK"]) == (
        "19", "3", "32", "8", "2")
    with pytest.raises(ValueError, match="one task per node"):
        rendezvous({**env, "SLURM_NODEID": "4"}, nproc_per_node=8)


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    out = tmp_path_factory.mktemp("shards") / "embedded"
    return [f"data.prepare.out_dir={out}", "data.prepare.max_tokens=60000", "data.prepare.num_workers=1"]


def _env(**slurm: str) -> dict[str, str]:
    return {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **slurm}


def _losses(run_dir: Path) -> list[float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def test_two_nodes_on_localhost_match_one_process(tmp_path: Path, shards: list[str]) -> None:
    """Two launcher tasks ("nodes") with one CPU process each (gloo) against one process with two accumulation
    steps: the same global batch, so the losses agree to FP32 rounding."""
    common = [*TOY, *shards, "trainer.max_steps=2"]
    one = subprocess.run([sys.executable, "-m", "slurm.launch", "train.py", *common, f"run_dir={tmp_path / 'one'}"],
                         cwd=ROOT, env=_env(MASTER_PORT=str(free_port())), capture_output=True, text=True,
                         timeout=timeout_s(300))
    assert one.returncode == 0, one.stdout[-2000:] + one.stderr[-2000:]
    port = free_port()  # the job id whose rendezvous port (20000 + id % 20000) is this free one
    slurm = {"SLURM_JOB_ID": str(port), "SLURM_JOB_NODELIST": "localhost,localhost", "SLURM_NNODES": "2"}
    nodes = [subprocess.Popen([sys.executable, "-m", "slurm.launch", "--nproc-per-node", "1", "train.py", *common,
                               f"run_dir={tmp_path / 'two'}"], cwd=ROOT, env=_env(**slurm, SLURM_NODEID=str(n)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for n in (0, 1)]
    outs = [p.communicate(timeout=timeout_s(300))[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    assert f"node 1/2, 1 process(es), world 2, master localhost:{port}" in outs[1]
    assert "2 process(es) x 1 accumulation" in outs[0]
    l1, l2 = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert len(l1) == len(l2) == 2 and l1 == pytest.approx(l2, rel=1e-5, abs=0)


def test_requeued_job_resumes_its_checkpoint(tmp_path: Path, shards: list[str]) -> None:
    """The rendered batch script under fake srun/scontrol: a signal makes train.py save and the script requeue;
    the requeued script (the same file) resumes from the saved step instead of starting over."""
    tools = fake_tools(tmp_path)
    runs = tmp_path / "runs"
    job = Job("test", "train", "toy", 0, runs / "toy", tuple([*TOY, *shards, f"run_dir={runs / 'toy'}",
                                                              f"trainer.max_steps={ENDLESS}",
                                                              "trainer.ckpt_every=0"]))
    script = tmp_path / "job.sbatch"
    script.write_text(plan(job, load_cluster(["gpus_per_node=1", "nodes=1"])).script)
    job_id = str(free_port())  # its rendezvous port (20000 + id % 20000) is free
    env = _env(SLURM_JOB_ID=job_id, SLURM_JOB_NODELIST="localhost", SLURM_NNODES="1", SLURM_NODEID="0",
               PATH=f"{tools}:{os.environ['PATH']}")
    metrics = runs / "toy" / "metrics.jsonl"

    def run_until(n_lines: int) -> tuple[int, str]:
        proc = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        deadline = time.time() + timeout_s(240)
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= n_lines):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGUSR1)  # as SLURM signals every process of the job
        return proc.wait(timeout=timeout_s(240)), proc.communicate()[0]

    rc, out = run_until(2)
    assert rc == 75, out[-3000:]
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", job_id]
    saved = len(_losses(runs / "toy"))
    rc, out = run_until(saved + 2)
    assert rc == 75 and "resumed from" in out, out[-3000:]
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines() if '"loss"' in x]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= saved + 2


def _stopped_run(root: Path, steps: list[int], every: int = 100, files: tuple[str, ...] = ()) -> Path:
    """A run directory whose training logged ``steps`` (a torn line after them) at ``trainer.ckpt_every=every``,
    with ``files`` under ``checkpoints/``."""
    from omegaconf import OmegaConf

    from trainer.config import TrainConfig

    run = root / f"run{len(list(root.glob('run*')))}"
    run.mkdir(parents=True)
    cfg = OmegaConf.structured(TrainConfig)
    cfg.trainer.ckpt_every = every
    (run / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": n, "loss": 9.0 - n / 100}) + "\n" for n in steps)
                                       + '{"step": 1')
    for name in files:
        (run / "checkpoints" / name).mkdir(parents=True)
    return run


def test_a_run_may_start_over_only_before_its_first_checkpoint(tmp_path: Path) -> None:
    """``restart_reason``: records within the first checkpoint interval and an empty ``checkpoints/`` (nothing was
    saved, nothing can be lost) give a reason; a checkpoint of any kind, records past the interval (a checkpoint was
    due: a person decides), checkpoints only at the end or on a signal, no records or no readable config give
    None."""
    from slurm.sweeps import restart_reason

    run = _stopped_run(tmp_path, [1, 2, 3])
    assert restart_reason(run) == f"{run} stopped at step 3, before its first checkpoint (every 100 steps), and " \
                                   "holds no checkpoint"
    (run / "checkpoints").mkdir()
    assert restart_reason(run) is not None  # an empty folder, as a save that never began leaves it
    assert restart_reason(_stopped_run(tmp_path, [50, 100])) is not None  # killed while saving the first one
    for files in (("step_000000050",), (".tmp_step_000000100.ab12cd34",), ("step_000000100.corrupt",)):
        assert restart_reason(_stopped_run(tmp_path, [50], files=files)) is None, files
    assert restart_reason(_stopped_run(tmp_path, [100, 101])) is None
    assert restart_reason(_stopped_run(tmp_path, [3], every=0)) is None
    assert restart_reason(_stopped_run(tmp_path, [3], every=-1)) is None
    assert restart_reason(_stopped_run(tmp_path, [])) is not None  # only a torn line: nothing of worth
    bare = _stopped_run(tmp_path, [3])
    (bare / "config.yaml").unlink()
    assert restart_reason(bare) is None
    (bare / "metrics.jsonl").write_text("")
    assert restart_reason(bare) is None and restart_reason(tmp_path / "absent") is None


def test_only_training_scripts_without_a_resume_setting_may_start_over(tmp_path: Path) -> None:
    cluster = load_cluster(["gpus_per_node=1"])
    train = Job("test", "train", "toy", 0, tmp_path / "toy", (*TOY, f"run_dir={tmp_path / 'toy'}"))
    script = plan(train, cluster).script
    assert "restart_reason" in script and script.rstrip().endswith(" $restart")
    forced = Job("test", "train", "toy", 0, tmp_path / "toy", (*TOY, f"run_dir={tmp_path / 'toy'}", "resume=force"))
    assert "restart" not in plan(forced, cluster).script.replace("KDN_MAX_REQUEUES", "")
    evaluation = Job("test", "eval", "toy", 0, tmp_path / "toy", (f"model={tmp_path / 'toy'}",))
    assert "restart" not in plan(evaluation, cluster).script.replace("KDN_MAX_REQUEUES", "")


def test_a_job_killed_before_its_first_checkpoint_starts_over_when_run_again(tmp_path: Path,
                                                                             shards: list[str]) -> None:
    """The rendered batch script under fake srun/scontrol, killed with SIGKILL before its first checkpoint (a hard
    failure: nothing saved): run again, as SLURM runs a requeued job, it starts the run over (the earlier records
    set aside) instead of stopping to ask for ``resume=restart``."""
    tools = fake_tools(tmp_path)
    run = tmp_path / "runs" / "toy"
    job = Job("test", "train", "toy", 0, run, tuple([*TOY, *shards, f"run_dir={run}",
                                                     f"trainer.max_steps={2 * ENDLESS}",
                                                     f"trainer.ckpt_every={ENDLESS}"]))
    script = tmp_path / "job.sbatch"
    script.write_text(plan(job, load_cluster(["gpus_per_node=1", "nodes=1"])).script)
    env = _env(SLURM_JOB_ID=str(free_port()), SLURM_JOB_NODELIST="localhost", SLURM_NNODES="1", SLURM_NODEID="0",
               PATH=f"{tools}:{os.environ['PATH']}")
    metrics = run / "metrics.jsonl"

    def start(restarts: int) -> subprocess.Popen:
        return subprocess.Popen(["bash", str(script)], env={**env, "SLURM_RESTART_COUNT": str(restarts)},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def wait_for(proc: subprocess.Popen, n_lines: int) -> None:
        deadline = time.time() + timeout_s(240)
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= n_lines):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.2)

    proc = start(0)
    wait_for(proc, 2)
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=timeout_s(60)) == -signal.SIGKILL
    assert not list(run.glob("checkpoints/step_*")) and len(metrics.read_text().splitlines()) >= 2
    proc = start(1)
    deadline = time.time() + timeout_s(240)
    while not list(run.glob("metrics.*.jsonl")):  # the earlier records set aside: the new start began
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.2)
    wait_for(proc, 2)
    os.killpg(proc.pid, signal.SIGUSR1)
    rc, out = proc.wait(timeout=timeout_s(240)), proc.communicate()[0]
    assert rc == 75, out[-3000:]
    assert f"batch shell: {run} stopped at step " in out and "starting it over (resume=restart)" in out
    assert "starts over from step 0" in out
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines() if '"loss"' in x]
    assert steps[:2] == [1, 2]


def test_sweep_error_is_a_value_error() -> None:
    assert issubclass(SweepError, ValueError)
