"""MQAR benchmark: the generator's invariants and seeding, the answer-only metric, the grid's bookkeeping, and
that a tiny attention model learns the task on the CPU."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from eval.mqar import (
    ALL_MIXERS,
    IGNORE,
    MixerChoice,
    MQARSetting,
    MQARSplit,
    accuracy,
    answer_logits,
    answer_metrics,
    build_jobs,
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
from eval.mqar.run import git_commit, header
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
    s = MQARSetting(128, 8)
    a, b = MQARSplit(s, "train", 96, 32, seed=1), MQARSplit(s, "train", 96, 32, seed=1)
    for (xa, ya), (xb, yb) in zip(a.batches(2, shuffle=True), b.batches(2, shuffle=True)):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    other = MQARSplit(s, "train", 96, 32, seed=2).get(0)[0]
    test = MQARSplit(s, "test", 96, 32, seed=1).get(0)[0]
    assert not torch.equal(a.get(0)[0], other) and not torch.equal(a.get(0)[0], test)
    order0 = [x[0, 0].item() for x, _ in a.batches(0, shuffle=True)]
    assert sorted(order0) == sorted(x[0, 0].item() for x, _ in a.batches(1, shuffle=True))


@pytest.mark.parametrize("bad,match", [((63, 4), "even"), ((64, 17), "4 \\* pairs"), ((64, 4, 64), "vocab_size")])
def test_setting_errors(bad: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MQARSetting(*bad)


def test_metric_counts_only_answer_positions() -> None:
    s = MQARSetting(64, 4, vocab_size=128)
    x, y = generate(s, 8, seed=0)
    logits = torch.randn(8, 64, 128, generator=torch.Generator().manual_seed(0))
    answers = y != IGNORE
    # right at every answer position, wrong everywhere else (the "next token" there would be anything)
    logits[answers] = logits[answers].scatter(1, y[answers][:, None], 6.0)
    logits[~answers] = logits[~answers].scatter(1, ((x[~answers] + 1) % 128)[:, None], 80.0)
    loss, hits, n = answer_metrics(logits, y)
    assert n == 32 and hits.item() == 32
    ref = F.cross_entropy(logits[answers], y[answers])
    assert (loss - ref).abs() / ref.abs() < 1e-6
    i, t = answers.nonzero()[0]
    logits[i, t, y[i, t]] = -50.0
    assert answer_metrics(logits, y)[1].item() == 31


def test_answer_logits_match_the_full_model(one_thread) -> None:
    torch.manual_seed(0)
    cfg = model_config(MixerChoice.parse("kda"), 64, 32, 128)
    model = build_model(cfg).eval()
    x, y = generate(MQARSetting(64, 4, vocab_size=128), 4, seed=1)
    with torch.no_grad():
        sel, target = answer_logits(model, x, y)
        full = model(x).logits
    ref = full[y != IGNORE]
    assert torch.equal(target, y[y != IGNORE])
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
    assert cfg.train_examples == 8_000 and cfg.results == "/tmp/x/mqar.json" and set(explicit) == {
        "mixers", "widths", "seeds", "preset", "out"}
    assert MixerChoice.parse("kdn_diag/mu=1").kwargs == (("mu", "1"),)
    assert dict(MixerChoice.parse("kda/output_gate=false").kwargs) == {"output_gate": False}
    for argv, match in ((["widht=64"], "unknown key"), (["mixers=kdx"], "unknown mixer"), (["widths"], "key=value"),
                        (["mixers=kda/mu=1"], "does not take"), (["settings=64-4"], "SEQLENxPAIRS"),
                        (["preset=big"], "unknown preset"), (["widths=a"], "cannot read")):
        with pytest.raises(ValueError, match=match):
            parse_overrides(argv)
    with pytest.raises(ValueError, match="multiple of head_dim"):
        model_config(MixerChoice.parse("kda"), 96, 64, 8192)


def test_grid_budget_and_summary(tmp_path) -> None:
    cfg, _ = parse_overrides(["mixers=kdn_diag,attn", "widths=64,128", "settings=64x4,2048x256", "lrs=1e-3,1e-2",
                              "seeds=0,1", f"out={tmp_path}", "preset=full"])
    jobs = build_jobs(cfg)
    assert len(jobs) == 2 * 2 * 2 * 2 * 2 and len({j.name for j in jobs}) == len(jobs)
    assert jobs[0].setting.seq_len == 2048 and jobs[0].width == 128  # longest first
    assert {j.budget.train_examples for j in jobs} == {100_000, 25_000_000 // 2048}
    records = []
    for j in jobs:  # a validation accuracy that prefers lr 1e-2 for kdn_diag and 1e-3 for attn
        good = (j.lr == 1e-2) == (j.mixer.name == "kdn_diag")
        acc = 0.5 + 0.3 * good + 0.01 * j.seed + j.width / 1e4
        records.append({"setting": j.setting.name, "mixer": j.mixer.label, "width": j.width, "lr": j.lr,
                        "seed": j.seed, "valid_acc": acc, "test_acc": acc - 0.02, "diverged": False,
                        "state": 8192, "state_recurrent": j.mixer.name != "attn", "params": 1})
    rows = summarize(records, cfg)
    assert len(rows) == 8 and rows[0]["setting"] == "64x4" and rows[0]["mixer"] == "kdn_diag"
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
    assert data["config"]["seeds"] == [0, 1] and data["versions"]["torch"] == torch.__version__


def _train_attention(steps: int, setting: MQARSetting, lr: float) -> tuple[float, float, MQARSplit]:
    torch.manual_seed(0)
    model = build_model(model_config(MixerChoice.parse("attn"), 64, 32, setting.vocab_size))
    opt = build_optimizer(model, lr=lr, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
    sched = build_scheduler(opt, warmup_steps=steps // 10, total_steps=steps, min_ratio=0.1)
    losses = []
    for inputs, labels in MQARSplit(setting, "train", 32 * steps, 32).batches(0, shuffle=True):
        logits, target = answer_logits(model, inputs, labels)
        loss = F.cross_entropy(logits.float(), target)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    test = MQARSplit(setting, "test", 256, 64)
    return sum(losses[:10]) / 10, sum(losses[-10:]) / 10, accuracy(model, test, torch.device("cpu"))


def test_attention_loss_decreases(one_thread) -> None:
    first, last, _ = _train_attention(60, MQARSetting(32, 4, vocab_size=48), 3e-3)
    assert last < 0.85 * first


@pytest.mark.slow
def test_attention_learns_mqar(one_thread) -> None:
    """A two-layer width-64 attention model solves a small-vocabulary MQAR (32 tokens, 4 pairs) on the CPU."""
    _, _, acc = _train_attention(800, MQARSetting(32, 4, vocab_size=48), 3e-3)
    assert acc > 0.9


def test_grid_runs_stores_and_resumes(tmp_path, one_thread) -> None:
    argv = ["mixers=kdn_diag/mu=1,attn", "widths=64", "settings=32x4", "lrs=3e-3", "train_examples=64",
            "valid_examples=32", "test_examples=32", "batch_size=32", "vocab_size=48", f"out={tmp_path}",
            "preset=cpu"]
    cfg, _ = parse_overrides(argv)
    lines: list[str] = []
    records, failed = run_grid(cfg, log=lines.append)
    assert "2 to run" in lines[0] and len(records) == 2 and failed == []
    by = {r["mixer"]: r for r in records}
    assert by["kdn_diag/mu=1"]["steps"] == 2 and by["kdn_diag/mu=1"]["state"] == 2 * (64 * 64 + 64)
    assert all(0.0 <= r["test_acc"] <= 1.0 and r["final_loss"] > 0 for r in records)
    assert len(list((tmp_path / "jobs").glob("*.json"))) == 2
    again, _ = run_grid(cfg, log=lines.append)
    assert "2 stored, 0 to run" in lines[-1] and sorted(r["test_acc"] for r in again) == sorted(
        r["test_acc"] for r in records)
    cfg2, _ = parse_overrides([*argv, "train_examples=96"])  # another budget: rerun, not reuse
    run_grid(cfg2, log=lines.append)
    assert "0 stored, 2 to run" in lines[-3]


@pytest.mark.gpu
@pytest.mark.parametrize("mixer", ALL_MIXERS)
def test_every_mixer_trains_on_cuda(mixer: str) -> None:
    """Two bf16 steps of each mixer's backbone on CUDA, and the answer-only logits equal the full model's there."""
    budget = parse_overrides(["preset=smoke", "train_examples=128", "valid_examples=64", "test_examples=64"])[0]
    setting = MQARSetting(128, 8)
    rec = train_job(MixerChoice.parse(mixer), 64, setting, 2e-3, 0, budget.budget(setting), torch.device("cuda"))
    assert rec["steps"] == 2 and not rec["diverged"] and 0 < rec["final_loss"] < 20
    model = build_model(model_config(MixerChoice.parse(mixer), 64, 64, 8192)).cuda().eval()
    x, y = generate(setting, 4, seed=0)
    x, y = x.cuda(), y.cuda()
    with torch.no_grad():
        sel, _ = answer_logits(model, x, y)
        ref = model(x).logits[y != IGNORE]
    assert (sel.float() - ref.float()).norm() / ref.float().norm() < 1e-3


def test_a_failing_job_is_reported_not_stored(tmp_path) -> None:
    cfg, _ = parse_overrides(["mixers=attn/window=0", "widths=64", "settings=32x4", "lrs=1e-3", "train_examples=32",
                              "batch_size=32", f"out={tmp_path}", "preset=cpu"])
    records, failed = run_grid(cfg, log=lambda _: None)
    assert records == [] and len(failed) == 1 and "window" in failed[0]["error"]
    assert not list(tmp_path.glob("jobs/*.json"))
