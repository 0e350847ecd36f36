"""MQAR benchmark: the generator's invariants and seeding, the answer-only metric, the grid's bookkeeping, and
that a tiny attention model learns the task on the CPU."""
from __future__ import annotations

import copy
import json
from dataclasses import asdict
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import timeout_s

from eval.mqar import (
    ALL_MIXERS,
    GEN_BLOCK,
    IGNORE,
    MixerChoice,
    MQARSetting,
    MQARSplit,
    accuracy,
    answer_logits,
    build_jobs,
    flatten,
    generate,
    load_results,
    model_config,
    parse_overrides,
    run_grid,
    state_elements,
    summarize,
    table,
    train_job,
    write_report,
)
from eval.mqar.data import block_seed
from eval.mqar.run import (
    cost_model,
    expected_wall,
    git_commit,
    groups,
    header,
    measured_costs,
    queue,
    runs_of,
    time_folders,
)
from eval.mqar.step import TrainStep
from eval.mqar.train import JobRun, train_together
from models import build_model
from trainer.optim import build_optimizer, build_scheduler


@pytest.fixture
def one_thread():
    """Tiny models run faster on one thread than on cores other jobs share."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("seq_len,pairs", [(64, 4), (512, 64), (24, 6)])
def test_generator_invariants(seq_len: int, pairs: int) -> None:
    s = MQARSetting(seq_len, pairs, vocab_size=8192 if seq_len > 24 else 32)
    x, y = generate(s, 200, seed=3)
    assert x.shape == y.shape == (200, seq_len) and x.dtype == y.dtype == torch.int64
    half = s.vocab_size // 2
    keys, values = x[:, 0:2 * pairs:2], x[:, 1:2 * pairs:2]
    assert ((keys >= 1) & (keys < half)).all() and ((values >= half) & (values < s.vocab_size)).all()
    assert all(len(set(row.tolist())) == pairs for row in keys)  # keys unique within a sequence
    assert (y[:, :2 * pairs] == IGNORE).all()  # no label inside the context
    answers = y != IGNORE
    assert (answers.sum(1) == pairs).all()  # one query per key
    for i in range(200):  # every query's key is in the prefix, and its label is the value stored with it
        pos = answers[i].nonzero().flatten()
        assert ((pos - 2 * pairs) % 2 == 0).all()
        table_ = dict(zip(keys[i].tolist(), values[i].tolist()))
        assert sorted(x[i, pos].tolist()) == sorted(table_)
        assert all(table_[x[i, p].item()] == y[i, p].item() for p in pos)
    assert ((x >= 0) & (x < s.vocab_size)).all()


def test_power_law_gaps() -> None:
    """Queries crowd right after the context (power_a = 0.01) but reach its far end; power_a = 1 spreads them."""
    s = MQARSetting(512, 16)
    _, y = generate(s, 400, seed=0)
    slot = ((y != IGNORE).nonzero()[:, 1] - s.context) // 2
    space = (512 - s.context) // 2
    assert (slot < space // 10).float().mean() > 0.3 and slot.max() > space // 2
    _, yu = generate(MQARSetting(512, 16, power_a=1.0), 400, seed=0)
    slot_u = ((yu != IGNORE).nonzero()[:, 1] - s.context) // 2
    assert (slot_u < space // 10).float().mean() < 0.2


def test_seeding_is_deterministic() -> None:
    """A split is fixed by its seed, name and setting, not by the batch that reads it; epochs reorder it."""
    s = MQARSetting(128, 8)
    a, b = MQARSplit(s, "train", 300, 32, seed=1), MQARSplit(s, "train", 300, 7, seed=1)
    for ta, tb in zip(a.tensors(), b.tensors()):
        assert torch.equal(ta, tb)
    x = torch.cat([x for x, _, _ in a.batches(order=a.order(2))])
    assert torch.equal(x, torch.cat([x for x, _, _ in b.batches(order=b.order(2))]))
    assert torch.equal(x, a.tensors()[0][a.order(2)].long()) and not torch.equal(a.order(1), a.order(2))
    assert torch.equal(a.labels()[:GEN_BLOCK], generate(s, GEN_BLOCK, block_seed(1, "train", s, 0))[1])
    other = MQARSplit(s, "train", 300, 32, seed=2).tensors()[0]
    test = MQARSplit(s, "test", 300, 32, seed=1).tensors()[0]
    assert not torch.equal(a.tensors()[0], other) and not torch.equal(a.tensors()[0], test)
    assert len(a) == 10 and [len(x) for x, _, _ in a.batches()][-1] == 300 - 9 * 32


@pytest.mark.parametrize("bad,match", [((63, 4), "even"), ((64, 17), "4 \\* pairs"), ((64, 4, 64), "vocab_size")])
def test_setting_errors(bad: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MQARSetting(*bad)


class Oracle(torch.nn.Module):
    """A stand-in model that knows a split's answers: at each answer position its logits peak at the value, at
    every other position at a wrong "next token"; ``miss`` answers (row, position) are predicted wrong."""

    def __init__(self, split: MQARSplit, miss: tuple[int, int] | None = None) -> None:
        super().__init__()
        inputs, labels = split.tensors()[0].long(), split.labels()
        if miss is not None:
            labels[miss] = (labels[miss] + 1) % split.setting.vocab_size
        self.answers = {tuple(x.tolist()): y for x, y in zip(inputs, labels)}
        self.vocab, self.lm_head = split.setting.vocab_size, torch.nn.Identity()

    def model(self, inputs: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        y = torch.stack([self.answers[tuple(x.tolist())] for x in inputs])
        return F.one_hot(torch.where(y == IGNORE, (inputs + 1) % self.vocab, y), self.vocab).float(), None, None


def test_metric_counts_only_answer_positions() -> None:
    split = MQARSplit(MQARSetting(64, 4, vocab_size=128), "test", 40, 16)
    assert accuracy(Oracle(split), split, torch.device("cpu")) == 1.0
    row, pos = 3, int(split.tensors()[1][3, 2])
    assert accuracy(Oracle(split, miss=(row, pos)), split, torch.device("cpu")) == 1 - 1 / 160
    assert accuracy(Oracle(split, miss=(row, pos - 1)), split, torch.device("cpu")) == 1.0  # not an answer


def test_answer_logits_match_the_full_model(one_thread) -> None:
    torch.manual_seed(0)
    cfg = model_config(MixerChoice.parse("kda"), 64, 32, 128)
    model = build_model(cfg).eval()
    split = MQARSplit(MQARSetting(64, 4, vocab_size=128), "train", 4, 4, seed=1)
    x, positions, values = next(split.batches())
    with torch.no_grad():
        sel = answer_logits(model, x, positions)
        full = model(x).logits
    y = split.labels()
    ref = full[y != IGNORE]
    assert torch.equal(values.flatten(), y[y != IGNORE])
    assert (sel - ref).norm() / ref.norm() < 1e-5


def test_state_matched_across_mixers() -> None:
    """At every width the matrix-state mixers and Mamba-3 carry heads x head_dim^2 per layer (KDN: plus its
    precisions); attention's KV cache grows with the sequence."""
    for width in (64, 128, 256):
        base = 2 * (width // 64) * 64 * 64
        for name in ("kda", "gdn", "deltanet", "gdn2", "mamba3_siso", "mamba3_mimo"):
            assert state_elements(model_config(MixerChoice.parse(name), width, 64, 8192), 64) == (base, True)
        diag = state_elements(model_config(MixerChoice.parse("kdn_diag/mu=1"), width, 64, 8192), 64)
        assert diag == (base + 2 * width, True)
        assert state_elements(model_config(MixerChoice.parse("attn"), width, 64, 8192), 512) == (2 * 2 * 512 * width,
                                                                                                 False)


def test_overrides_and_errors() -> None:
    cfg, explicit = parse_overrides(["mixers=kdn_diag,kda/output_gate=false", "widths=64", "seeds=0,1",
                                     "preset=smoke", "out=/tmp/x"])
    assert cfg.mixers == ["kdn_diag", "kda/output_gate=false"] and cfg.widths == [64] and cfg.seeds == [0, 1]
    assert cfg.max_train_tokens == 262_144 and cfg.epochs == 1 and cfg.results == "/tmp/x/mqar.json"
    assert set(explicit) == {"mixers", "widths", "seeds", "preset", "out"}
    assert MixerChoice.parse("kdn_diag/mu=1").kwargs == (("mu", "1"),)
    assert dict(MixerChoice.parse("kda/output_gate=false").kwargs) == {"output_gate": False}
    for argv, match in ((["widht=64"], "widht: unknown key .did you mean 'widths'"), (["mixers=kdx"], "unknown mixer"),
                        (["widths"], "key=value"),
                        (["mixers=kda/mu=1"], "does not take"), (["settings=64-4"], "SEQLENxPAIRS"),
                        (["preset=big"], "unknown preset"), (["epochs=0"], "epochs=0 is out of range"),
                        (["widths=a"], "widths='a' is not a comma-separated list of int")):
        with pytest.raises(ValueError, match=match):
            parse_overrides(argv)
    with pytest.raises(ValueError, match="multiple of head_dim"):
        model_config(MixerChoice.parse("kda"), 96, 64, 8192)


def test_grid_budget_and_summary(tmp_path) -> None:
    cfg, _ = parse_overrides(["mixers=kdn_diag,attn", "widths=64,128", "settings=64x4,2048x256", "lrs=1e-3,1e-2",
                              "seeds=0,1", "test_settings=1024x128,64x4", "batch_tokens=65536",
                              "max_train_tokens=5242880", f"out={tmp_path}", "preset=full"])
    jobs = build_jobs(cfg)
    assert len(jobs) == 2 * 2 * 2 * 2 and len({j.name for j in jobs}) == len(jobs)
    assert jobs[0].width == 128 and [s.name for s in jobs[0].settings] == ["64x4", "2048x256", "1024x128"]
    budget = jobs[0].budget
    assert budget.train_mix == (("64x4", 81_920), ("2048x256", 2_560))  # 5,242,880 tokens each, whole batches
    assert budget.batch_size(MQARSetting(64, 4)) == 1024 and budget.batch_size(MQARSetting(2048, 256)) == 32
    assert budget.steps_per_epoch() == 160 and budget.tokens() == cfg.epochs * 2 * 5_242_880
    odd, _ = parse_overrides(["settings=64x4,96x8", "max_train_tokens=10000", "batch_tokens=640", "preset=full"])
    assert odd.budget().train_mix == (("64x4", 150), ("96x8", 102))  # rounded down to batches of 10 and 6
    records = []
    for j in jobs:  # a validation accuracy that prefers lr 1e-2 for kdn_diag and 1e-3 for attn
        good = (j.lr == 1e-2) == (j.mixer.name == "kdn_diag")
        acc = 0.5 + 0.3 * good + 0.01 * j.seed + j.width / 1e4
        job = {"mixer": j.mixer.label, "width": j.width, "lr": j.lr, "seed": j.seed, "diverged": False, "params": 1,
               "curve": [], "records": [{"setting": s.name, "valid_acc": acc, "test_acc": acc - 0.02, "state": 8192,
                                         "state_recurrent": j.mixer.name != "attn"} for s in j.settings]}
        records += flatten(job)
    assert len(records) == 48 and records[0]["mixer"] == jobs[0].mixer.label and "curve" not in records[0]
    rows = summarize(records, cfg)
    assert len(rows) == 12 and rows[0]["setting"] == "64x4" and rows[0]["mixer"] == "kdn_diag"
    assert [r["setting"] for r in rows[::4]] == ["64x4", "2048x256", "1024x128"]
    by = {(r["setting"], r["mixer"], r["width"]): r for r in rows}
    r = by[("64x4", "kdn_diag", 64)]
    assert r["best_lr"] == 1e-2 and r["seeds"] == [0, 1]
    assert abs(r["test_acc_mean"] - (0.8 + 0.005 + 0.0064 - 0.02)) < 1e-9
    assert abs(r["test_acc_std"] - 0.01 / 2 ** 0.5) < 1e-9
    assert by[("2048x256", "attn", 128)]["best_lr"] == 1e-3
    data = {**header(cfg, 1.0, git_commit()), "rows": rows}
    path = tmp_path / "mqar.json"
    path.write_text(json.dumps(data))
    md, png = write_report(load_results(path), path)
    assert "| kdn_diag |" in md.read_text() and "79.1 ± 0.7" in table(data) and png.stat().st_size > 1000
    assert "Best rate: 0.001 in 6, 0.01 in 6 of 12 cells; 12 at an end of the sweep" in table(data)
    # a grid still filling: attention at width 64 has seed 0 alone, so its cells show no spread and say n
    part = summarize([r for r in records if (r["mixer"], r["width"], r["seed"]) != ("attn", 64, 1)], cfg)
    assert "| attn | 78.6 (n=1) | 79.8 ± 0.7 |" in table({**data, "rows": part})
    assert data["config"]["seeds"] == [0, 1] and data["versions"]["torch"] == torch.__version__
    import fla

    assert data["versions"]["fla"] == fla.__version__  # read from the distribution, without importing fla
    empty = tmp_path / "none.json"  # a grid whose every job failed still writes its (empty) table
    empty.write_text(json.dumps({**data, "rows": []}))
    md, png = write_report(load_results(empty), empty)
    assert png is None and md.exists() and not empty.with_suffix(".png").exists()


def test_a_named_commit_stands_in_for_a_copied_checkouts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KDN_GIT_COMMIT", raising=False)
    own = git_commit()
    monkeypatch.setenv("KDN_GIT_COMMIT", "0123abc")
    assert git_commit() == "0123abc" != own


def test_attention_loss_decreases(one_thread) -> None:
    """Sixty steps of the training code's optimiser and schedule on a small-vocabulary MQAR lower the loss."""
    setting = MQARSetting(32, 4, vocab_size=48)
    torch.manual_seed(0)
    model = build_model(model_config(MixerChoice.parse("attn"), 64, 32, setting.vocab_size))
    opt = build_optimizer(model, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
    sched = build_scheduler(opt, warmup_steps=6, total_steps=60, min_ratio=0.1)
    split = MQARSplit(setting, "train", 32 * 60, 32)
    losses = []
    for inputs, positions, values in split.batches(order=split.order(0)):
        loss = F.cross_entropy(answer_logits(model, inputs, positions).float(), values.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert sum(losses[-10:]) < 0.85 * sum(losses[:10])


@pytest.mark.slow
def test_attention_learns_mqar(one_thread) -> None:
    """The benchmark's own training job takes a two-layer width-64 attention model past 90 % on a small-vocabulary
    MQAR (32 tokens, 4 pairs) on the CPU, and scores it on a longer test-only setting too."""
    cfg, _ = parse_overrides(["preset=cpu", "settings=32x4", "test_settings=40x4", "vocab_size=48", "head_dim=32",
                              "train_examples=12800", "batch_tokens=1024", "epochs=2", "lrs=3e-3"])
    result = train_job(MixerChoice.parse("attn"), 64, 3e-3, 0, cfg.budget(), cfg.scored_settings(),
                       torch.device("cpu"))
    assert result["steps"] == 2 * 12_800 // 32 and not result["diverged"] and len(result["curve"]) == 2
    assert [r["setting"] for r in result["records"]] == ["32x4", "40x4"]
    assert result["records"][0]["test_acc"] > 0.9, result["records"]
    assert result["curve"][1]["valid"]["32x4"] > 0.9


def test_groups_hold_one_mixer_and_width() -> None:
    """A group's jobs are stepped in turn, so a slow mixer must not set the pace of another's jobs."""
    cfg, _ = parse_overrides(["preset=cpu", "mixers=kda,attn", "widths=64,128", "lrs=1e-3,3e-3", "seeds=0,1"])
    tasks = groups(build_jobs(cfg), 3)
    assert [len(g) for g in tasks] == [3, 1] * 4
    assert all(len({(j.mixer, j.width) for j in g}) == 1 for g in tasks)
    assert [g[0].width for g in tasks] == [128] * 4 + [64] * 4
    assert sorted(j.name for g in tasks for j in g) == sorted(j.name for j in build_jobs(cfg))


def test_the_queue_starts_the_cells_measured_longest(tmp_path) -> None:
    """Stored jobs of other seeds time their cells; the longest cells start first and unmeasured cells are estimated
    from their width, so that the grid does not end on one slow group."""
    cfg, _ = parse_overrides(["preset=cpu", "mixers=kda,mamba3_mimo,attn", "widths=64,128", "seeds=1",
                              f"out={tmp_path}"])
    budget = json.loads(json.dumps(asdict(cfg.budget())))
    (tmp_path / "jobs").mkdir()

    def store(name: str, mixer: str, width: int, wall: float, **extra: Any) -> None:
        job = {"mixer": mixer, "width": width, "wall_s": wall, "identity": {"budget": budget}, "resumed_from": [],
               "device": "cpu", **extra}
        (tmp_path / "jobs" / f"{name}.json").write_text(json.dumps(job))

    store("m64", "mamba3_mimo", 64, 500.0)
    store("k128", "kda", 128, 100.0)
    store("a64", "attn", 64, 9000.0, resumed_from=[3])  # its time covers part of the job
    store("k64", "kda", 64, 9000.0, identity={"budget": {**budget, "epochs": 99}})  # another budget
    store("other", "attn", 128, 9000.0, device="NVIDIA H200")  # another device
    (tmp_path / "jobs" / "torn.json").write_text("{")
    costs = measured_costs(tmp_path, cfg.budget(), "cpu")
    assert costs == {("mamba3_mimo", 64): 500.0, ("kda", 128): 100.0}
    cost = cost_model(costs)
    jobs = queue(build_jobs(cfg), cost)
    # unmeasured: 600 s / 192 width units = 3.125 s each, so 400 s at width 128 and 200 s at width 64
    cells = list(dict.fromkeys((j.mixer.label, j.width) for j in jobs))
    assert cells == [("mamba3_mimo", 64), ("mamba3_mimo", 128), ("attn", 128), ("kda", 64), ("attn", 64),
                     ("kda", 128)]
    # one group a cell (its three rates) on two processes: 500, 200, 200 on one and 400, 400, 100 on the other
    assert expected_wall(groups(jobs, 3), cost, 2) == 900.0
    assert [(j.mixer.label, j.width) for j in queue(build_jobs(cfg), cost_model({}))] == [
        (j.mixer.label, j.width) for j in build_jobs(cfg)]  # nothing measured: by width, as built


def test_the_queue_takes_the_cells_out_lacks_from_other_folders(tmp_path, monkeypatch) -> None:
    """A new ``out`` on a device with stored times elsewhere (``times``, default the shipped H200 jobs) orders its
    queue by them; ``out``'s own time of a cell wins, and a file elsewhere must name its device."""
    cfg, _ = parse_overrides(["preset=cpu", "mixers=kda,attn", "widths=64", f"out={tmp_path / 'out'}",
                              f"times={tmp_path / 'h200'},missing"])
    budget = {"budget": json.loads(json.dumps(asdict(cfg.budget())))}
    for folder, name, mixer, wall, device in (("out", "k", "kda", 10.0, None), ("h200", "k", "kda", 99.0, "cpu"),
                                              ("h200", "a", "attn", 50.0, "cpu"), ("h200", "a2", "attn", 70.0, "cpu"),
                                              ("h200", "x", "attn", 900.0, None)):
        (tmp_path / folder / "jobs").mkdir(parents=True, exist_ok=True)
        job = {"mixer": mixer, "width": 64, "wall_s": wall, "identity": budget, **({"device": device} if device
                                                                                     else {})}
        (tmp_path / folder / "jobs" / f"{name}.json").write_text(json.dumps(job))
    assert time_folders(cfg) == (tmp_path / "h200",)  # a folder without jobs/ is skipped
    assert measured_costs(tmp_path / "out", cfg.budget(), "cpu", time_folders(cfg)) == {
        ("kda", 64): 10.0, ("attn", 64): 60.0}
    assert measured_costs(tmp_path / "out", cfg.budget(), "NVIDIA H200", time_folders(cfg)) == {("kda", 64): 10.0}
    monkeypatch.chdir(tmp_path)  # the default resolves from the repository root, wherever the command runs
    default, _ = parse_overrides(["preset=cpu"])
    assert [p.name for p in time_folders(default)] == ["mqar_h200_grid"]
    assert time_folders(parse_overrides(["preset=cpu", "times="])[0]) == ()


def test_a_job_summary_stands_for_its_job_files(tmp_path) -> None:
    """``eval.mqar.jobs.pack`` puts a grid's job files in one summary that the queue's times read as they read the
    files, and ``unpack`` writes the files back, keeping any job file already there."""
    from eval.mqar.jobs import load_summary, pack, unpack

    cfg, _ = parse_overrides(["preset=cpu", "mixers=kda,attn", "widths=64", f"out={tmp_path / 'out'}",
                              f"times={tmp_path / 'grid'}"])
    budget = {"budget": json.loads(json.dumps(asdict(cfg.budget())))}
    jobs = {f"{m}_d64_lr0.001_s{s}": {"mixer": m, "width": 64, "wall_s": wall + s, "identity": budget,
                                      "device": "cpu"} for m, wall in (("kda", 20.0), ("attn", 40.0)) for s in (0, 1)}
    (tmp_path / "grid" / "jobs").mkdir(parents=True)
    for name, job in jobs.items():
        (tmp_path / "grid" / "jobs" / f"{name}.json").write_text(json.dumps(job))
    from_files = measured_costs(tmp_path / "out", cfg.budget(), "cpu", time_folders(cfg))
    assert from_files == {("kda", 64): 20.5, ("attn", 64): 40.5}
    summary = pack(tmp_path / "grid")
    for path in (tmp_path / "grid" / "jobs").iterdir():
        path.unlink()
    (tmp_path / "grid" / "jobs").rmdir()
    assert load_summary(summary) == jobs
    assert time_folders(cfg) == (tmp_path / "grid",)
    assert measured_costs(tmp_path / "out", cfg.budget(), "cpu", time_folders(cfg)) == from_files
    kept = tmp_path / "again" / "kda_d64_lr0.001_s0.json"
    kept.parent.mkdir()
    kept.write_text(json.dumps({**jobs["kda_d64_lr0.001_s0"], "wall_s": 1.0}))
    assert unpack(summary, tmp_path / "again") == 3
    assert {p.stem: json.loads(p.read_text()) for p in (tmp_path / "again").iterdir()} == {
        **jobs, "kda_d64_lr0.001_s0": {**jobs["kda_d64_lr0.001_s0"], "wall_s": 1.0}}
    (tmp_path / "other.json").write_text(json.dumps({"benchmark": "mqar", "rows": []}))
    with pytest.raises(ValueError, match="not an MQAR job summary"):
        load_summary(tmp_path / "other.json")


def test_grid_runs_stores_and_resumes(tmp_path, one_thread) -> None:
    argv = ["mixers=kdn_diag/mu=1,attn", "widths=64", "settings=32x4,48x4", "lrs=3e-3", "train_examples=64",
            "valid_examples=32", "test_examples=32", "batch_tokens=1024", "vocab_size=64", f"out={tmp_path}",
            "preset=cpu", "streams=2"]
    cfg, _ = parse_overrides(argv)
    lines: list[str] = []
    records, failed = run_grid(cfg, log=lines.append)
    assert "2 to run" in lines[0] and len(records) == 2 and failed == []
    by = {r["mixer"]: r for r in records}
    assert by["kdn_diag/mu=1"]["steps"] == 2 + 3 and by["kdn_diag/mu=1"]["tokens"] == 64 * 32 + 63 * 48
    rows = [r for res in records for r in flatten(res)]
    assert {(r["mixer"], r["setting"]) for r in rows} == {(m, s) for m in by for s in ("32x4", "48x4")}
    assert all(r["state"] == 2 * (64 * 64 + 64) for r in rows if r["mixer"] == "kdn_diag/mu=1")
    assert all(0.0 <= r["test_acc"] <= 1.0 and r["final_loss"] > 0 for r in rows)
    assert [c["epoch"] for c in by["attn"]["curve"]] == [1] and set(by["attn"]["curve"][0]["valid"]) == {
        "32x4", "48x4"}
    assert len(list((tmp_path / "jobs").glob("*.json"))) == 2
    (run,) = runs_of(tmp_path)
    assert run["to_run"] == run["trained"] == 2 and run["failed"] == 0 and run["stopped"] is None
    assert 0 < run["wall_s"] and run["git_commit"] == git_commit()
    again, _ = run_grid(cfg, log=lines.append)
    assert "2 stored, 0 to run" in lines[-1] and sorted(str(r["records"]) for r in again) == sorted(
        str(r["records"]) for r in records)
    assert len(runs_of(tmp_path)) == 1  # a run with nothing to train is not one of the grid's runs
    cfg2, _ = parse_overrides([*argv, "train_examples=96"])  # another budget: rerun, not reuse
    report_only, _ = parse_overrides([*argv, "train_examples=96", "train=false"])
    assert run_grid(report_only, log=lines.append) == ([], []) and "0 stored" in lines[-1]
    run_grid(cfg2, log=lines.append)
    assert "0 stored, 2 to run" in lines[-3] and [r["trained"] for r in runs_of(tmp_path)] == [2, 2]


def test_a_stored_job_of_another_model_is_not_reused(tmp_path) -> None:
    """The identity names the model: Mamba-3 at the benchmark's head size (64) is another job than at 16, though
    both have nearly KDA's parameter count; a job file whose identity has no ``model`` counts only when the
    parameter count it recorded is this model's."""
    from eval.mqar.run import build_jobs, load_done
    from eval.mqar.train import architecture

    cfg, _ = parse_overrides(["mixers=mamba3_siso", "widths=64", "lrs=3e-4", "preset=cpu"])
    job = build_jobs(cfg)[0]
    ours, theirs = architecture(job.mixer, 64, 64, 8192), architecture(MixerChoice.parse("mamba3_siso/head_dim=16"),
                                                                       64, 64, 8192)
    assert model_config(job.mixer, 64, 64, 8192).mixer_kwargs["head_dim"] == 64 == job.identity()["model"][
        "mixer_kwargs"]["head_dim"]
    assert ours["shapes_sha256"] != theirs["shapes_sha256"] and abs(ours["params"] - theirs["params"]) < 1e-4 * ours[
        "params"]
    path = tmp_path / "job.json"

    def stored(identity: dict, params: int) -> bool:
        path.write_text(json.dumps({"identity": identity, "params": params}))
        return load_done(path, job) is not None

    identity = job.identity()
    old = {k: v for k, v in identity.items() if k != "model"}
    assert stored(identity, ours["params"]) and stored(old, ours["params"])
    assert not stored(old, theirs["params"]) and not stored({**identity, "model": theirs}, ours["params"])
    assert not stored({**old, "lr": 1e-3}, ours["params"])


def test_report_of_a_grid_cut_short(tmp_path, one_thread) -> None:
    """``train=false`` trains nothing and writes the results, table and plot of the jobs stored so far, naming the
    jobs that have none."""
    from eval.mqar.__main__ import main

    argv = ["mixers=attn", "widths=64", "settings=32x4", "lrs=3e-3", "train_examples=64", "valid_examples=32",
            "test_examples=32", "batch_tokens=1024", "vocab_size=64", f"out={tmp_path}", "preset=cpu"]
    main(argv)
    main([*argv, "mixers=attn,kdn_iso", "train=false"])
    data = json.loads((tmp_path / "mqar.json").read_text())
    assert data["missing_jobs"] == ["kdn_iso_d64_lr0.003_s0"] and data["config"]["train"] is False
    assert {r["mixer"] for r in data["rows"]} == {"attn"} and (tmp_path / "mqar.md").exists()
    assert not list(tmp_path.glob("jobs/kdn_iso*")) and data["jobs"][0]["device"]
    assert len(data["runs"]) == 1 and data["runs_wall_s"] == data["runs"][0]["wall_s"] > 0  # the training run only


@pytest.mark.gpu
@pytest.mark.parametrize("mixer", ALL_MIXERS)
def test_every_mixer_trains_on_cuda(mixer: str) -> None:
    """A few bf16 steps of each mixer's backbone on CUDA, and the answer-only logits equal the full model's there."""
    cfg = parse_overrides(["preset=smoke", "settings=128x8,256x16", "max_train_tokens=16384", "batch_tokens=8192",
                           "valid_examples=64", "test_examples=64"])[0]
    res = train_job(MixerChoice.parse(mixer), 64, 2e-3, 0, cfg.budget(), cfg.setting_objects(),
                    torch.device("cuda"))
    assert res["steps"] == 4 and not res["diverged"] and 0 < res["final_loss"] < 20
    model = build_model(model_config(MixerChoice.parse(mixer), 64, 64, 8192)).cuda().eval()
    split = MQARSplit(MQARSetting(128, 8), "test", 4, 4)
    x, positions, _ = next(split.batches("cuda"))
    y = split.labels().cuda()
    with torch.no_grad():
        sel = answer_logits(model, x, positions)
        ref = model(x).logits[y != IGNORE]
    assert (sel.float() - ref.float()).norm() / ref.float().norm() < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("mixer", ALL_MIXERS)
def test_graph_steps_match_eager_steps(mixer: str) -> None:
    """Each mixer's whole training step is captured in a CUDA graph, and its replays train like eager steps: the
    same losses and parameters after warm-up, capture and replays on two batch shapes, to bf16 rounding."""
    torch.manual_seed(0)
    ref = build_model(model_config(MixerChoice.parse(mixer), 64, 64, 8192)).cuda()
    models_, steps = [ref, copy.deepcopy(ref)], []
    for model, graphs in zip(models_, (False, True)):
        opt = build_optimizer(model, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
        steps.append((TrainStep(model, opt, 1.0, torch.device("cuda"), graphs=graphs),
                      build_scheduler(opt, warmup_steps=2, total_steps=16, min_ratio=0.1)))
    splits = [MQARSplit(MQARSetting(128, 8), "train", 64, 16), MQARSplit(MQARSetting(256, 16), "train", 32, 8)]
    batches = [(s, idx) for idx in range(4) for s in splits]
    losses = [[], []]
    for k, (step, sched) in enumerate(steps):
        for split, idx in batches:
            loss, norm = step(*split.take(torch.arange(idx * split.batch, (idx + 1) * split.batch), "cuda"))
            sched.step()
            losses[k].append(float(loss))
    assert steps[1][0].graphs and steps[1][0].fallback is None and len(steps[1][0].captured) == 2
    a, b = torch.tensor(losses[0]), torch.tensor(losses[1])
    assert (a - b).norm() / a.norm() < 1e-2, (losses[0], losses[1])
    pa = torch.cat([p.detach().float().flatten() for p in models_[0].parameters()])
    pb = torch.cat([p.detach().float().flatten() for p in models_[1].parameters()])
    assert (pa - pb).norm() / pa.norm() < 1e-2


def test_jobs_stepped_in_turn_equal_jobs_run_alone(one_thread) -> None:
    """Interleaving jobs changes nothing on the CPU: each one's curve, loss and accuracies are those it has alone."""
    cfg, _ = parse_overrides(["preset=cpu", "settings=32x4,48x4", "vocab_size=64", "head_dim=32",
                              "train_examples=128", "valid_examples=32", "test_examples=32", "batch_tokens=512",
                              "epochs=2"])
    args = [(MixerChoice.parse("kdn_diag"), 64, 3e-3, 0), (MixerChoice.parse("attn"), 64, 1e-3, 1)]
    cpu = torch.device("cpu")
    alone = [train_job(*a, cfg.budget(), cfg.scored_settings(), cpu) for a in args]
    together = train_together([JobRun(*a, cfg.budget(), cfg.scored_settings(), cpu) for a in args])
    keys = ("records", "final_loss", "steps", "params")
    for x, y in zip(alone, together):
        assert {k: x[k] for k in keys} == {k: y[k] for k in keys}
        assert [c["valid"] for c in x["curve"]] == [c["valid"] for c in y["curve"]] and len(x["curve"]) == 2
    assert alone[0]["final_loss"] != alone[1]["final_loss"]


def test_a_train_curve_leaves_the_scored_only_settings_to_the_last_epoch(one_thread) -> None:
    """``curve="train"`` scores the epochs before the last on the training settings alone, and changes nothing a
    job trains or reports."""
    cfg, _ = parse_overrides(["preset=cpu", "settings=32x4", "test_settings=48x4", "vocab_size=64", "head_dim=32",
                              "train_examples=128", "valid_examples=32", "test_examples=32", "batch_tokens=512",
                              "epochs=3"])
    assert cfg.curve == "train"
    args = (MixerChoice.parse("kda"), 64, 3e-3, 0, cfg.budget(), cfg.scored_settings(), torch.device("cpu"))
    every, train = train_job(*args, curve="all"), train_job(*args, curve="train")
    assert [set(c["valid"]) for c in every["curve"]] == [{"32x4", "48x4"}] * 3
    assert [set(c["valid"]) for c in train["curve"]] == [{"32x4"}, {"32x4"}, {"32x4", "48x4"}]
    keys = ("records", "final_loss", "steps", "params")
    assert {k: every[k] for k in keys} == {k: train[k] for k in keys}
    assert [c["valid"]["32x4"] for c in every["curve"]] == [c["valid"]["32x4"] for c in train["curve"]]
    with pytest.raises(ValueError, match="curve='some' is not one of"):
        parse_overrides(["preset=cpu", "curve=some"])


def test_a_job_stopped_after_an_epoch_resumes_from_its_checkpoint(tmp_path, one_thread) -> None:
    """A job abandoned mid-epoch restarts from the state it wrote after its last finished epoch and ends exactly as
    the uninterrupted job (curve, loss, accuracies, parameters); a checkpoint of another job is ignored."""
    cfg, _ = parse_overrides(["preset=cpu", "settings=32x4,48x4", "vocab_size=64", "head_dim=32",
                              "train_examples=128", "valid_examples=32", "test_examples=32", "batch_tokens=256",
                              "epochs=3"])
    args = (MixerChoice.parse("kdn_diag"), 64, 3e-3, 0, cfg.budget(), cfg.scored_settings(), torch.device("cpu"))
    path, identity = tmp_path / "job.pt", {"job": "kdn_diag", "budget": [1, 2]}
    whole = JobRun(*args)
    ref = train_together([whole])[0]
    first = JobRun(*args, checkpoint=path, identity=identity)
    steps = first.steps()
    while not path.exists():
        next(steps)
    for _ in range(3):  # into the second epoch: these steps are lost with the process
        next(steps)
    saved_at = torch.load(path, weights_only=True)["steps_done"]
    assert 0 < saved_at < first.steps_done < ref["steps"]
    resumed = JobRun(*args, checkpoint=path, identity=identity)
    assert resumed.start_epoch == 1 and resumed.steps_done == saved_at
    res = train_together([resumed])[0]
    keys = ("records", "final_loss", "steps", "tokens", "diverged")
    assert {k: res[k] for k in keys} == {k: ref[k] for k in keys} and res["resumed_from"] == [1]
    assert json.dumps([(c["step"], c["loss"], c["valid"]) for c in res["curve"]]) == json.dumps(
        [(c["step"], c["loss"], c["valid"]) for c in ref["curve"]])  # NaN loss before the first 50-step check
    for p, q in zip(resumed.model.parameters(), whole.model.parameters()):
        assert torch.equal(p, q)
    other = JobRun(*args, checkpoint=path, identity={**identity, "budget": [1, 3]})
    assert other.start_epoch == 0 and other.steps_done == 0 and other.resumed_from == []


@pytest.mark.gpu
def test_jobs_trained_together_match_jobs_trained_alone() -> None:
    """Three jobs of one learning-rate sweep (one seed), stepped in turn on their own streams and replayed from
    their own graphs, train as each does alone. At width 256 their graphs' matrix products use cuBLAS workspaces;
    graphs captured on one shared stream shared one and turned every loss of such a grid into NaN."""
    cfg = parse_overrides(["preset=smoke", "settings=64x4,512x64", "test_settings=", "max_train_tokens=262144",
                           "batch_tokens=32768", "valid_examples=256", "test_examples=256"])[0]
    args = [(MixerChoice.parse("kdn_diag"), 256, lr, 0) for lr in (1e-4, 3e-4, 1e-3)]
    alone = [train_job(*a, cfg.budget(), cfg.setting_objects(), torch.device("cuda")) for a in args]
    together = train_together([JobRun(*a, cfg.budget(), cfg.setting_objects(), torch.device("cuda"))
                               for a in args])
    for x, y in zip(alone, together):
        assert x["steps"] == y["steps"] == 16 and x["cuda_graphs"] and y["cuda_graphs"] and not y["diverged"]
        assert abs(x["final_loss"] - y["final_loss"]) < 1e-2 * x["final_loss"], (x["final_loss"], y["final_loss"])


@pytest.mark.gpu
def test_a_graphed_job_resumes_from_its_checkpoint(tmp_path) -> None:
    """On CUDA, with steps replayed from graphs, a job restarted from its first epoch's checkpoint (optimiser state
    and a learning rate that a graph reads from the device) trains on as the uninterrupted job does."""
    cfg = parse_overrides(["preset=smoke", "settings=64x4,512x64", "test_settings=", "max_train_tokens=131072",
                           "batch_tokens=16384", "valid_examples=256", "test_examples=256", "epochs=2"])[0]
    args = (MixerChoice.parse("kdn_diag"), 128, 1e-3, 0, cfg.budget(), cfg.setting_objects(), torch.device("cuda"))
    ref = train_job(*args)
    path = tmp_path / "job.pt"
    steps = JobRun(*args, checkpoint=path, identity={"job": 1}).steps()
    while not path.exists():
        next(steps)
    del steps
    res = train_together([JobRun(*args, checkpoint=path, identity={"job": 1})])[0]
    assert res["resumed_from"] == [1] and res["steps"] == ref["steps"] == 32 and res["cuda_graphs"]
    assert abs(res["final_loss"] - ref["final_loss"]) < 1e-2 * ref["final_loss"], (res["final_loss"],
                                                                                    ref["final_loss"])


def test_a_terminated_grid_takes_its_workers_with_it(tmp_path) -> None:
    """SIGTERM (a time limit) stops the grid's worker processes too: none trains on beside the next run."""
    import contextlib
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    def workers(pid: int) -> list[int]:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        return [int(k) for k in kids if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()]

    cmd = [sys.executable, "-m", "eval.mqar", "preset=cpu", "mixers=attn,kda", "widths=64", "lrs=1e-3",
           "train_examples=64000", "workers=2", f"out={tmp_path}"]
    proc, kids = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), []
    try:
        deadline = time.monotonic() + timeout_s(120)
        while len(kids := workers(proc.pid)) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, "the grid did not start its 2 workers"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=timeout_s(60)) != 0  # the grid joins its workers before it exits
        alive = [k for k in kids if Path(f"/proc/{k}").exists()
                 and Path(f"/proc/{k}/stat").read_text().split()[2] != "Z"]
        assert alive == [], f"workers {alive} outlived the grid"
    finally:
        proc.kill()
        for k in kids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(k, signal.SIGKILL)


def test_a_failing_job_is_reported_not_stored(tmp_path) -> None:
    cfg, _ = parse_overrides(["mixers=gdn2", "widths=64", "settings=32x4", "lrs=1e-3", "train_examples=32",
                              "batch_tokens=1024", f"out={tmp_path}", "preset=cpu"])
    cfg.mixers = ["gdn2/num_heads=0"]  # a model that fails to build (the command line refuses it before any job)
    records, failed = run_grid(cfg, log=lambda _: None)
    assert records == [] and len(failed) == 1 and "num_heads" in failed[0]["error"]
    assert not list(tmp_path.glob("jobs/*.json"))


def test_a_group_that_faults_outside_its_jobs_fails_alone(tmp_path, one_thread, monkeypatch) -> None:
    """An error outside any one job (as a CUDA fault surfacing in a group's clean-up) fails that group's jobs,
    reported and not stored; the other groups train and the grid returns."""
    import eval.mqar.run as run

    real = run.train_together

    def faulty(job_runs: list) -> list:
        if job_runs[0].choice.name == "kda":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(job_runs)

    monkeypatch.setattr(run, "train_together", faulty)
    cfg, _ = parse_overrides(["mixers=kda,attn", "widths=64", "settings=32x4", "lrs=1e-3,3e-3", "train_examples=32",
                              "valid_examples=16", "test_examples=16", "batch_tokens=1024", "vocab_size=64",
                              f"out={tmp_path}", "preset=cpu", "streams=2"])
    records, failed = run_grid(cfg, log=lambda _: None)
    assert sorted(f["job"] for f in failed) == ["kda_d64_lr0.001_s0", "kda_d64_lr0.003_s0"]
    assert all("illegal memory access" in f["error"] for f in failed)
    assert sorted(r["job"] for r in records) == ["attn_d64_lr0.001_s0", "attn_d64_lr0.003_s0"]
    assert sorted(p.name for p in tmp_path.glob("jobs/*.json")) == ["attn_d64_lr0.001_s0.json",
                                                                    "attn_d64_lr0.003_s0.json"]
