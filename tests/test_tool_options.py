"""One way to take options: ``common.options`` reads the ``key=value`` options of data.prepare, eval.mqar and
slurm.sweep into their dataclasses, and checks evaluate.py's composed config against its typed schema. A typo, a
wrong-typed value or a boolean spelled other than ``true``/``false`` is one line naming the key and the fix, through
the real commands too."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest
from conftest import timeout_s
from forkserver import Forked, command_env, commands
from omegaconf import OmegaConf

from common.options import OptionError, did_you_mean, from_dict, parse_options, parse_value

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Inner:
    partition: str | None = None
    nodes: int = 1


@dataclass
class Options:
    seeds: int = 1
    force: bool = False
    lrs: list[float] = field(default_factory=lambda: [1e-3])
    mode: Literal["fast", "exact"] = "fast"
    batch: int | Literal["auto"] = "auto"
    rate: float = field(default=0.5, metadata={"help": "a share of the budget"})
    inner: Inner = field(default_factory=Inner)


def test_values_are_read_into_their_fields_types() -> None:
    values, rest = parse_options(Options, ["seeds=2K", "force=false", "lrs=3e-4,1", "mode=exact", "batch=16",
                                           "+inner.nodes=1e1", "--rate=1", "inner.partition=null", "seeds=50B"])
    assert values == {"seeds": 50_000_000_000, "force": False, "lrs": [3e-4, 1.0], "mode": "exact", "batch": 16,
                      "inner": {"nodes": 10, "partition": None}, "rate": 1.0}
    assert rest == [] and parse_options(Options, ["lrs=", "force=true"])[0] == {"lrs": [], "force": True}
    assert parse_value("n", int, "-3") == -3 and parse_value("n", int, "1_000") == 1000
    assert parse_value("n", int, "1.5K") == 1500 and parse_value("b", int | Literal["auto"], "auto") == "auto"
    values, rest = parse_options(Options, ["x.y=1", "seeds=3", "hydra/launcher=slurm"],
                                 passthrough=lambda key: key.startswith("x.") or "/" in key)
    assert values == {"seeds": 3} and rest == ["x.y=1", "hydra/launcher=slurm"]


@pytest.mark.parametrize(("arg", "message"), [
    *((f"force={word}", f"force='{word}' is not a boolean: write force=true or force=false")
      for word in ("yes", "True", "TRUE", "1", "0", "on", "no", "")),
    ("sedds=3", "sedds: unknown key (did you mean 'seeds'?)"),
    ("zzz=3", "zzz: unknown key (valid keys: batch, force, inner, lrs, mode, rate, seeds)"),
    ("inner.partiton=gpu", "inner.partiton: unknown key (did you mean 'partition'?)"),
    ("inner=3", "inner: is a group of options; set one of them, e.g. inner.partition=..."),
    ("seeds.x=1", "seeds.x: seeds is a single value, not a group of options"),
    ("seeds=1.5", "seeds='1.5' is not an int (e.g. 1000, 1e9, 50B)"),
    ("seeds=lots", "seeds='lots' is not an int (e.g. 1000, 1e9, 50B)"),
    ("seeds=1e", "seeds='1e' is not an int (e.g. 1000, 1e9, 50B)"),
    ("lrs=3e-4,fast", "lrs='3e-4,fast' is not a comma-separated list of float"),
    ("mode=exakt", "mode='exakt' is not one of 'fast', 'exact' (did you mean 'exact'?)"),
    ("batch=big", "batch='big' is not an int or one of 'auto'"),
    ("rate=half", "rate='half' is not a float (e.g. 0.5, 3e-4) (a share of the budget)"),
    ("seeds", "'seeds': arguments are key=value (e.g. seeds=1)"),
])
def test_a_bad_argument_is_one_line_naming_it_and_the_fix(arg: str, message: str) -> None:
    with pytest.raises(OptionError) as err:
        parse_options(Options, [arg])
    assert str(err.value) == message


def test_the_did_you_mean_offers_the_other_programs_keys_too() -> None:
    with pytest.raises(OptionError, match=r"^traner: unknown key \(did you mean 'trainer'\?\)$"):
        parse_options(Options, ["traner.max_steps=3"], passthrough=lambda key: key.startswith("trainer."),
                      other_names=["trainer"])
    assert did_you_mean("a.widht", ["widths", "heights"]) == "a.widht: unknown key (did you mean 'widths'?)"


def test_a_mapping_is_checked_against_the_schema_without_conversions() -> None:
    assert from_dict(Options, {"seeds": 3, "lrs": [1, 2.5], "inner": {"nodes": 2}}) == \
        Options(seeds=3, lrs=[1.0, 2.5], inner=Inner(nodes=2))
    for data, message in (({"seeds": True}, "seeds: True is not an int"),
                          ({"force": "true"}, "force: 'true' is not a boolean (true or false)"),
                          ({"force": 1}, "force: 1 is not a boolean (true or false)"),
                          ({"lrs": "a"}, "lrs: 'a' is not a list of float"),
                          ({"lrs": [1, "x"]}, "lrs[1]: 'x' is not a float"),
                          ({"inner": {"partition": 123}}, "inner.partition: 123 is not a string or null"),
                          ({"inner": {"nods": 1}}, "inner.nods: unknown key (did you mean 'nodes'?)"),
                          ({"mode": "exakt"}, "mode: 'exakt' is not one of 'fast', 'exact' (did you mean 'exact'?)"),
                          ({"rate": "x"}, "rate: 'x' is not a float (a share of the budget)")):
        with pytest.raises(OptionError) as err:
            from_dict(Options, data)
        assert str(err.value) == message


def test_evaluate_schema_matches_its_documented_yaml() -> None:
    """conf/eval/config.yaml documents every key of eval.config.EvalConfig at the schema's own default."""
    from eval.config import EvalConfig

    data = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "eval" / "config.yaml"))
    data = {k: v for k, v in data.items() if k not in ("defaults", "hydra")}

    def keys(d: dict, prefix: str = "") -> set[str]:
        return {f"{prefix}{k}" for k in d} | {x for k, v in d.items() if isinstance(v, dict)
                                             for x in keys(v, f"{prefix}{k}.")}

    assert keys(data) == keys(dataclasses.asdict(EvalConfig()))
    assert from_dict(EvalConfig, data) == EvalConfig()


