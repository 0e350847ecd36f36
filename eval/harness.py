"""Table 1 through lm-eval: WikiText and LAMBADA perplexity, six zero-shot accuracies (docs/protocol.md §9).

Our models are Hugging Face models of type ``kdn_lm`` (registered by ``import models``), so lm-eval's
``HFLM`` wraps the loaded model object directly; no remote code. ``max_length`` is always passed: HFLM otherwise
falls back to 2048, and WikiText's rolling perplexity depends on it.
"""
from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

TABLE1_TASKS = ("wikitext", "lambada_openai", "piqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge")
# the metric reported per accuracy task (length-normalised where the paper's baselines use it)
ACC_METRIC = {"lambada_openai": "acc", "piqa": "acc", "hellaswag": "acc_norm", "winogrande": "acc",
              "arc_easy": "acc", "arc_challenge": "acc_norm"}
TASKS_DIR = Path(__file__).resolve().parent / "tasks"
# lm-eval's warnings about the way it is called, which our calls trigger on purpose (a loaded model object; task
# options passed through TaskManager metadata): nothing a user can act on. Its other warnings (truncation, ...) pass.
NOT_ACTIONABLE = ("`pretrained` model kwarg is not of type `str`",
                  "Passed an already-initialized model through `pretrained`",
                  "Custom kwargs can be passed to `--metadata`")
LM_EVAL_LOGGERS = ("lm_eval.models.huggingface", "lm_eval.api.task", "lm_eval.evaluator")


class Unavailable(RuntimeError):
    """A suite or task whose data cannot be reached here; the message names the local path or override to give."""


def go_offline() -> None:
    """No network calls from here on: hub datasets and files come from the local cache or fail at once.
    (``huggingface_hub`` and ``datasets`` read the environment at import, so their flags are set too.)"""
    import datasets
    import huggingface_hub

    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    huggingface_hub.constants.HF_HUB_OFFLINE = True
    datasets.config.HF_HUB_OFFLINE = True


