"""``batch_size``: ``auto`` resolves to a fixed small batch on the CPU; on CUDA a :class:`BatchSearch` grows the batch
in place until memory runs out or samples/s stops improving (driven here by fake step functions and a fake clock);
an int overrides it; a bad value stops evaluate.py in one line before a model loads; lm-eval's own ``auto`` is
recorded with the size it chose."""
from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from eval_fixtures import export_toy_run

import eval.generation
import evaluate
import models
from eval.generation import CPU_BATCH, BatchSearch, greedy_generate, resolve_batch_size
from eval.harness import batch_used, load_model, make_lm

BAD = "batch_size must be 'auto' or a positive int"


def run_search(search: BatchSearch, step: Callable[[int], float], batches: int = 40) -> list[int]:
    """Feed ``search`` full batches timed by ``step(size)`` (seconds, or out-of-memory) until it ends; the sizes
    that ran."""
    ran = []
    for _ in range(batches):
        size = search.size
        try:
            seconds = step(size)
        except torch.cuda.OutOfMemoryError:
            search.out_of_memory()
        else:
            ran.append(size)
            search.record(size, seconds)
        if search.done:
            break
    return ran


def speed(rates: dict[int, float], oom_from: int | None = None) -> Callable[[int], float]:
    """A step whose batches of ``b`` rows decode ``rates[b]`` samples/s (out of memory from ``oom_from`` rows)."""
    def step(b: int) -> float:
        if oom_from is not None and b >= oom_from:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory at {b} rows")
        return b / rates[b]
    return step


def test_auto_is_a_fixed_small_batch_on_the_cpu_and_a_search_on_cuda_and_ints_override() -> None:
    assert resolve_batch_size("auto", "cpu") == CPU_BATCH == 8
    assert resolve_batch_size("auto", torch.device("cuda:1")) == "auto"
    assert resolve_batch_size(64, "cuda") == 64 and resolve_batch_size(3, "cpu") == 3
    for bad in (0, -4, "big", "64", 2.5, True, None):
        with pytest.raises(ValueError, match=BAD) as err:
            resolve_batch_size(bad, "cuda")
        assert "\n" not in str(err.value) and "batch_size=auto" in str(err.value)


def test_the_search_keeps_the_size_where_samples_per_s_stops_growing_by_10_percent() -> None:
    s = BatchSearch(start=64, cap=512)
    assert run_search(s, speed({64: 50.0, 128: 100.0, 256: 105.0})) == [64, 64, 128, 128, 256, 256]
    assert (s.size, s.done) == (128, True)  # 256 is 5% faster: not worth its memory
    assert s.rates == pytest.approx({64: 50.0, 128: 100.0, 256: 105.0})
    s = BatchSearch(start=64, cap=512, threshold=0.02)
    run_search(s, speed({64: 50.0, 128: 100.0, 256: 105.0, 512: 106.0}))
    assert s.size == 256  # a lower threshold buys the last 5%


def test_the_search_stops_below_the_first_size_that_runs_out_of_memory() -> None:
    s = BatchSearch(start=64, cap=512)
    assert run_search(s, speed({64: 50.0, 128: 100.0}, oom_from=256)) == [64, 64, 128, 128]
    assert (s.size, s.done) == (128, True)
    s = BatchSearch(start=64, cap=512)  # the first size does not fit: halve, and never try a size that failed
    assert run_search(s, speed({16: 20.0, 32: 40.0}, oom_from=40)) == [32, 32]
    assert (s.size, s.done, s.too_big) == (32, True, 64)
    s.out_of_memory()  # a longer prompt later: an ended search halves
    assert (s.size, s.done) == (16, True)
    one = BatchSearch(start=1)
    with pytest.raises(torch.cuda.OutOfMemoryError, match="one prompt alone does not fit"):
        one.out_of_memory()


def test_the_search_is_capped_at_a_cells_samples() -> None:
    s = BatchSearch(start=64, cap=500)
    assert run_search(s, speed({64: 10.0, 128: 20.0, 256: 40.0})) == [64, 64, 128, 128, 256, 256]
    assert (s.size, s.done) == (256, True)  # 512 rows would exceed a cell
    assert BatchSearch(start=64, cap=3).size == 3


def test_each_size_counts_its_fastest_batch_so_a_first_batchs_one_off_costs_do_not_end_the_search() -> None:
    """The first batch at a new size pays a graph capture or kernel autotuning: 10x slower here; the 64-row
    batches are warm already (an earlier context length ran them)."""
    seen = {64}

    def step(b: int) -> float:
        seconds = b / {64: 50.0, 128: 100.0, 256: 200.0, 512: 210.0}[b]
        first = b not in seen
        seen.add(b)
        return seconds * (10 if first else 1)

    s = BatchSearch(start=64, cap=512)
    run_search(s, step)
    assert s.size == 256
    seen.clear()
    seen.add(64)
    once = BatchSearch(start=64, cap=512, repeats=1)  # timing single batches would stop at the first size
    run_search(once, step)
    assert once.size == 64


