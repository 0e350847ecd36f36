"""Unit tests of train.py's parts (trainer/): optimiser groups, schedule, checkpoints, preemption, budget."""
from __future__ import annotations

import json
import math
import os
import signal

import pytest
import torch
from accelerate import Accelerator
from torch import nn

from kdn import DiagonalKDN
from trainer.checkpoint import STATE_FILE, Checkpointer, TrainState
from trainer.config import ConfigError, TrainConfig, derive_budget
from trainer.metrics import format_eta, peak_flops, truncate_jsonl
from trainer.optim import build_optimizer, build_scheduler, param_groups, warmup_cosine
from trainer.preemption import REQUEUE_EXIT_CODE, Preemption, parse_signal


class TinyLM(nn.Module):
    """Embedding -> DiagonalKDN -> norm -> tied head; ``forward(ids [B, T]) -> logits [B, T, V]``."""

    def __init__(self, vocab: int = 50, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.mixer = DiagonalKDN(d, num_heads=2, head_dim=16)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.mixer(self.embed(ids))[0]))


def test_param_groups_follow_the_decay_rules() -> None:
    torch.manual_seed(0)
    model = TinyLM()
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    ids_decay = {id(p) for p in decay["params"]}
    ids_no = {id(p) for p in no_decay["params"]}
    assert not ids_decay & ids_no
    assert len(ids_decay) + len(ids_no) == len(list(model.parameters()))  # tied head counted once
    assert id(model.embed.weight) in ids_decay
    assert id(model.mixer.prior_theta) in ids_no  # flagged _no_weight_decay by kdn
    for name, p in model.named_parameters():
        if p.ndim < 2:
            assert id(p) in ids_no, name  # norms, biases, A_log, dt_bias
        elif not getattr(p, "_no_weight_decay", False):
            assert id(p) in ids_decay, name