class _DropNotActionable(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not any(text in msg for text in NOT_ACTIONABLE)


@contextmanager
def quiet_lm_eval() -> Iterator[None]:
    """Inside the ``with`` block, lm-eval's loggers drop the warnings listed in ``NOT_ACTIONABLE``; the filter is
    removed on exit, so lm-eval used elsewhere in the process keeps all of its messages."""
    drop = _DropNotActionable()
    loggers = [logging.getLogger(name) for name in LM_EVAL_LOGGERS]
    for logger in loggers:
        logger.addFilter(drop)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(drop)


def load_model(model_dir: str | Path, device: str = "auto", dtype: str = "auto") -> tuple[Any, Any]:
    """``(model, tokenizer)`` from an exported run directory (``runs/<name>/hf``), in eval mode."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import models  # noqa: F401  (registers kdn_lm with AutoConfig / AutoModelForCausalLM)

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a Hugging Face model directory (no config.json); pass the "
                                "hf/ folder that train.py exports, e.g. runs/<name>/hf")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    except SafetensorError as e:  # a truncated or overwritten weights file: its header or data cannot be read
        raise ValueError(f"{path}: the weights cannot be read ({e}); the file is damaged or truncated: export the "
                         "model again (rerun its train.py command) or copy it anew") from None
    return model.to(device).eval(), AutoTokenizer.from_pretrained(path)


def make_lm(model: Any, tokenizer: Any, *, batch_size: int | str, max_length: int) -> Any:
    """lm-eval's ``HFLM`` over a loaded model object, with an explicit ``max_length``.

    ``batch_size="auto"`` is lm-eval's own search: before a task's requests, the largest batch of at most 64 rows
    (HFLM's ``max_batch_size``) of the longest request that runs five forwards, 10% fewer rows after each
    out-of-memory error. The sizes it settles on are appended to ``lm.detected_batch_sizes`` (see
    :func:`evaluate_task`)."""
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length)
    lm.detected_batch_sizes = []
    detect = lm._detect_batch_size

    def recorded(*args: Any, **kwargs: Any) -> int:
        size = detect(*args, **kwargs)
        lm.detected_batch_sizes.append(size)
        return size

    lm._detect_batch_size = recorded  # HFLM calls it through the instance, for every request type
    return lm


def batch_used(lm: Any, since: int = 0) -> int | str | list[int]:
    """The batch size ``lm`` (from :func:`make_lm`) ran at: its fixed size, or the sizes lm-eval's ``auto`` chose
    after the first ``since`` (one int when they agree, else the distinct sizes; ``"auto"`` when none ran)."""
    sizes = sorted(set(getattr(lm, "detected_batch_sizes", [])[since:]))
    if not sizes:
        return lm.batch_size
    return sizes[0] if len(sizes) == 1 else sizes


def task_manager(include_path: str | Path | None = None, metadata: dict[str, Any] | None = None,
                 defaults: bool = True) -> Any:
    """lm-eval's ``TaskManager`` over ``eval/tasks``, ``include_path`` and (``defaults``) lm-eval's own tasks.
    Indexing lm-eval's own tasks reads thousands of YAML files: build one manager per suite."""
    from lm_eval.tasks import TaskManager

    paths = [str(TASKS_DIR)] + ([str(include_path)] if include_path else [])
    return TaskManager(include_path=paths, include_defaults=defaults, metadata=metadata)


def load_task(manager: Any, name: str) -> dict[str, Any]:
    """``{name: Task}`` with its documents loaded; ``ValueError`` for an unknown name, :class:`Unavailable` when
    its dataset cannot be reached."""
    from lm_eval.tasks import get_task_dict

    if name not in manager.all_tasks:
        raise ValueError(f"unknown lm-eval task {name!r}; see `lm_eval ls tasks`, or add its YAML folder with "
                         "lm.include_path=DIR")
    try:
        return get_task_dict([name], manager)
    except (ConnectionError, OSError) as e:  # FileNotFoundError included
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "data_dir" not in msg:  # lm-eval's hub tasks: the fix is a filled cache
            msg = (f"lm-eval task {name}: its dataset is not in the local Hugging Face cache ({msg}); run once "
                   "online, or point HF_HOME/HF_DATASETS_CACHE at a filled cache")
        raise Unavailable(msg) from None


def evaluate_task(lm: Any, task: dict[str, Any], manager: Any, *, limit: int | None = None,
                  log_samples: bool = False) -> tuple[dict[str, dict[str, Any]], dict[str, list[dict]]]:
    """Run loaded tasks; ``({task: {metric: value, "n": documents, "batch_size": batch_used}},
    {task: [per-sample records]})``."""
    from lm_eval import simple_evaluate

    since = len(getattr(lm, "detected_batch_sizes", []))
    out = simple_evaluate(model=lm, tasks=list(task.values()), limit=limit, bootstrap_iters=0,
                          log_samples=log_samples, task_manager=manager)
    metrics: dict[str, dict[str, Any]] = {
        t: {m.split(",")[0]: float(v) for m, v in res.items() if isinstance(v, (int, float))
            and not isinstance(v, bool)} for t, res in out["results"].items()}
    for t, counts in (out.get("n-samples") or {}).items():
        if t in metrics:
            metrics[t]["n"] = int(counts.get("effective", counts.get("original", 0)))
    for row in metrics.values():
        row["batch_size"] = batch_used(lm, since)
    samples = {t: [sample_record(s, t) for s in rows] for t, rows in (out.get("samples") or {}).items()}
    return metrics, samples


def sample_record(sample: dict[str, Any], task: str) -> dict[str, Any]:
    """One lm-eval sample as a results log line: index, prompt hash, answers, prediction, score."""
    args = sample.get("arguments") or [[""]]
    first = args[0] if isinstance(args, list) else next(iter(args.values()))
    prompt = str(first[0] if isinstance(first, (list, tuple)) else first)
    metric = next((k for k in ("contains", "acc_norm", "acc", "word_perplexity", "perplexity") if k in sample),
                  None)
    target = sample.get("target")
    return {"index": sample.get("doc_id"), "prompt_sha256": hashlib.sha256(prompt.encode()).hexdigest(),
            "answers": target if isinstance(target, list) else [target], "prediction": sample.get("filtered_resps"),
            "score": sample.get(metric) if metric else None}


def table1_row(results: dict[str, dict[str, float]]) -> dict[str, float]:
    """The paper's Table 1 columns present in ``results``: ``wiki_ppl``, ``lmb_ppl``, one accuracy (%) per task
    (named by the task), and ``avg`` when all six accuracies are there."""
    row: dict[str, float] = {}
    if "wikitext" in results:
        row["wiki_ppl"] = results["wikitext"]["word_perplexity"]
    if "lambada_openai" in results:
        row["lmb_ppl"] = results["lambada_openai"]["perplexity"]
    accs = {t: 100 * results[t][m] for t, m in ACC_METRIC.items() if t in results}
    row.update(accs)
    if len(accs) == len(ACC_METRIC):
        row["avg"] = sum(accs.values()) / len(accs)
    return row
