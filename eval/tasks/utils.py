"""Cloze retrieval tasks (Table 3) for lm-eval: SWDE, FDA, SQuAD, TriviaQA, NQ, DROP (docs/protocol.md §9).

The documents come from the Hugging Face hub (``hazyresearch/based-*``, validation split) or, offline, from local
files with the same fields: ``<data_dir>/<task>.jsonl`` or ``.parquet`` (``data_dir`` in lm-eval's metadata, or the
``KDN_RETRIEVAL_DATA`` environment variable). Each document becomes ``{"prompt", "answers"}``:

- SWDE, FDA (fields ``text``, ``key``, ``value``): the document, then ``Key:``;
- SQuAD (``text``, ``value``): its text;
- TriviaQA, NQ, DROP (``context``, ``question``, ``answers``): ``context.strip().strip(".") + ". " + question``,
  TriviaQA's ``[PAR]``, ``[DOC]``, ``[TLE]`` markers removed.

A prompt longer than ``context_tokens`` (2048) tokens keeps an answer-centred window of ``context_tokens - 50``
tokens of its document (half of it before the first case-insensitive answer match), then its question. Documents
without a non-empty answer are dropped. Decoding is greedy, at most 48 tokens, up to a newline; the score is
case-insensitive containment of any label (``contains``, in [0, 1] per document).

This module imports only the standard library, ``datasets`` and ``transformers``, so that
``lm_eval --include_path eval/tasks`` runs it from any checkout.
"""
from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

HUB = {"swde": "hazyresearch/based-swde-v2", "fda": "hazyresearch/based-fda", "squad": "hazyresearch/based-squad",
       "triviaqa": "hazyresearch/based_triviaqa", "nq": "hazyresearch/based_nq_2048", "drop": "hazyresearch/based_drop"}
FIELDS = {"swde": ("text", "key", "value"), "fda": ("text", "key", "value"), "squad": ("text", "value"),
          "triviaqa": ("context", "question", "answers"), "nq": ("context", "question", "answers"),
          "drop": ("context", "question", "answers")}
TASKS = tuple(HUB)
CONTEXT_TOKENS = 2048
QUESTION_ROOM = 50  # tokens of a truncated prompt left for its question
MAX_GEN_TOKENS = 48
DATA_ENV = "KDN_RETRIEVAL_DATA"
_SWDE_SUMMARY = "Summary of information above..."
_TRIVIA_MARKERS = re.compile(r"\[PAR\]|\[DOC\]|\[TLE\]")


def _strip_suffix(text: str, suffix: str) -> str:
    while suffix and text.lower().endswith(suffix.lower()):
        text = text[: -len(suffix)]
    return text


def split_prompt(task: str, doc: dict[str, Any]) -> tuple[str, str, list[str]]:
    """``(document, question, answers)`` of one raw record; the prompt is ``document + question``."""
    if task in ("swde", "fda"):
        text = doc["text"].split(_SWDE_SUMMARY)[0] if task == "swde" else doc["text"]
        key = doc["key"].strip()
        text = _strip_suffix(text.strip(), key + ":")
        question = " " + key[:1].upper() + key[1:] + ":"
        return text.strip().strip(".") + ".", question, [str(doc["value"])]
    if task == "squad":
        text = doc["text"].strip()
        cut = max(text.rfind("\n"), text.rfind(". ") + 1)  # the cloze sentence stays whole
        return (text[:cut], text[cut:], [str(doc["value"])]) if cut > 0 else (text, "", [str(doc["value"])])
    if task not in FIELDS:
        raise ValueError(f"unknown retrieval task {task!r}: use one of {', '.join(TASKS)}")
    context = doc["context"].strip()
    if task == "triviaqa":
        context = _TRIVIA_MARKERS.sub("", context)
    question = doc["question"].strip()
    context = _strip_suffix(context, question)
    answers = doc["answers"]
    answers = [answers] if isinstance(answers, str) else [str(a) for a in answers]
    return context.strip().strip(".") + ".", " " + question, answers