@pytest.mark.parametrize(("override", "message"), [
    ("ruler.haystack=123", "ruler.haystack: 123 is not a string (kjv, essays, hub:<dataset>, or a .json or text "
                           "file)"),
    ("ruler.haystack=true", "ruler.haystack: True is not a string"),
    ("ruler.haystack=[a,b]", "ruler.haystack: ['a', 'b'] is not a string"),
    ("dtype=bogus", "dtype: 'bogus' is not one of 'auto', 'bfloat16', 'float32', 'float16'"),
    ("batch_size=big", "batch_size: 'big' is not an int or one of 'auto'"),
    ("overwrite=maybe", "overwrite: 'maybe' is not a boolean (true or false)"),
    ("ruler.lengths=[1k]", "ruler.lengths[0]: '1k' is not an int"),
    ("lm.limit=all", "lm.limit: 'all' is not an int or null"),
])
def test_evaluate_refuses_a_wrong_typed_value_in_one_line(override: str, message: str) -> None:
    import evaluate

    with pytest.raises(ValueError) as err:
        evaluate.compose(["model=x", override])
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


def test_a_preset_must_name_one_of_its_files() -> None:
    import evaluate

    with pytest.raises(ValueError, match=r"^preset='quik' is not one of paper, quick \(did you mean 'quick'\?\)$"):
        evaluate.compose(["model=x", "preset=quik"])
    with pytest.raises(ValueError, match=r"^preset='fast' is not one of paper, quick$"):
        evaluate.check_override_keys(["-m", "preset=quick,fast", "model=x"])
    evaluate.check_override_keys(["-m", "preset=quick,paper", "model=runs/a,runs/b", "hydra/launcher=slurm"])
    assert evaluate.compose(["model=x", "preset=quick"]).ruler.samples_per_cell == 4


