"""Shared fixtures of the evaluation tests: a tiny exported run, and a model that emits a chosen answer (or
nothing) through the real decoding interface."""
from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

import models
from data import load_tokenizer


def export_toy_run(root: Path, mixer: str = "kdn_diag", pattern: str = "recurrent", seq_len: int = 4096) -> Path:
    """A run directory ``root`` with config.yaml, metrics.jsonl and an hf/ export of a random toy model."""
    torch.manual_seed(0)
    model = models.build_model(models.model_config("toy", mixer, pattern, vocab_size=32000))
    root.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(root / "hf")
    for name, data in tokenizer_files().items():
        (root / "hf" / name).write_bytes(data)
    (root / "config.yaml").write_text(
        f"name: toy_{pattern}_{mixer}\nseed: 3\nmodel:\n  size: toy\nmixer:\n  name: {mixer}\n  mu: dk\n"
        f"backbone:\n  pattern: {pattern}\ndata:\n  seq_len: {seq_len}\n")
    (root / "metrics.jsonl").write_text(json.dumps({"step": 10, "tokens": 40960, "loss": 9.0}) + "\n"
                                        + '{"step": 11, "tok')  # a torn last line
    return root


def verse_shards(folder: Path, documents: int) -> Path:
    """Token shards of ``documents`` short verses (half of them the validation split) in ``folder / "s"``, from a
    JSON-lines file written beside them: held-out text for the perplexity and probe suites."""
    from data import PrepareConfig, prepare

    src = folder / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": f"Verse {i}: and the earth was without form, and void. " * 3}) + "\n"
                           for i in range(documents)))
    return prepare(PrepareConfig(source="jsonl", paths=str(src), out_dir=str(folder / "s"), val_fraction=0.5,
                                 num_workers=1, progress=False))


@functools.cache
def tokenizer_files() -> dict[str, bytes]:
    """Name -> bytes of the files ``save_pretrained`` writes for the mistral-v1 tokenizer: written once per process
    (about a second each time), then copied into every export."""
    with tempfile.TemporaryDirectory() as tmp:
        load_tokenizer("mistral-v1").save_pretrained(tmp)
        return {p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir())}


class Oracle(models.KDNForCausalLM):
    """The toy model with its real cache and HF interface (``generate`` included), but whose logits continue
    every prompt with ``answer(prompt ids)`` and then EOS: the first forward of a cache reads the prompts, each
    later one emits the next token of each row's target."""

    answer: Any = None

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                past_key_values: Any = None, cache: Any = None, **kw: Any) -> Any:
        state = cache if cache is not None else past_key_values
        out = super().forward(input_ids, attention_mask=attention_mask, past_key_values=state, **kw)
        new = out.recurrent_cache
        if new is None:  # a scoring call (no cache): no answer to give
            return out
        if state is None or not getattr(state, "targets", None):
            mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
            new.targets = [type(self).answer([t for t, m in zip(r.tolist(), mr[-r.shape[0]:].tolist()) if m])
                           + [self.config.eos_token_id] for r, mr in zip(input_ids, mask)]
            new.step = 0
        else:
            new.targets, new.step = state.targets, state.step + 1
        logits = torch.full((input_ids.shape[0], 1, self.config.vocab_size), -30.0)
        for b, target in enumerate(new.targets):
            logits[b, 0, target[min(new.step, len(target) - 1)]] = 30.0
        out.logits = logits
        return out


def oracle_from(hf_dir: Path, answer: Any) -> Oracle:
    """The exported toy model's weights in an :class:`Oracle` whose continuation is ``answer(prompt ids)``."""
    cls = type("BoundOracle", (Oracle,), {"answer": staticmethod(answer)})
    return cls.from_pretrained(hf_dir).eval()
