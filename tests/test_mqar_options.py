"""``eval.mqar``'s options: every one range-checked in one line naming it and its type, and the model's ``init`` and
``precision``, which reach the model, the job's identity, its file name and its results, so that the arms of an
experiment share ``out`` without their job files colliding."""
from __future__ import annotations

import json
import math

import pytest
import torch

from eval.mqar import parse_overrides
from eval.mqar.config import RULES, MQARConfig
from eval.mqar.run import build_jobs, load_done, run_grid
from eval.mqar.train import JobRun, MixerChoice

EXPERIMENT = "mixers=kdn_diag,kda widths=128 lrs=3e-4 seeds=0,1,2 epochs=12".split()
ARMS = [["init=fla", "precision=bf16"], ["init=fla", "precision=fp32"], ["init=authors", "precision=bf16"],
        ["init=authors", "precision=fp32"]]


@pytest.mark.parametrize(("arg", "message"), [
    ("lrs=0", "lrs=0 is out of range: it must be a non-empty list of positive finite float"),
    ("lrs=-1", "lrs=-1 is out of range"), ("lrs=nan", "lrs=nan is out of range"),
    ("lrs=inf", "lrs=inf is out of range: it must be a non-empty list of positive finite float"),
    ("lrs=1e-3,inf", "lrs=0.001,inf is out of range"), ("lrs=-inf", "lrs=-inf is out of range"),
    ("eps=inf", "eps=inf is out of range: it must be a positive finite float"), ("eps=nan", "eps=nan is out"),
    ("grad_clip=inf", "grad_clip=inf is out of range: it must be a positive finite float"),
    ("power_a=inf", "power_a=inf is out of range: it must be a positive finite float"),
    ("power_a=1e999", "power_a=inf is out of range"), ("weight_decay=inf", "weight_decay=inf is out of range"),
    ("widths=0", "widths=0 is out of range: it must be a non-empty list of positive int"),
    ("seeds=", "seeds= is out of range: it must be a non-empty list of int >= 0"), ("seeds=-1", "seeds=-1 is out"),
    ("threads=0", "threads=0 is out of range: it must be an int >= 1"),
    ("widths=abc", "widths='abc' is not a comma-separated list of int"),
    ("lrs=fast", "lrs='fast' is not a comma-separated list of float"),
    ("epochs=1.5", "epochs='1.5' is not an int"), ("graphs=maybe", "graphs='maybe' is not a boolean"),
    ("graphs=yes", "graphs='yes' is not a boolean: write graphs=true or graphs=false"),
    ("train=0", "train='0' is not a boolean: write train=true or train=false"),
    ("widht=64", "widht: unknown key (did you mean 'widths'?)"),
    ("mixers=", "mixers= is out of range"), ("settings=", "settings= is out of range"),
    ("betas=0.9", "betas=0.9 is out of range: it must be two float"), ("betas=0.9,1", "betas=0.9,1 is out"),
    ("warmup_frac=1", "warmup_frac=1.0 is out of range"), ("min_lr_ratio=2", "min_lr_ratio=2.0 is out"),
    ("weight_decay=-0.1", "weight_decay=-0.1 is out"), ("eps=0", "eps=0.0 is out"),
    ("grad_clip=0", "grad_clip=0.0 is out"), ("power_a=0", "power_a=0.0 is out"), ("vocab_size=1", "vocab_size=1 is"),
    ("workers=-1", "workers=-1 is out"), ("streams=-1", "streams=-1 is out"), ("head_dim=0", "head_dim=0 is out"),
    ("train_examples=0", "train_examples=0 is out"), ("max_train_tokens=0", "max_train_tokens=0 is out"),
    ("valid_examples=0", "valid_examples=0 is out"), ("test_examples=0", "test_examples=0 is out"),
    ("batch_tokens=0", "batch_tokens=0 is out"), ("epochs=0", "epochs=0 is out"),
    ("init=mamba", "init=mamba is out of range: it must be one of ['fla', 'authors']"),
    ("precision=fp16", "precision=fp16 is out of range: it must be one of ['bf16', 'fp32']"),
    ("seeds=0,1,0", "seeds lists 0 more than once"), ("widths=64,64", "widths lists 64 more than once"),
    ("device=gpu0", "device=gpu0 is not a device"),
])
def test_a_bad_option_is_refused_in_one_line_naming_it(arg: str, message: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_overrides(["preset=cpu", arg])
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize(("args", "message"), [
    (["widths=65"], "mixer kdn_diag at width 65 (head_dim=64) cannot be built: width 65 is not a multiple of "
                    "head_dim 64; pick widths that are"),
    (["mixers=kda,attn", "widths=64,96"], "mixer kda at width 96 (head_dim=64) cannot be built"),
    (["mixers=kda,mamba3_siso", "head_dim=4"], "mixer mamba3_siso at width 64 (head_dim=4) cannot be built: "
                                               "state_size * rope_fraction = 1.0 gives no rotary angle"),
    (["mixers=kdn_diag/memory=dplr", "precision=fp32"], "mixer kdn_diag/memory=dplr at width 64 (head_dim=64) "
                                                        "cannot be built: precision='fp32' runs the asymmetric memory"),
])
def test_a_grid_with_a_model_that_cannot_be_built_is_refused_before_any_job(
        args: list[str], message: str, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ``(mixer, width)`` cell is built (on the meta device) up front with the grid's ``init`` and
    ``precision``: a cell that cannot be built stops ``python -m eval.mqar`` in one line before any job runs or any
    file is written (it used to fail every such job, advise a rerun that fails the same way and write an empty
    results file)."""
    from eval.mqar.__main__ import main

    with pytest.raises(ValueError) as err:
        parse_overrides(["preset=cpu", *args])
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        main(["preset=cpu", *args, f"out={tmp_path / 'out'}"])
    assert str(stop.value) == f"eval.mqar: {err.value}"
    assert list(tmp_path.iterdir()) == []
    parse_overrides(["preset=cpu", "mixers=kda,attn", "widths=64,128", "head_dim=32"])  # these build


def test_every_numeric_and_choice_option_has_a_range() -> None:
    unchecked = {"preset", "test_settings", "device", "graphs", "curve", "train", "times", "out", "results"}
    assert set(RULES) == {f for f in MQARConfig.__dataclass_fields__} - unchecked


def test_the_experiments_arms_have_their_own_job_files_and_results() -> None:
    names, results = {}, set()
    for arm in ARMS:
        cfg, _ = parse_overrides(["preset=full", *EXPERIMENT, *arm])
        jobs = build_jobs(cfg)
        assert len(jobs) == 6 and len({j.name for j in jobs}) == 6
        names[tuple(arm)] = {j.name: j.identity() for j in jobs}
        results.add(cfg.results)
    assert len(results) == 4 and "runs/mqar/full/mqar.json" in results
    for a, jobs_a in names.items():
        for b, jobs_b in names.items():
            for name in jobs_a.keys() & jobs_b.keys():  # a shared file holds one identity
                assert jobs_a[name] == jobs_b[name], (a, b, name)
    kdn = {arm: {n for n in jobs if n.startswith("kdn_diag")} for arm, jobs in names.items()}
    assert all(not (kdn[a] & kdn[b]) for a in kdn for b in kdn if a != b), "a KDN job file shared by two arms"
    kda = {arm: {n for n in jobs if n.startswith("kda")} for arm, jobs in names.items()}
    # precision does not apply to KDA: one file per init arm, not per precision
    assert kda[("init=fla", "precision=bf16")] == kda[("init=fla", "precision=fp32")]
    assert kda[("init=authors", "precision=bf16")] == kda[("init=authors", "precision=fp32")]
    assert not kda[("init=fla", "precision=bf16")] & kda[("init=authors", "precision=bf16")]
    assert names[("init=fla", "precision=bf16")]["kdn_diag_d128_lr0.0003_s0"]["precision"] == "bf16"
    assert names[("init=fla", "precision=bf16")]["kda_d128_lr0.0003_s0"]["precision"] is None


def test_a_job_file_from_before_the_options_is_a_default_jobs(tmp_path) -> None:
    """A stored job without ``init`` and ``precision`` in its identity was trained at the defaults: it is reused by
    the default arm and by no other."""
    path = tmp_path / "job.json"
    for mixer in ("kdn_diag", "kda"):
        for arm, reused in ((ARMS[0], True), (ARMS[1], mixer == "kda"), (ARMS[2], False), (ARMS[3], False)):
            cfg, _ = parse_overrides(["preset=cpu", f"mixers={mixer}", "widths=64", "lrs=1e-3", *arm])
            job = build_jobs(cfg)[0]
            default_job = build_jobs(parse_overrides(["preset=cpu", f"mixers={mixer}", "widths=64", "lrs=1e-3"])[0])[0]
            old = {k: v for k, v in default_job.identity().items() if k not in ("init", "precision")}
            path.write_text(json.dumps({"identity": old}))
            assert (load_done(path, job) is not None) == reused, (mixer, arm)


def test_init_and_precision_reach_the_model() -> None:
    budget = parse_overrides(["preset=cpu", "settings=32x4", "vocab_size=64", "train_examples=64"])[0].budget()
    setting = [s for s, _ in budget.mixture()]

    def run(mixer: str, init: str, precision: str | None) -> JobRun:
        return JobRun(MixerChoice.parse(mixer), 64, 1e-3, 0, budget, setting, torch.device("cpu"), init=init,
                      precision=precision)

    authors, fla = run("kdn_diag", "authors", "fp32"), run("kdn_diag", "fla", "bf16")
    assert authors.cfg.init == "authors" and fla.cfg.init == "fla"
    assert authors.model.model.layers[0].mixer.precision == "fp32" == authors.cfg.mixer_kwargs["precision"]
    assert fla.model.model.layers[0].mixer.precision == "bf16" and "precision" not in fla.cfg.mixer_kwargs
    conv = authors.model.model.layers[0].mixer.front.q_conv1d.weight
    assert math.isclose(conv.std().item(), 0.5 / math.sqrt(3), rel_tol=0.1)  # the default draw, fan-in 4
    assert math.isclose(fla.model.model.layers[0].mixer.front.q_conv1d.weight.std().item(), 0.02, rel_tol=0.1)
    kda = run("kda", "authors", None)
    assert kda.cfg.init == "authors" and "precision" not in kda.cfg.mixer_kwargs


def test_a_grid_records_its_arm(tmp_path) -> None:
    argv = ["mixers=kdn_diag,kda", "widths=64", "settings=32x4", "lrs=3e-3", "train_examples=32", "valid_examples=16",
            "test_examples=16", "batch_tokens=1024", "vocab_size=64", f"out={tmp_path}", "preset=cpu",
            "init=authors", "precision=fp32"]
    cfg, _ = parse_overrides(argv)
    results, failed = run_grid(cfg, log=lambda _: None)
    assert failed == [] and cfg.results == f"{tmp_path}/mqar_init-authors_fp32.json"
    stored = {p.name for p in (tmp_path / "jobs").glob("*.json")}
    assert stored == {"kdn_diag_d64_lr0.003_s0_init-authors_fp32.json", "kda_d64_lr0.003_s0_init-authors.json"}
    by = {r["mixer"]: r for r in results}
    assert (by["kdn_diag"]["init"], by["kdn_diag"]["precision"]) == ("authors", "fp32")
    assert (by["kda"]["init"], by["kda"]["precision"]) == ("authors", None)
    assert by["kdn_diag"]["identity"]["init"] == "authors"