def test_an_empty_hub_haystack_is_refused_in_one_line() -> None:
    import evaluate
    from eval.ruler_suite import load_ruler_haystack

    with pytest.raises(ValueError, match=r"^ruler.haystack=hub:: the hub: prefix names no dataset; write "
                                         r"hub:<owner>/<dataset>"):
        load_ruler_haystack(evaluate.compose(["model=x", "ruler.haystack=hub:"]).ruler)


def _run(args: list[str]) -> Forked:
    return commands().start(args, command_env(), ROOT)


def test_every_tool_refuses_typos_and_bad_values_in_one_line_through_its_command(tmp_path: Path) -> None:
    """Each command started as a user starts it; they run side by side (each waits only on its own exit)."""
    from eval_fixtures import export_toy_run

    from trainer.checkpoint import EXPORT_MANIFEST, write_manifest

    run = export_toy_run(tmp_path / "run", seq_len=64)
    # the manifest train.py's export writes: the evaluation then loads it without a word about unverified files
    write_manifest(run / "hf", EXPORT_MANIFEST, {"step": 10, "tokens": 40960, "checkpoint": None})
    cases = {
        ("data.prepare", "max_tokn"): (["-m", "data.prepare", "max_tokn=5"],
                                       "error: max_tokn: unknown key (did you mean 'max_tokens'?)"),
        ("data.prepare", "bool"): (["-m", "data.prepare", "add_bos=yes"],
                                   "error: add_bos='yes' is not a boolean: write add_bos=true or add_bos=false"),
        ("eval.mqar", "widht"): (["-m", "eval.mqar", "preset=cpu", "widht=64"],
                                 "eval.mqar: widht: unknown key (did you mean 'widths'?)"),
        ("slurm.sweep", "bool"): (["-m", "slurm.sweep", "table4_mu", "--dry-run", "resubmit_unknown=True"],
                                  "error: resubmit_unknown='True' is not a boolean: write resubmit_unknown=true or "
                                  "resubmit_unknown=false"),
        ("slurm.sweep", "typo"): (["-m", "slurm.sweep", "table4_mu", "--dry-run", "resubmit_unknwn=true"],
                                  "error: resubmit_unknwn: unknown key (did you mean 'resubmit_unknown'?)"),
        ("evaluate", "first"): (["evaluate.py", "modle=runs/x", "suites=[ppl]"],
                                "evaluate: modle: unknown key (did you mean 'model'?)"),
        ("evaluate", "haystack"): (["evaluate.py", f"model={run}", "ruler.haystack=[a,b]"],
                                   "evaluate: ruler.haystack: ['a', 'b'] is not a string (kjv, essays, "
                                   "hub:<dataset>, or a .json or text file)"),
        ("evaluate", "dtype"): (["evaluate.py", f"model={run}", "dtype=bogus"],
                                "evaluate: dtype: 'bogus' is not one of 'auto', 'bfloat16', 'float32', 'float16'"),
        ("evaluate", "hub"): (["evaluate.py", f"model={run}", "suites=[ruler]", "ruler.haystack=hub:"],
                              "evaluate: ruler.haystack=hub:: the hub: prefix names no dataset; write "
                              "hub:<owner>/<dataset> (e.g. hub:baber/paul_graham_essays)"),
    }
    procs = {name: _run(args) for name, (args, _) in cases.items()}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=timeout_s(300))
        assert proc.returncode != 0, (name, out, err)
        assert err.strip() == cases[name][1], (name, err)
