"""Batch sizes under memory pressure (out-of-memory errors are faked): a size that ran out of memory is never tried
again by a :class:`BatchSearch`, before or after its search ends; with lm-eval's ``auto``, each task records the
sizes its own requests ran at, not those of the tasks before it on the same model."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import lm_eval
import pytest
import torch
from eval_fixtures import export_toy_run

from eval.generation import BatchSearch
from eval.harness import evaluate_task, load_model, make_lm


def test_a_size_that_ran_out_of_memory_is_never_tried_again() -> None:
    limit = [12]  # rows that fit; lowered later, as a longer prompt would
    attempts: list[int] = []
    oomed: set[int] = set()
    search = BatchSearch(start=16, cap=64, repeats=2)
    for batch in range(60):
        size = search.size
        attempts.append(size)
        assert not any(size >= s for s in oomed), f"batch {batch}: {size} rows tried after {sorted(oomed)} ran out"
        if size > limit[0]:
            oomed.add(size)
            search.out_of_memory()
            continue
        search.record(size, size / (100.0 * size))  # samples/s grows with the batch: only memory stops it
        if batch == 30:
            limit[0] = 6
    assert attempts[:3] == [16, 8, 8] and set(attempts[3:]) == {8, 4}  # 8 rows ran until a batch of 8 ran out
    assert search.done and search.size == 4 and oomed == {16, 8}


def test_each_lm_eval_task_records_the_batch_sizes_its_own_requests_ran_at(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lm_eval.api.instance import Instance

    run = export_toy_run(tmp_path / "run")
    model, tok = load_model(run / "hf", device="cpu")
    tok.pad_token = tok.eos_token
    lm = make_lm(model, tok, batch_size="auto", max_length=32)
    lm.max_batch_size = 24  # where lm-eval's search starts: fewer sizes to walk down on the CPU
    fits = [20]
    real_call = lm._model_call

    def limited(inps: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if inps.shape[0] > fits[0]:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried {inps.shape[0]} rows")
        return real_call(inps, *args, **kwargs)

    lm._model_call = limited
    reqs = [Instance("loglikelihood", {}, ("In the beginning God created", " the heaven"), 0),
            Instance("loglikelihood", {}, ("And the earth was", " without form"), 1)]

    def one_task(model: Any, tasks: list[str], **_: Any) -> dict[str, Any]:
        (name,) = tasks
        model.loglikelihood(reqs, disable_tqdm=True)
        return {"results": {name: {"acc,none": 0.5}}, "n-samples": {name: {"effective": len(reqs)}}}

    monkeypatch.setattr(lm_eval, "simple_evaluate", one_task)
    first, _ = evaluate_task(lm, {"a": "a"}, None)
    fits[0] = 9  # the second task's model has less memory to spare (a longer request would do the same)
    second, _ = evaluate_task(lm, {"b": "b"}, None)
    a, b = first["a"]["batch_size"], second["b"]["batch_size"]
    assert isinstance(a, int) and isinstance(b, int), (a, b)
    assert 9 < a <= 20 and b <= 9 and lm.detected_batch_sizes == [a, b]
