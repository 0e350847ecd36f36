"""Shared fixtures of the evaluation tests: a tiny exported run, a RULER stand-in that follows eval/ruler's
interface (until that package is present), and models that always or never emit the right answer."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import random
import types
from pathlib import Path
from typing import Any

import torch

import models
from data import load_tokenizer

RULER_PRESENT = importlib.util.find_spec("eval.ruler") is not None


def export_toy_run(root: Path, mixer: str = "kdn_diag", pattern: str = "recurrent", seq_len: int = 4096) -> Path:
    """A run directory ``root`` with config.yaml, metrics.jsonl and an hf/ export of a random toy model."""
    torch.manual_seed(0)
    model = models.build_model(models.model_config("toy", mixer, pattern, vocab_size=32000))
    root.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(root / "hf")
    load_tokenizer("mistral-v1").save_pretrained(root / "hf")
    (root / "config.yaml").write_text(
        f"name: toy_{pattern}_{mixer}\nseed: 3\nmodel:\n  size: toy\nmixer:\n  name: {mixer}\n  mu: dk\n"
        f"backbone:\n  pattern: {pattern}\ndata:\n  seq_len: {seq_len}\n")
    (root / "metrics.jsonl").write_text(json.dumps({"step": 10, "tokens": 40960, "loss": 9.0}) + "\n"
                                        + '{"step": 11, "tok')  # a torn last line
    return root


def fake_ruler() -> types.ModuleType:
    """A small module with eval.ruler's interface: noise haystack, one number needle, RULER's scorer."""
    mod = types.ModuleType("eval.ruler")
    mod.TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1")
    mod.GRID = {"niah_single_1": (1024, 2048, 4096, 8192), "niah_single_2": (1024, 2048, 4096, 8192),
                "niah_single_3": (1024, 2048, 4096), "niah_multikey_1": (1024, 2048, 4096)}
    noise = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

    def cell_name(task: str, length: int) -> str:
        return f"{task}@{length}"

    def load_haystack(path: str | None) -> Any:
        text = noise if path is None else Path(path).read_text()
        return types.SimpleNamespace(source=path or "noise", sha256=hashlib.sha256(text.encode()).hexdigest(),
                                     words=text.split())

    def build_samples(task: str, length: int, n: int, *, tokenizer: Any, haystack: Any, seed: int = 0,
                      start: int = 0, max_new_tokens: int = 128) -> list[dict]:
        if task not in mod.TASKS:
            raise ValueError(f"unknown task {task!r}")
        out = []
        for index in range(start, start + n):
            rng = random.Random(f"{seed}/{task}/{length}/{index}")
            value = str(rng.randint(10**6, 10**7 - 1))
            reps = max(1, length // 400)
            hay = [noise] * reps
            depth = rng.choice([0, 50, 100])
            hay.insert(reps * depth // 100, f"One of the special magic numbers for key-{index} is: {value}.")
            prompt = (" ".join(hay) + f"\nWhat is the special magic number for key-{index} mentioned in the "
                      f"provided text? The special magic number for key-{index} mentioned in the provided text is")
            out.append({"task": task, "length": length, "index": index, "prompt": prompt, "answers": [value],
                        "depth": depth, "haystack_words": len(" ".join(hay).split()),
                        "prompt_tokens": len(tokenizer.encode(prompt))})
        return out

    def postprocess(pred: str) -> str:
        return "".join("\n" if ord(c) < 32 else c for c in pred.strip())

    def string_match_all(preds: list[str], refs: list[list[str]]) -> float:
        return 100 * sum(sum(r.lower() in postprocess(p).lower() for r in rs) / len(rs)
                         for p, rs in zip(preds, refs)) / len(preds)

    for f in (cell_name, load_haystack, build_samples, postprocess, string_match_all):
        setattr(mod, f.__name__, f)
    return mod


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