def test_a_short_last_batch_measures_nothing() -> None:
    s = BatchSearch(start=64, cap=512)
    s.record(20, 0.001)  # a cell's last 20 prompts
    assert s.rates == {} and s.size == 64 and not s.done


def test_greedy_generate_grows_the_batch_in_place_and_reruns_a_batch_that_ran_out_of_memory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every prompt is decoded once, in a batch that fitted, and gets the tokens a fixed batch gives it."""
    torch.manual_seed(0)
    model = models.build_model(models.model_config("toy", "kdn_diag", vocab_size=300)).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist()
               for n in torch.randint(2, 40, (23,), generator=g).tolist()]
    fixed = greedy_generate(model, prompts, max_new_tokens=3, stop_ids={2}, pad_id=0, batch_size=23)
    clock = [0.0]
    real = eval.generation.greedy_batch
    attempts: list[int] = []

    def sized(model: Any, batch: list[list[int]], **kw: Any) -> list[list[int]]:
        attempts.append(len(batch))
        if len(batch) > 4:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        clock[0] += 1.0  # one second a batch: samples/s doubles with the batch
        return real(model, batch, **kw)

    monkeypatch.setattr(eval.generation, "greedy_batch", sized)
    monkeypatch.setattr(eval.generation, "perf_counter", lambda: clock[0])
    search, ran = BatchSearch(start=2, cap=16), []
    out = greedy_generate(model, prompts, max_new_tokens=3, stop_ids={2}, pad_id=0, batch_size=search,
                          on_batch=ran.append)
    assert out == fixed
    assert ran == [2, 2, 4, 4, 4, 4, 3] and attempts == [2, 2, 4, 4, 8, 4, 4, 3]
    assert (search.size, search.done) == (4, True)
    with pytest.raises(torch.cuda.OutOfMemoryError):  # an explicit batch size is the user's: no retry
        greedy_generate(model, prompts, max_new_tokens=3, stop_ids={2}, pad_id=0, batch_size=8)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_toy_run(tmp_path_factory.mktemp("r") / "run")


@pytest.mark.parametrize(("value", "bad"), [("0", BAD), ("big", "batch_size: 'big' is not an int or one of 'auto'"),
                                           ("2.5", "batch_size: 2.5 is not an int or one of 'auto'")])
def test_a_bad_batch_size_stops_evaluate_in_one_line_before_a_model_loads(
        value: str, bad: str, run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    def no_model(*a: object, **k: object) -> None:
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(evaluate, "load_model", no_model)
    argv = [f"model={run_dir}", "suites=[ruler]", f"out_dir={tmp_path}", "ruler.haystack=kjv", f"batch_size={value}"]
    with pytest.raises(ValueError, match=re.escape(bad)):
        evaluate.run(evaluate.compose(argv))
    monkeypatch.setattr(sys, "argv", ["evaluate.py", *argv])
    with pytest.raises(SystemExit) as done:
        evaluate.main()
    lines = capsys.readouterr().err.strip().splitlines()
    assert done.value.code == 2 and len(lines) == 1 and bad in lines[0], lines


def test_the_default_is_auto() -> None:
    assert evaluate.compose(["model=x"]).batch_size == "auto"
    assert evaluate.compose(["model=x", "preset=quick"]).batch_size == "auto"


def test_lm_evals_auto_batch_is_its_own_and_the_size_it_chose_is_reported(run_dir: Path) -> None:
    from lm_eval.api.instance import Instance

    model, tok = load_model(run_dir / "hf", device="cpu")
    tok.pad_token = tok.eos_token
    reqs = [Instance("loglikelihood", {}, ("In the beginning God created", " the heaven"), 0),
            Instance("loglikelihood", {}, ("And the earth was", " without form"), 0)]
    auto = make_lm(model, tok, batch_size="auto", max_length=64)
    assert auto.batch_size == "auto"
    auto.loglikelihood(reqs, disable_tqdm=True)
    assert auto.detected_batch_sizes == [64] and batch_used(auto) == 64  # lm-eval's max_batch_size fits
    assert batch_used(auto, since=1) == "auto"  # nothing chosen since
    fixed = make_lm(model, tok, batch_size=3, max_length=64)
    fixed.loglikelihood(reqs, disable_tqdm=True)
    assert fixed.detected_batch_sizes == [] and batch_used(fixed) == 3
