"""Table 1 through lm-eval: WikiText and LAMBADA perplexity, six zero-shot accuracies (docs/protocol.md §9).

Our models are Hugging Face models of type ``kdn_lm`` (registered by ``import models``), so lm-eval's
``HFLM`` wraps the loaded model object directly; no remote code.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TABLE1_TASKS = ("wikitext", "lambada_openai", "piqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge")
# the metric reported per accuracy task (length-normalised where the paper's baselines use it)
ACC_METRIC = {"lambada_openai": "acc", "piqa": "acc", "hellaswag": "acc_norm", "winogrande": "acc",
              "arc_easy": "acc", "arc_challenge": "acc_norm"}


def load_model(model_dir: str | Path, device: str = "auto", dtype: str = "auto") -> tuple[Any, Any]:
    """``(model, tokenizer)`` from an exported run directory (``runs/<name>/hf``), in eval mode."""
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
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    return model, AutoTokenizer.from_pretrained(path)


def run_tasks(
    model: Any, tokenizer: Any, tasks: list[str], *, batch_size: int = 8, limit: int | None = None,
    include_path: str | None = None, max_length: int = 4096,
) -> dict[str, dict[str, float]]:
    """Run lm-eval ``tasks`` on a loaded model; returns ``{task: {metric: value}}`` (numbers only)."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length)
    out = simple_evaluate(model=lm, tasks=list(tasks), limit=limit, task_manager=TaskManager(include_path=include_path),
                          bootstrap_iters=0)
    return {task: {m.split(",")[0]: float(v) for m, v in res.items() if isinstance(v, (int, float))}
            for task, res in out["results"].items()}


def table1_row(results: dict[str, dict[str, float]]) -> dict[str, float]:
    """The paper's Table 1 columns present in ``results``: Wiki ppl, LMB ppl, accuracies (%), their mean."""
    row: dict[str, float] = {}
    if "wikitext" in results:
        row["wiki_ppl"] = results["wikitext"]["word_perplexity"]
    if "lambada_openai" in results:
        row["lmb_ppl"] = results["lambada_openai"]["perplexity"]
    accs = {t: 100 * results[t][m] for t, m in ACC_METRIC.items() if t in results}
    row.update({f"{t}_{ACC_METRIC[t]}": a for t, a in accs.items()})
    if len(accs) == len(ACC_METRIC):
        row["avg"] = sum(accs.values()) / len(accs)
    return row
