"""The Hydra config tree: every option and paper preset composes and validates; bad values fail in one line."""
from __future__ import annotations

import json
import subprocess
from dataclasses import asdict, fields
from pathlib import Path

import pytest
from conftest import timeout_s
from forkserver import command_env, commands
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from models import MIXERS
from trainer.config import ConfigError, TrainConfig, build_model_config, derive_budget, load_config

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
GROUPS = ("model", "mixer", "backbone", "data", "optim", "trainer", "logging")
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml") if not p.stem.startswith("gpu_"))
GPU_CHECKS = sorted(p.stem for p in (CONF / "experiment").glob("gpu_*.yaml"))


def cfg_of(overrides: list[str]) -> TrainConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return load_config(compose("config", overrides=overrides))


def run_of(overrides: list[str]) -> TrainConfig:
    """``cfg_of`` and the checks a run makes once it knows its vocabulary and world size: the model and the batch."""
    c = cfg_of(overrides)
    build_model_config(c, 32000)
    derive_budget(c, world_size=1)
    return c


def test_default_is_the_cpu_demo() -> None:
    c = cfg_of([])
    assert (c.model.size, c.mixer["name"], c.backbone.pattern, c.data.prepare["source"]) == (
        "small", "kdn_diag", "recurrent", "embedded")
    assert (c.mixer["mu"], c.mixer["noise"], c.trainer.device, c.trainer.precision) == ("dk", "learned", "auto", "auto")
    assert c.data.auto_prepare and c.trainer.export and c.logging.wandb.mode == "offline"
    assert c.run_dir == "runs/small_recurrent_kdn_diag"
    o = c.optim
    assert (o.lr, o.betas, o.weight_decay, o.grad_clip, o.warmup_frac, o.min_lr_ratio) == (
        4e-4, [0.9, 0.95], 0.1, 1.0, 0.01, 0.1)


@pytest.mark.parametrize("group,option", [(g, p.stem) for g in GROUPS if g != "mixer"
                                          for p in sorted((CONF / g).glob("*.yaml"))])
def test_every_group_option_composes(group: str, option: str) -> None:
    overrides = [f"{group}={option}"]
    if (group, option) in (("data", "fineweb_edu"), ("data", "embedded_long")):
        overrides.append("trainer=paper_50b")  # the demo's 1024-token batch holds no 2K-4K-token window
    run_of(overrides)
    if group != "trainer":  # every schema key is in the file, so that any of them can be overridden without a "+"
        assert set(OmegaConf.load(CONF / group / f"{option}.yaml")) == {f.name for f in fields(type(getattr(
            cfg_of(overrides), group)))}


def test_trainer_presets_hold_only_what_differs_from_the_schema() -> None:
    from trainer.config import TrainerConfig

    defaults = TrainerConfig()
    for path in sorted((CONF / "trainer").glob("*.yaml")):
        for key, value in OmegaConf.to_container(OmegaConf.load(path)).items():
            if key != "defaults":
                assert getattr(defaults, key) != value, f"{path.name}: {key}={value!r} is the schema's default"


