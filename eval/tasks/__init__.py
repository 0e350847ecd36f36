"""lm-eval task files of the cloze retrieval suite (Table 3) and the functions they call."""
from eval.tasks.utils import (
    ANSWER_ROOM,
    CONTEXT_TOKENS,
    HUB,
    MAX_GEN_TOKENS,
    TASKS,
    TRUNCATION,
    VERSIONS,
    Codec,
    build_docs,
    contains,
    hf_codec,
    keep_last,
    load_records,
    prompt_budget,
    prompt_text,
    window,
)

__all__ = ["ANSWER_ROOM", "CONTEXT_TOKENS", "HUB", "MAX_GEN_TOKENS", "TASKS", "TRUNCATION", "VERSIONS", "Codec",
           "build_docs", "contains", "hf_codec", "keep_last", "load_records", "prompt_budget", "prompt_text", "window"]
