"""A checkpoint's Hugging Face export: an export that was interrupted (by a kill, a full disk) or damaged (a size or
a SHA-256 that differs from its export.json) is never loaded; the next evaluation replaces it with a complete one."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import timeout_s
from eval_fixtures import export_toy_run
from forkserver import command_env, commands

from eval.harness import load_model
from eval.model_dir import EXPORT_MANIFEST, export_complete, resolve
from trainer.checkpoint import write_manifest

ROOT = Path(__file__).resolve().parents[1]
# an evaluation killed (SIGKILL) while it writes the export: after the weights, before the tokenizer files
KILLED_EXPORT = """
import os, signal, sys
import transformers
def killed(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)
transformers.PreTrainedTokenizerBase.save_pretrained = killed
from eval.model_dir import resolve
resolve(sys.argv[1])
"""


@pytest.fixture()
def checkpoint(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    """A toy run with one checkpoint whose weights differ from the run's export; returns it and its model."""
    run = export_toy_run(tmp_path / "run", seq_len=64)
    model, _ = load_model(run / "hf", device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    ckpt = run / "checkpoints" / "step_000000010"
    ckpt.mkdir(parents=True)
    torch.save(model.state_dict(), ckpt / "pytorch_model.bin")
    write_manifest(ckpt)
    return ckpt, model


def logits_rel_err(hf_dir: Path, ref_model: torch.nn.Module) -> float:
    model, _ = load_model(hf_dir, device="cpu")
    x = torch.randint(3, 32000, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, got = ref_model(input_ids=x).logits, model(input_ids=x).logits
    return float((got - ref).norm() / ref.norm())


def test_a_partial_export_is_replaced_not_loaded(checkpoint: tuple[Path, torch.nn.Module]) -> None:
    ckpt, model = checkpoint
    run = ckpt.parent.parent
    partial = ckpt / "hf"
    partial.mkdir()
    (partial / "config.json").write_text((run / "hf" / "config.json").read_text())
    (partial / "model.safetensors").write_bytes((run / "hf" / "model.safetensors").read_bytes()[:4096])
    target = resolve(ckpt)
    assert target.hf_dir == partial and export_complete(ckpt)
    assert logits_rel_err(target.hf_dir, model) < 1e-6
    manifest = json.loads((partial / EXPORT_MANIFEST).read_text())
    assert manifest["files"]["model.safetensors"]["size"] == (partial / "model.safetensors").stat().st_size > 4096
    assert sorted(p.name for p in ckpt.iterdir()) == [".hf.lock", "hf", "manifest.json", "pytorch_model.bin"]


def test_a_damaged_file_of_a_finished_export_is_detected(checkpoint: tuple[Path, torch.nn.Module]) -> None:
    ckpt, model = checkpoint
    hf = resolve(ckpt).hf_dir
    assert export_complete(ckpt)
    with open(hf / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    assert not export_complete(ckpt)
    assert resolve(ckpt).hf_dir == hf and logits_rel_err(hf, model) < 1e-6
    data = bytearray((hf / "model.safetensors").read_bytes())
    data[-64:] = bytes(b ^ 0xFF for b in data[-64:])  # damaged in place, its size unchanged
    (hf / "model.safetensors").write_bytes(bytes(data))
    assert not export_complete(ckpt)
    assert resolve(ckpt).hf_dir == hf and logits_rel_err(hf, model) < 1e-6


def test_an_evaluation_killed_while_exporting_leaves_nothing_loadable(
        checkpoint: tuple[Path, torch.nn.Module]) -> None:
    ckpt, model = checkpoint
    proc = commands().run(["-c", KILLED_EXPORT, str(ckpt)], command_env(), ROOT, timeout_s(300))
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert not export_complete(ckpt)
    assert any(ckpt.glob(".hf.*.tmp"))  # the half-written export, under its temp name
    target = resolve(ckpt)
    assert export_complete(ckpt) and logits_rel_err(target.hf_dir, model) < 1e-6
    assert not any(ckpt.glob(".hf.*.tmp"))