@pytest.mark.parametrize("mixer", sorted(MIXERS))
def test_every_mixer_is_a_group_option_with_its_config_as_keys(mixer: str) -> None:
    """The group ``mixer`` is the registry: each option's keys are its name and its config's fields, at their
    defaults, so any of them can be overridden without a "+"."""
    c = run_of([f"mixer={mixer}"])
    assert c.mixer == {"name": mixer, **asdict(MIXERS[mixer].config())}
    assert build_model_config(c, 32000).mixer == mixer


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_paper_preset_composes(name: str) -> None:
    c = cfg_of([f"experiment={name}"])
    assert c.name == name and c.run_dir == f"runs/{name}"
    size = "1.3b" if "1.3b" in name else "750m"
    assert c.model.size == size
    assert c.trainer.token_budget == (100 if size == "1.3b" else 50) * 10**9
    assert (c.trainer.global_batch_tokens, c.data.seq_len, c.data.seed) == (524_288, 4096, 0)
    assert c.data.prepare["source"] == "hub" and c.data.prepare["dataset"] == "HuggingFaceFW/fineweb-edu"
    assert c.backbone.pattern == ("hybrid_swa" if name.startswith("hybrid") else "recurrent")
    mc = build_model_config(c, 32000)
    assert mc.num_layers == (18 if size == "1.3b" else 16) and mc.vocab_size == 32000 and mc.window == 2048
    options = mc.mixer_options
    if name.startswith("table4_mu_"):
        assert mc.mixer == "kdn_diag" and options.mu == name.removeprefix("table4_mu_")
    if name.startswith("table5_"):
        assert options.mu == "1" and options.noise == name.removeprefix("table5_")
    b = derive_budget(c, world_size=8)
    assert b.grad_accum * 8 * c.trainer.micro_batch_size * 4096 == 524_288
    assert b.warmup_steps == -(-b.total_steps // 100)  # 1% of the budget, rounded up


@pytest.mark.parametrize("name", GPU_CHECKS)
def test_gpu_check_presets_compose(name: str) -> None:
    c = cfg_of([f"experiment={name}"])
    assert c.name == name and c.data.auto_prepare and c.data.prepare["source"] == "embedded"
    b = derive_budget(c, world_size=1)
    if name == "gpu_throughput_750m_paper_batch":  # the paper's 0.5M-token batch: fewer steps, each 8x larger
        assert (b.tokens_per_step, b.grad_accum) == (524_288, 16) and b.total_steps >= 10
    else:
        assert b.total_steps >= 30
    if name == "gpu_parity_100m":  # the same global batch on one and on two GPUs
        assert (derive_budget(c, 1).grad_accum, derive_budget(c, 2).grad_accum) == (2, 1)
    if name == "gpu_throughput_750m":  # three mixers side by side through a multirun
        for mixer in ("kdn_diag", "kdn_iso", "kda"):
            assert build_model_config(cfg_of([f"experiment={name}", f"mixer={mixer}"]), 32000).mixer == mixer


def test_presets_cover_the_paper_rows() -> None:
    rows = {f"table1_750m_{m}" for m in ("kdn_diag", "kdn_iso", "kda", "mamba3_mimo")}
    rows |= {f"table1_1.3b_{m}" for m in ("kdn_diag", "kdn_iso", "kda", "mamba3_mimo", "transformer_swa")}
    rows |= {f"hybrid_1.3b_{m}" for m in ("kdn_diag", "kdn_iso", "kda")}
    rows |= {f"table4_mu_{m}" for m in ("1", "sqrt", "dk", "4dk", "learned")}
    rows |= {f"table5_{m}" for m in ("learned", "fixed_r", "fixed_r_omega")}
    assert rows <= set(EXPERIMENTS)


def test_ablations_are_plain_overrides() -> None:
    c = cfg_of(["mixer.mu=1", "mixer.noise=fixed_r"])
    assert build_model_config(c, 32000).mixer_kwargs == {"mu": "1", "noise": "fixed_r"}  # what differs from defaults
    assert build_model_config(cfg_of(["mixer.mu=96.5"]), 32000).mixer_kwargs["mu"] == 96.5
    assert build_model_config(cfg_of(["mixer.mu=learned"]), 32000).mixer_kwargs["mu"] == "learned"
    assert build_model_config(cfg_of(["mixer=kdn_iso", "mixer.precision=fp32"]), 32000).mixer_kwargs == {
        "precision": "fp32"}
    c = cfg_of(["mixer=attn", "backbone.window=64"])  # the attention mixer's window is the backbone's
    mc = build_model_config(c, 32000)
    assert (mc.mixer_kwargs, mc.window) == ({}, 64)
    assert build_model_config(cfg_of(["mixer=attn"]), 32000).window == 256  # the size table's


def test_kernel_settings_reach_every_mixer_as_arguments() -> None:
    """``trainer.recompute_states`` becomes the model config's field (no module global), ``model.overrides`` sets
    ``fused``, and the mixer's options the Diagonal memory route; every mixer built from the config
    holds them."""
    from models import build_model

    c = cfg_of(["trainer.recompute_states=true", "+model.overrides.fused=false", "mixer.memory=dplr",
                "mixer.chunk_size=32", "+model.overrides.num_layers=2"])
    mc = build_model_config(c, 512)
    assert (mc.recompute_states, mc.fused, mc.mixer_kwargs["memory"], mc.mixer_kwargs["chunk_size"]) == (
        True, False, "dplr", 32)
    mixer = build_model(mc).model.layers[0].mixer
    assert (mixer.recompute_states, mixer.fused, mixer.memory, mixer.chunk_size) == (True, False, "dplr", 32)
    assert build_model_config(cfg_of(["mixer=kda"]), 512).recompute_states is False
    with pytest.raises(ConfigError, match="mixer.memory: must be one of"):
        cfg_of(["mixer.memory=bogus"])


@pytest.mark.parametrize("overrides,prefix", [
    (["+trainer.max_stepz=3"], "trainer.max_stepz: unknown key (did you mean 'max_steps'?)"),
    (["trainer.max_steps=abc"], "trainer.max_steps: Value 'abc'"),
    (["model.size=2b"], "model.size: '2b' is not one of"),
    (["mixer.mu=big"], "mixer.mu: must be one of"),
    (["mixer=kda", "+mixer.mu=1"], "mixer.mu: mixer 'kda' does not take 'mu'; the mixers taking it: kdn_diag, kdn_iso"),
    (["mixer.noise=loud"], "mixer.noise: must be one of"),
    (["+mixer.kwargs.precision=fp32"], "mixer.kwargs.precision: use mixer.precision=fp32"),
    (["+mixer.preciison=fp32"], "mixer.preciison: mixer 'kdn_diag' does not take 'preciison' (did you mean "
                                "'precision'?)"),
    (["+model.overrides.num_layerz=6"], "model.overrides.num_layerz: unknown key (did you mean 'num_layers'?)"),
    (["+model.overrides.window=64"], "model.overrides.window: use backbone.window=<tokens>"),
    (["backbone.pattern=RSX"], "model (size small, mixer kdn_diag, pattern RSX): pattern 'RSX'"),
    (["trainer.distributed=zero"], "trainer.distributed: 'zero' is not one of"),
    (["trainer.global_batch_tokens=1000"], "trainer.global_batch_tokens: 1000 is not a multiple"),
    (["trainer.preempt_signals=[SIGFOO]"], "trainer.preempt_signals[0]: unknown signal"),
    (["+data.prepare.tokeniser=x"], "data.prepare.tokeniser: unknown key (did you mean 'tokenizer'?)"),
    (["data.prepare.max_tokens=50B"], "data.prepare.max_tokens: '50B' is not an int"),
    (["data.auto_prepare=false"], "data.prepare.out_dir: must name"),
    (["optim.betas=[0.9]"], "optim.betas: must be two numbers"),
    (["optim.lr=0"], "optim.lr: must be > 0"),
    (["logging.wandb.mode=cloud"], "logging.wandb.mode: 'cloud' is not one of"),
])
def test_bad_values_fail_in_one_line_naming_the_key(overrides: list[str], prefix: str) -> None:
    with pytest.raises(ConfigError) as e:
        run_of(overrides)
    msg = str(e.value)
    assert msg.startswith(prefix) and "\n" not in msg, msg


def test_slurm_launcher_config_composes() -> None:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        c = compose("config", overrides=["hydra/launcher=slurm"], return_hydra_config=True)
    launcher = c.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.tasks_per_node, launcher.gpus_per_node, launcher.signal_delay_s) == (8, 8, 180)
    assert launcher.max_num_timeout > 0


