"""lm-eval task files of the cloze retrieval suite (Table 3) and the functions they call."""
from eval.tasks.utils import (
    CONTEXT_TOKENS,
    HUB,
    MAX_GEN_TOKENS,
    TASKS,
    build_docs,
    contains,
    load_records,
    split_prompt,
    truncate,
)

__all__ = ["CONTEXT_TOKENS", "HUB", "MAX_GEN_TOKENS", "TASKS", "build_docs", "contains", "load_records",
           "split_prompt", "truncate"]