def test_warmup_cosine_shape() -> None:
    f = lambda s: warmup_cosine(s, warmup_steps=10, total_steps=110, min_ratio=0.1)  # noqa: E731
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0) and f(60) == pytest.approx(0.55)
    assert f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)
    values = [f(s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert warmup_cosine(0, warmup_steps=0, total_steps=5, min_ratio=0.1) == pytest.approx(1.0)


def test_optimizer_is_fused_adamw_with_the_decay_groups() -> None:
    torch.manual_seed(0)
    model, ref_model = TinyLM(), TinyLM()
    ref_model.load_state_dict(model.state_dict())
    kw = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
    opt = build_optimizer(model, **kw)
    ref = torch.optim.AdamW(param_groups(ref_model, 0.1), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    assert opt.defaults["fused"]
    ids = torch.randint(0, 50, (2, 12))
    for m, o in ((model, opt), (ref_model, ref)):
        for _ in range(3):
            m(ids).square().mean().backward()
            o.step()
            o.zero_grad()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_scheduler_state_roundtrips_through_json() -> None:
    model = TinyLM()
    kw = dict(lr=4e-4, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
    opt = build_optimizer(model, **kw)
    sched = build_scheduler(opt, warmup_steps=3, total_steps=20, min_ratio=0.1)
    for _ in range(7):
        opt.step()
        sched.step()
    saved = json.loads(json.dumps(sched.state_dict()))
    opt2 = build_optimizer(model, **kw)
    sched2 = build_scheduler(opt2, warmup_steps=3, total_steps=20, min_ratio=0.1)
    sched2.load_state_dict(saved)
    assert sched2.get_last_lr() == sched.get_last_lr()
    opt.step(), sched.step(), opt2.step(), sched2.step()
    assert [g["lr"] for g in opt2.param_groups] == [g["lr"] for g in opt.param_groups]
    assert opt.param_groups[0]["lr"] == pytest.approx(4e-4 * warmup_cosine(8, warmup_steps=3, total_steps=20,
                                                                            min_ratio=0.1))


def test_preemption_flag_handoff_and_restore() -> None:
    calls: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: calls.append(signum))
    try:
        with Preemption(["SIGUSR1", "TERM"]) as p:
            assert not p.requested
            os.kill(os.getpid(), signal.SIGUSR1)
            assert p.requested and p.received == signal.SIGUSR1
            assert calls == []  # the earlier handler only runs at handoff, after the checkpoint
            with pytest.raises(SystemExit) as exit_info:
                p.handoff()
            assert exit_info.value.code == REQUEUE_EXIT_CODE
            assert calls == [signal.SIGUSR1]
        os.kill(os.getpid(), signal.SIGUSR1)  # restored: the earlier handler runs directly
        assert calls == [signal.SIGUSR1, signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, previous)
    with pytest.raises(ValueError, match="unknown signal"):
        parse_signal("SIGFOO")


def _accelerator() -> Accelerator:
    return Accelerator(cpu=True)


def test_checkpoints_are_atomic_pruned_and_restore_exactly(tmp_path) -> None:
    torch.manual_seed(0)
    acc = _accelerator()
    model = TinyLM()
    opt = build_optimizer(model, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
    model, opt = acc.prepare(model, opt)
    ids = torch.randint(0, 50, (2, 12))
    ck = Checkpointer(tmp_path / "ck", keep_last=2)
    assert ck.latest() is None
    for step in range(1, 4):
        model(ids).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ck.save(acc, TrainState(step=step, tokens_seen=24 * step, wandb_id="abc", loader={"pos": step}))
    assert [p.name for p in ck.complete()] == ["step_000000002", "step_000000003"]
    # an interrupted save leaves a .tmp dir: never picked, left by other saves, cleaned at start-up (run lock held)
    (tmp_path / "ck" / ".tmp_step_000000004").mkdir()
    (tmp_path / "ck" / "step_000000009").mkdir()  # no manifest: incomplete, ignored
    assert ck.latest().name == "step_000000003"
    saved = {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()}
    exp_avg = opt.state_dict()["state"][0]["exp_avg"].clone()

    torch.manual_seed(1)
    acc = _accelerator()  # a fresh process would build a fresh one
    model2 = TinyLM()
    opt2 = build_optimizer(model2, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
    model2, opt2 = acc.prepare(model2, opt2)
    state = Checkpointer.load(acc, ck.latest())
    assert (state.step, state.tokens_seen, state.wandb_id, state.loader) == (3, 72, "abc", {"pos": 3})
    for k, v in acc.unwrap_model(model2).state_dict().items():
        assert torch.equal(v, saved[k]), k
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], exp_avg)
    ck.save(acc, TrainState(step=4))
    assert (tmp_path / "ck" / ".tmp_step_000000004").exists()
    ck.remove_stale_temps()
    assert not (tmp_path / "ck" / ".tmp_step_000000004").exists()
    bad = json.loads((ck.latest() / STATE_FILE).read_text()) | {"world_size": 2}
    (ck.latest() / STATE_FILE).write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="written by 2 processes"):
        Checkpointer.load(acc, ck.latest())


def _budget_cfg(**trainer) -> TrainConfig:
    c = TrainConfig()
    c.data.seq_len = 256
    for k, v in trainer.items():
        setattr(c.trainer, k, v)
    return c


def test_budget_derives_accumulation_steps_and_warmup() -> None:
    c = _budget_cfg(token_budget=50_000_000_000, global_batch_tokens=524_288, micro_batch_size=8)
    c.data.seq_len = 4096
    b = derive_budget(c, world_size=8)
    assert (b.grad_accum, b.total_steps, b.warmup_steps) == (2, 95_367, 954)
    assert derive_budget(c, world_size=1).grad_accum == 16
    c.trainer.max_steps = 30
    assert derive_budget(c, world_size=1).total_steps == 30
    with pytest.raises(ConfigError, match=r"^trainer.global_batch_tokens: .*x 3 = 98304"):
        derive_budget(c, world_size=3)
    with pytest.raises(ConfigError, match="^trainer.token_budget"):
        derive_budget(_budget_cfg(token_budget=100, global_batch_tokens=4096), world_size=1)


def test_metrics_jsonl_tools(tmp_path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 8)))
    truncate_jsonl(path, 4)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3, 4]
    assert format_eta(3725.0) == "1:02:05" and format_eta(math.inf) == "?"
    assert peak_flops(torch.device("cpu"), "fp32", None) is None
    assert peak_flops(torch.device("cpu"), "fp32", 1e12) == 1e12