def _cli(*args: str) -> subprocess.CompletedProcess:
    return commands().run(["train.py", *args], command_env(WANDB_MODE="disabled"), ROOT, timeout_s(300))


def test_cli_rejects_bad_values_in_one_line_and_leaves_no_run_directory(tmp_path: Path) -> None:
    bad = _cli("mixer.mu=big", f"runs_root={tmp_path}")
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1].startswith("config error: mixer.mu: must be one of")
    assert list(tmp_path.iterdir()) == []  # no directory holding only .hydra/ and an empty train.log
    out = _cli("trainer.max_step=5", f"runs_root={tmp_path}")  # the plain form too (more: the test below)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == ("config error: trainer.max_step: unknown key (did you mean "
                                                   "'max_steps'?)")
    assert list(tmp_path.iterdir()) == []


def test_plain_override_keys_are_checked_against_the_schema() -> None:
    from trainer.config import check_override_keys

    check_override_keys(["-m", "model=toy", "experiment=table4_mu_1", "mixer.mu=1,dk", "hydra.run.dir=x",
                         "hydra/launcher=slurm", "model.overrides.num_layers=2", "data.prepare.max_tokens=9",
                         "+anything.new=1", "~seed", "logging.wandb.mode=disabled"])
    for arg, msg in (("mixr=kda", "mixr: unknown key (did you mean 'mixer'?)"),
                     ("data.prepare.tokeniser=x", "data.prepare.tokeniser: unknown key (did you mean 'tokenizer'?)"),
                     ("logging.wandb.mod=x", "logging.wandb.mod: unknown key (did you mean 'mode'?)"),
                     ("trainer.zzz=1", "trainer.zzz: unknown key (valid keys: "),
                     ("mixer.preciison=fp32", "mixer.preciison: unknown key (did you mean 'precision'?)"),
                     ("+mixer.kwargs.precision=fp32", "mixer.kwargs.precision: use mixer.precision=fp32"),
                     ("+mixer.kwargs.window=null", "mixer.kwargs.window: use backbone.window=null")):
        with pytest.raises(ConfigError) as e:
            check_override_keys(["model=toy", arg])
        assert str(e.value).startswith(msg), str(e.value)
    with pytest.raises(ConfigError) as e:  # what train.py prints after "config error: "
        check_override_keys(["optim.lrr=1e-3"])
    assert str(e.value) == "optim.lrr: unknown key (did you mean 'lr'?)"
    for args in (["mixer=kda", "mixer.precision=fp32"], ["experiment=table1_750m_kda", "mixer.precision=fp32"]):
        with pytest.raises(ConfigError) as e:  # the mixer that the command line composes does not take it
            check_override_keys(args)
        assert str(e.value) == ("mixer.precision: mixer 'kda' does not take 'precision'; the mixers taking it: "
                                "kdn_diag, kdn_iso")
    check_override_keys(["mixer=kdn_iso", "mixer.precision=fp32"])


def test_multirun_sweep_gives_each_job_its_run_dir(tmp_path: Path) -> None:
    shards = tmp_path / "shards"
    out = _cli("-m", "name=toy_recurrent_kdn_diag", "model=toy", "logging=quiet", f"runs_root={tmp_path}",
               "data.seq_len=64",
               "trainer.micro_batch_size=2", "trainer.global_batch_tokens=128", "trainer.max_steps=1",
               "trainer.eval_every=0", "trainer.eval_batches=1", "trainer.export=false",
               f"data.prepare.out_dir={shards}", "data.prepare.max_tokens=20000", "mixer.mu=1,dk")
    assert out.returncode == 0, out.stderr[-3000:]
    for num, mu in enumerate(("1", "dk")):
        run = tmp_path / "toy_recurrent_kdn_diag" / str(num)
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        (record,) = [r for r in rows if "loss" in r]
        assert record["step"] == 1
        assert (run / "checkpoints" / "step_000000001" / "train_state.json").is_file()
        assert OmegaConf.load(run / "config.yaml").mixer.mu == mu
