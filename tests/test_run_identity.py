"""A run directory is one experiment: default names, the fingerprint check, resume=force, and the run lock."""
from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import timeout_s
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from toy_run import ROOT, TOY, losses, make_cfg, rows, run_train

from trainer.config import build_model_config, load_config
from trainer.optim import warmup_cosine
from trainer.rundir import LOCK_FILE, RunDirError, RunLock, differences, fingerprint, name_suffix


def _name(overrides: list[str]) -> str:
    """The resolved default name inside a Hydra job with these command-line overrides."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides, return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        try:
            return str(cfg.name)
        finally:
            HydraConfig.instance().cfg = None


def test_default_name_holds_the_experiment_changing_overrides() -> None:
    assert _name([]) == "small_recurrent_kdn_diag"
    mu1, mudk = _name(["mixer.mu=1"]), _name(["mixer.mu=dk"])
    assert mu1 == "small_recurrent_kdn_diag_mixer.mu=1" and mudk != mu1
    # bookkeeping overrides and the choices already in the name leave it alone; the order does not matter
    assert _name(["mixer.mu=1", "logging=quiet", "trainer.stop_after=2", "resume=force",
                  "logging.log_every=5", "trainer.ckpt_every=7", "trainer.eval_every=1"]) == mu1
    assert _name(["optim.lr=1e-3", "mixer.mu=1", "model=toy"]) == _name(["model=toy", "mixer.mu=1", "optim.lr=1e-3"])
    # one value, one name: the schema's reading of the value, not its spelling on the command line
    assert _name(["optim.lr=1e-3"]) == _name(["optim.lr=0.001"]) == "small_recurrent_kdn_diag_optim.lr=0.001"
    assert _name(["optim.lr=1"]) == _name(["optim.lr=1.0"]) != _name(["optim.lr=1.5"])
    assert _name(["trainer.max_steps=30"]) == _name(["trainer.max_steps=030"]) != _name(["trainer.max_steps=31"])
    assert _name(["model=toy", "mixer=kda"]) == "toy_recurrent_kda"
    path = name_suffix(["data.prepare.out_dir=/scratch/a b/shards"])
    assert "/" not in path and " " not in path
    long = name_suffix([f"model.overrides.k{i}={i}" for i in range(40)])
    assert len(long) <= 121 and long != name_suffix([f"model.overrides.k{i}={i}" for i in range(41)])
    assert _name(["experiment=table4_mu_1", "optim.lr=1e-3"]) == "table4_mu_1"  # presets name themselves


def test_fingerprint_ignores_resumable_keys_and_names_the_rest() -> None:
    from dataclasses import asdict

    a = asdict(make_cfg(["model=toy", "mixer.mu=dk"]))
    b = asdict(make_cfg(["model=toy", "mixer.mu=dk", "trainer.stop_after=9", "logging=quiet", "run_dir=/x"]))
    c = asdict(make_cfg(["model=toy", "mixer.mu=1", "optim.lr=1e-2"]))
    assert fingerprint(a) == fingerprint(b) and differences(a, b) == {}
    assert differences(a, c) == {"mixer.mu": ["dk", "1"], "optim.lr": [4e-4, 1e-2]}


# One override per identity key (every key of the config that is not in RESUMABLE_KEYS), each a valid change.
EXPERIMENT_OVERRIDES = {
    "backbone.pattern": "backbone=hybrid_swa", "backbone.window": "backbone.window=64",
    "data.prepare.max_tokens": "data.prepare.max_tokens=30000", "data.prepare.out_dir": "data.prepare.out_dir=/d/x",
    "data.prepare.source": "data.prepare.source=jsonl", "data.prepare.tokenizer": "data.prepare.tokenizer=gpt2",
    "data.prepare.val_fraction": "data.prepare.val_fraction=0.1", "data.seed": "data.seed=1",
    "data.seq_len": "data.seq_len=64", "data.varlen": "data.varlen=true",
    "mixer.alpha_param": "mixer.alpha_param=sigmoid", "mixer.memory": "mixer.memory=dplr",
    "mixer.chunk_size": "mixer.chunk_size=64", "mixer.backend": "mixer.backend=torch",
    "mixer.mu": "mixer.mu=1", "mixer.name": "mixer=kda", "mixer.noise": "mixer.noise=fixed_r",
    "mixer.precision": "mixer.precision=fp32",
    "model.init": "model.init=authors", "model.overrides": "+model.overrides.num_layers=3", "model.size": "model=small",
    "optim.betas": "optim.betas=[0.8,0.9]", "optim.eps": "optim.eps=1e-6", "optim.grad_clip": "optim.grad_clip=0.5",
    "optim.lr": "optim.lr=1e-3", "optim.min_lr_ratio": "optim.min_lr_ratio=0",
    "optim.warmup_frac": "optim.warmup_frac=0.1", "optim.weight_decay": "optim.weight_decay=0", "seed": "seed=1",
    "trainer.device": "trainer.device=cpu", "trainer.distributed": "trainer.distributed=fsdp",
    "trainer.eval_batches": "trainer.eval_batches=2", "trainer.global_batch_tokens": "trainer.global_batch_tokens=2048",
    "trainer.max_steps": "trainer.max_steps=30", "trainer.micro_batch_size": "trainer.micro_batch_size=4",
    "trainer.precision": "trainer.precision=fp32", "trainer.token_budget": "trainer.token_budget=1000000",
}
BOOKKEEPING_OVERRIDES = ["logging=quiet", "logging.log_every=5", "logging.wandb.mode=disabled",
                         "logging.profile.steps=2", "trainer.stop_after=2", "trainer.eval_every=1",
                         "trainer.ckpt_every=7", "trainer.keep_last=3", "trainer.export=false", "trainer.reshard=true",
                         "trainer.check_weights_every=0", "trainer.compile=true", "trainer.recompute_states=true",
                         "trainer.peak_flops=1e12", "data.num_workers=1", "resume=force", "resume=restart"]


@pytest.fixture(scope="module")
def toy_identity() -> tuple[str, dict]:
    """The default name and the config of ``model=toy`` alone."""
    from dataclasses import asdict

    return _name(["model=toy"]), asdict(make_cfg(["model=toy"]))


def test_the_experiment_overrides_cover_every_identity_key(toy_identity: tuple[str, dict]) -> None:
    from trainer.rundir import IMPLICIT_DEFAULTS, identity

    # a key at its implicit default is left out of the identity, so that runs recorded before it keep theirs
    assert set(EXPERIMENT_OVERRIDES) == set(identity(toy_identity[1])) | set(IMPLICIT_DEFAULTS)


@pytest.mark.parametrize("key", sorted(EXPERIMENT_OVERRIDES))
def test_each_experiment_override_changes_the_name_and_the_fingerprint_on_its_own(
        key: str, toy_identity: tuple[str, dict]) -> None:
    from dataclasses import asdict

    override, (name, config) = EXPERIMENT_OVERRIDES[key], toy_identity
    assert _name(["model=toy", override]) != name
    changed = asdict(make_cfg(["model=toy", override]))
    assert fingerprint(changed) != fingerprint(config) and key in differences(config, changed)


@pytest.mark.parametrize("override", BOOKKEEPING_OVERRIDES)
def test_bookkeeping_overrides_change_neither_the_name_nor_the_fingerprint(
        override: str, toy_identity: tuple[str, dict]) -> None:
    from dataclasses import asdict

    name, config = toy_identity
    assert _name(["model=toy", override]) == name
    assert fingerprint(asdict(make_cfg(["model=toy", override]))) == fingerprint(config)


def test_another_experiment_is_refused_and_resume_force_adopts_it(tmp_path: Path, shards: list[str]) -> None:
    run = tmp_path / "r"
    common = TOY + shards + [f"run_dir={run}", "trainer.max_steps=6", "trainer.ckpt_every=0", "mixer.mu=dk",
                             "optim.warmup_frac=0.5"]
    run_train(common + ["trainer.stop_after=2"])
    with pytest.raises(RunDirError, match=r"mixer\.mu: 'dk' -> '1'.*name=<new name>.*resume=force"):
        run_train(common + ["mixer.mu=1"])
    with pytest.raises(RunDirError, match=r"optim\.betas: \[0\.9, 0\.95\] -> \[0\.8, 0\.9\]; optim\.lr"):
        run_train(common + ["optim.lr=1e-2", "optim.betas=[0.8,0.9]"])
    assert [r["step"] for r in losses(run)] == [1, 2]  # the refusals trained nothing and kept the records

    out = run_train(common + ["optim.lr=1e-2", "optim.betas=[0.8,0.9]", "resume=force", "trainer.stop_after=4"])
    assert out["step"] == 4
    recs = losses(run)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    for r in recs:  # steps 1-2 on the old peak LR, 3-4 on the new one, one schedule (warm-up 3 of 6 steps)
        peak = 4e-4 if r["step"] <= 2 else 1e-2
        assert r["lr"] == pytest.approx(peak * warmup_cosine(r["step"] - 1, warmup_steps=3, total_steps=6,
                                                              min_ratio=0.1), rel=1e-12)
    (event,) = [r for r in rows(run) if "event" in r]
    assert event == {"step": 2, "event": "resume_force",
                     "changes": {"optim.betas": [[0.9, 0.95], [0.8, 0.9]], "optim.lr": [4e-4, 1e-2]}}
    opt = torch.load(out["checkpoint"] / "optimizer.bin", map_location="cpu", weights_only=True)
    assert [(g["initial_lr"], tuple(g["betas"])) for g in opt["param_groups"]] == [(1e-2, (0.8, 0.9))] * 2
    stored = json.loads((run / "fingerprint.json").read_text())["config"]
    assert stored["optim"]["lr"] == 1e-2  # adopted: the same command now resumes without force
    assert run_train(common + ["optim.lr=1e-2", "optim.betas=[0.8,0.9]"])["step"] == 6


def _lock_of(pid: int, host: str | None = None, job: str | None = None) -> str:
    return json.dumps({"pid": pid, "host": host or socket.gethostname(), "job": job, "token": "other"})


def test_a_live_lock_refuses_and_a_stale_one_is_broken(tmp_path: Path, shards: list[str],
                                                       caplog: pytest.LogCaptureFixture) -> None:
    run = tmp_path / "locked"
    run.mkdir()
    other = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])  # alive until killed
    try:
        (run / LOCK_FILE).write_text(_lock_of(other.pid))
        args = TOY + shards + [f"run_dir={run}", "trainer.max_steps=1"]
        with pytest.raises(RunDirError, match=rf"in use by pid {other.pid} on .*wait for that run to end"):
            run_train(args)
        assert not (run / "checkpoints").exists() and not (run / "config.yaml").exists()
    finally:
        other.kill()
        other.wait()
    with caplog.at_level(logging.WARNING, logger="train"):
        assert run_train(args)["finished"]
    assert f"breaking the stale lock {run / LOCK_FILE} of pid {other.pid}" in caplog.text
    assert not (run / LOCK_FILE).exists()  # released at the end


def test_run_lock_rules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with RunLock(tmp_path):
        with pytest.raises(RunDirError, match="in use by pid"):  # this live process
            RunLock(tmp_path).acquire()
    assert not (tmp_path / LOCK_FILE).exists()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / LOCK_FILE).write_text(_lock_of(dead.pid, host="another-host"))
    with pytest.raises(RunDirError, match="on another-host"):  # cannot tell whether it lives: refused
        RunLock(tmp_path).acquire()
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    (tmp_path / LOCK_FILE).write_text(_lock_of(dead.pid, host="another-host", job="4242"))
    with RunLock(tmp_path) as lock:  # an earlier run of the same (requeued) job
        assert json.loads((tmp_path / LOCK_FILE).read_text())["token"] == lock.me["token"]
    (tmp_path / LOCK_FILE).write_text("")  # a holder that died while writing it
    with RunLock(tmp_path):
        pass


def _race(run_dir: str, start: object, tried: object, results: object) -> None:
    start.wait()
    lock = RunLock(run_dir)
    try:
        lock.acquire()
        results.put("took")
    except RunDirError:
        results.put("refused")
    tried.wait()  # the holder keeps the lock until every process has tried
    lock.release()


def test_processes_racing_for_a_stale_lock_let_exactly_one_in(tmp_path: Path) -> None:
    import multiprocessing as mp

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / LOCK_FILE).write_text(_lock_of(dead.pid))
    ctx = mp.get_context("fork")
    start, tried, results = ctx.Barrier(4), ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_race, args=(str(tmp_path), start, tried, results)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s(30))
    outcome = sorted(results.get(timeout=timeout_s(5)) for _ in procs)
    assert outcome == ["refused"] * 3 + ["took"]
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_run_recorded_before_model_init_keeps_its_fingerprint_and_authors_changes_it() -> None:
    from dataclasses import asdict

    new = asdict(make_cfg(["model=toy"]))
    old = {**new, "model": {k: v for k, v in new["model"].items() if k != "init"}}
    assert fingerprint(old) == fingerprint(new) and differences(old, new) == {}
    authors = asdict(make_cfg(["model=toy", "model.init=authors"]))
    assert differences(old, authors) == {"model.init": [None, "authors"]}
    assert build_model_config(load_config(authors), 512).init == "authors"
    fp32 = asdict(make_cfg(["model=toy", "mixer.precision=fp32"]))
    assert differences(old, fp32) == {"mixer.precision": ["bf16", "fp32"]}
    assert build_model_config(load_config(fp32), 512).mixer_kwargs["precision"] == "fp32"


def test_a_run_recorded_with_the_older_mixer_section_keeps_its_fingerprint() -> None:
    """Runs recorded when the mixer section held KDN's options beside a ``kwargs`` dict are the same experiment as
    the mixer's whole config now; an option set there still counts."""
    from dataclasses import asdict

    new = asdict(make_cfg(["model=toy", "mixer.mu=1"]))
    old_mixer = {"name": "kdn_diag", "mu": "1", "noise": "learned", "alpha_param": "kda", "precision": None,
                 "kwargs": {}}
    assert differences({**new, "mixer": old_mixer}, new) == {}
    dplr = {**new, "mixer": {**old_mixer, "kwargs": {"memory": "dplr"}}}
    assert differences(dplr, new) == {"mixer.memory": ["dplr", "asym"]}
    kda = asdict(make_cfg(["model=toy", "mixer=kda"]))
    assert differences({**kda, "mixer": {"name": "kda", "mu": None, "noise": None, "alpha_param": None,
                                         "precision": None, "kwargs": {}}}, kda) == {}
