"""Each cloze task's YAML against its definition: greedy generation of at most 48 tokens up to a newline, scored
by case-insensitive containment, from the prompts its own loader builds. The YAMLs are read the way lm-eval reads
them, so a ``!function`` that lm-eval cannot resolve fails here too."""
from __future__ import annotations

from pathlib import Path

import pytest
from lm_eval.tasks._yaml_loader import load_yaml

from eval.tasks import MAX_GEN_TOKENS, TASKS, VERSIONS

TASK_DIR = Path(__file__).resolve().parents[1] / "eval" / "tasks"


def test_one_yaml_per_task() -> None:
    assert sorted(p.stem for p in TASK_DIR.glob("*.yaml")) == sorted(f"kdn_{t}" for t in TASKS)


@pytest.mark.parametrize("task", TASKS)
def test_yaml_matches_the_task_definition(task: str) -> None:
    cfg = load_yaml(TASK_DIR / f"kdn_{task}.yaml", resolve_func=True)
    assert cfg["task"] == f"kdn_{task}" and cfg["tag"] == "kdn_retrieval"
    assert cfg["output_type"] == "generate_until" and cfg["validation_split"] == "validation"
    gen = cfg["generation_kwargs"]
    assert gen["until"] == ["\n"], "generation stops at a newline, and only there"
    assert 0 < gen["max_gen_toks"] <= 48 and gen["max_gen_toks"] == MAX_GEN_TOKENS
    assert gen["do_sample"] is False and set(gen) == {"until", "max_gen_toks", "do_sample"}
    assert cfg["metric_list"] == [{"metric": "contains", "aggregation": "mean", "higher_is_better": True}]
    assert cfg["doc_to_text"] == "{{prompt}}" and cfg["doc_to_target"] == "{{answers[0]}}"
    assert cfg.get("num_fewshot", 0) == 0 and "filter_list" not in cfg
    assert cfg["metadata"]["version"] == VERSIONS[task], "the results record the YAML's version as the definition's"
    loader, scorer = cfg["custom_dataset"], cfg["process_results"]
    assert loader.__name__ == f"load_{task}", f"kdn_{task}.yaml loads another task's documents"
    assert scorer.__name__ == "process_results"
    assert scorer({"answers": ["x", "Paris"]}, [" PARIS, France"]) == {"contains": 1.0}
    assert scorer({"answers": ["Paris"]}, [" Lyon"]) == {"contains": 0.0}