def test_summarize_rows_and_curve_comparison(tmp_path) -> None:
    from trainer.summarize import compare, main, summarize

    def write(run, losses, tok_s, scale=1.0):
        run.mkdir()
        rows = [{"step": s + 1, "loss": scale * x, "tokens_per_s_per_device": t, "mfu": t / 1e6,
                 "peak_mem_gib": 10.0 + s} for s, (x, t) in enumerate(zip(losses, tok_s))]
        rows.append({"step": len(losses), "val_loss": 4.5 * scale})
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    losses = [10.0 - 0.2 * s + 0.05 * (-1) ** s for s in range(30)]
    speeds = [1000.0] + [5e5 + 1e3 * s for s in range(29)]  # the first interval (start-up) is excluded
    write(tmp_path / "a", losses, speeds)
    write(tmp_path / "b", losses, speeds, scale=1.001)
    write(tmp_path / "c", losses, speeds, scale=1.1)
    row = summarize(tmp_path / "a")
    assert (row["steps"], row["first_loss"], row["last_loss"], row["val_loss"]) == (30, losses[0], losses[-1], 4.5)
    assert row["tokens_per_s_per_device"] == 5e5 + 14e3 and row["peak_mem_gib"] == 39.0
    gap = compare(tmp_path / "a", tmp_path / "b")
    assert gap["max_rel_gap"] == pytest.approx(0.001 / 1.001) == gap["val_max_rel_gap"]
    assert gap["val_common_steps"] == 1
    assert main([str(tmp_path / "a"), str(tmp_path / "b"), "--compare"]) == 0
    assert main([str(tmp_path / "a"), str(tmp_path / "c"), "--compare"]) == 1
    assert main([str(tmp_path / "a"), str(tmp_path / "c"), "--json", str(tmp_path / "s.json")]) == 0
    assert len(json.loads((tmp_path / "s.json").read_text())) == 2
    with pytest.raises(ValueError, match="metrics.jsonl does not exist"):
        summarize(tmp_path)


def test_summarize_skips_a_directory_without_records_and_names_it(tmp_path, capsys) -> None:
    from trainer.summarize import main

    run = tmp_path / "a"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 9.0 - s}) + "\n" for s in (1, 2)))
    refused = tmp_path / "b"  # what a refused command left: Hydra's files only
    (refused / ".hydra").mkdir(parents=True)
    (refused / "train.log").write_text("")
    assert main([str(run), str(refused)]) == 0
    out, err = capsys.readouterr()
    assert err == f"skipped {refused}: {refused / 'metrics.jsonl'} does not exist; pass a run directory written by " \
                  "train.py\n"
    assert f"| {run} | 2 | 8 | 7 |" in out and str(refused) not in out
    assert main([str(refused)]) == 1
    assert "no run to summarise among 1 directory" in capsys.readouterr().err


def test_fsdp_reduces_in_fp32_and_keeps_the_stream_dtypes() -> None:
    """accelerate's default FSDP2 policy under bf16 reduces gradients in bf16 and casts every block's inputs and
    outputs (the FP32 residual stream, the loss) to bf16; ours keeps bf16 parameters but FP32 reductions and
    leaves the blocks' inputs and outputs as they are, also after accelerate applies its precision."""
    from trainer.distributed import fsdp_plugin

    plugin = fsdp_plugin("bf16")
    plugin.set_mixed_precision("bf16")  # what accelerate's state does with mixed_precision="bf16"
    policy = plugin.mixed_precision_policy
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype, policy.cast_forward_inputs) == (
        torch.bfloat16, torch.float32, None, False)
    assert fsdp_plugin("fp32").mixed_precision_policy is None