def truncate(document: str, question: str, answers: list[str], encode: Callable[[str], list[int]],
             decode: Callable[[list[int]], str], context_tokens: int = CONTEXT_TOKENS) -> str:
    """The prompt ``document + question``, cut to an answer-centred window of the document when it is longer
    than ``context_tokens`` tokens: ``context_tokens - max(50, question tokens)`` document tokens, half of them
    before the first case-insensitive match of any answer (the document's start when none matches)."""
    if len(encode(document + question)) <= context_tokens:
        return document + question
    ids = encode(document)
    width = context_tokens - max(QUESTION_ROOM, len(encode(question)))
    if width <= 0:
        raise ValueError(f"the question alone has {len(encode(question))} tokens, more than the "
                         f"{context_tokens}-token context; raise context_tokens")
    lower = document.lower()
    hits = [lower.find(a.lower()) for a in answers if a.strip()]
    hits = [h for h in hits if h >= 0]
    centre = len(encode(document[: min(hits)])) if hits else 0
    start = max(0, min(centre - width // 2, len(ids) - width))
    window = decode(ids[start: start + width])
    while len(encode(window + question)) > context_tokens:  # a re-encoded window can merge differently
        width -= 8
        window = decode(ids[start: start + width])
    return window + question


def contains(prediction: str, labels: list[str]) -> float:
    """1.0 when any non-empty label occurs in ``prediction`` (case-insensitive), else 0.0."""
    low = prediction.lower()
    return float(any(label.strip() and label.lower() in low for label in labels))


def _local_file(task: str, data_dir: str | None) -> Path | None:
    root = data_dir or os.environ.get(DATA_ENV)
    if not root:
        return None
    for ext in ("jsonl", "json", "parquet"):
        if (path := Path(root) / f"{task}.{ext}").is_file():
            return path
    raise FileNotFoundError(f"{root} has no {task}.jsonl or {task}.parquet; write the {HUB[task]} validation "
                            f"split there with the fields {', '.join(FIELDS[task])}")


def load_records(task: str, data_dir: str | None = None) -> list[dict[str, Any]]:
    """The raw validation records of ``task``: a local file under ``data_dir`` when given, else the hub."""
    import datasets

    if task not in HUB:
        raise ValueError(f"unknown retrieval task {task!r}: use one of {', '.join(TASKS)}")
    path = _local_file(task, data_dir)
    if path is not None:
        kind = "parquet" if path.suffix == ".parquet" else "json"
        ds = datasets.load_dataset(kind, data_files={"validation": str(path)}, split="validation")
    else:
        try:
            ds = datasets.load_dataset(HUB[task], split="validation")
        except (ConnectionError, OSError, ValueError) as e:
            raise FileNotFoundError(
                f"retrieval task {task}: {HUB[task]} cannot be reached ({type(e).__name__}); download it, or "
                f"pass retrieval.data_dir=DIR (lm-eval: --metadata '{{\"data_dir\": DIR}}') with DIR/{task}.jsonl "
                f"holding the fields {', '.join(FIELDS[task])}") from None
    missing = [f for f in FIELDS[task] if f not in ds.column_names]
    if missing:
        raise ValueError(f"retrieval task {task}: the records lack the fields {missing} (have {ds.column_names})")
    return list(ds)


def _tokenizer(metadata: dict[str, Any]) -> Any:
    from transformers import AutoTokenizer

    name = metadata.get("tokenizer") or metadata.get("pretrained")
    if not isinstance(name, str) or not name:
        raise ValueError("the retrieval tasks truncate with the model's tokenizer: pass --metadata "
                         "'{\"tokenizer\": \"<hf dir or name>\"}' (or --model_args pretrained=<hf dir>)")
    return AutoTokenizer.from_pretrained(name)


def build_docs(task: str, records: list[dict[str, Any]], encode: Callable[[str], list[int]],
               decode: Callable[[list[int]], str], context_tokens: int = CONTEXT_TOKENS) -> list[dict[str, Any]]:
    """``[{"index", "prompt", "answers"}]`` for the records with a non-empty answer, truncated."""
    docs = []
    for i, rec in enumerate(records):
        document, question, answers = split_prompt(task, rec)
        answers = [a for a in answers if a.strip()]
        if answers:
            docs.append({"index": i, "prompt": truncate(document, question, answers, encode, decode, context_tokens),
                         "answers": answers})
    return docs


def _loader(task: str) -> Callable[..., Any]:
    def load(**metadata: Any) -> Any:
        import datasets

        tok = _tokenizer(metadata)
        docs = build_docs(task, load_records(task, metadata.get("data_dir")),
                          lambda s: tok(s, add_special_tokens=False)["input_ids"],
                          lambda ids: tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False),
                          int(metadata.get("context_tokens", CONTEXT_TOKENS)))
        return datasets.DatasetDict({"validation": datasets.Dataset.from_list(docs)})

    load.__name__ = f"load_{task}"
    return load


load_swde, load_fda, load_squad = _loader("swde"), _loader("fda"), _loader("squad")
load_triviaqa, load_nq, load_drop = _loader("triviaqa"), _loader("nq"), _loader("drop")


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """lm-eval hook: ``{"contains": 0 or 1}`` of the generated continuation."""
    return {"contains": contains(results[0], doc["answers"])}
