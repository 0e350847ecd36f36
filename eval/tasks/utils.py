"""Cloze retrieval tasks (Table 3) for lm-eval: SWDE, FDA, SQuAD, TriviaQA, NQ, DROP (docs/protocol.md §9).

The documents come from the Hugging Face hub (``hazyresearch/based-*``, validation split) or, offline, from local
files with the same fields: ``<data_dir>/<task>.jsonl`` or ``.parquet`` (``retrieval.data_dir`` of evaluate.py,
``data_dir`` in lm-eval's metadata).

Each record is cut and prompted as the JRT fork of lm-eval (HazyResearch/prefix-linear-attention) does it with
``--cutting_context`` (truncation ``"jrt"``, docs/protocol.md §9, "Table 3's truncation"):

1. **Window.** Every record's document field (``text`` for SWDE, FDA, SQuAD; ``context`` for the others), stripped,
   is replaced by a window of ``cut - 50`` tokens (``cut`` = ``context_tokens``; NQ: ``context_tokens - 48``),
   counted with the model's tokenizer as its default call encodes (special tokens included). The window starts
   ``(cut - 50) // 2`` tokens before the anchor (not before the document's start) and stops at the document's end.
   The anchor is the earliest case-insensitive match of the task's answer fields (SWDE, FDA: ``key`` and ``value``;
   SQuAD: ``value``; NQ: the first of ``answers``), else of the first ``alt_answers`` entry that matches; with no
   match, the end of the document (the window is its tail); TriviaQA and DROP have no answer field, so their anchor
   is the start (the window is the head). SWDE's whole ``text`` is windowed, its "Summary of information above..."
   block included: the fork's loader cuts that block only on a copy it discards, so an anchor can lie in it.
2. **Drop.** A record whose answer field is empty or one character long is left out (SWDE, FDA, SQuAD, NQ), and so
   is a record with no label to score (an empty ``answers`` list), on which the fork's scorer raises.
3. **Prompt.** The task's prompt is built from the cut record (``prompt_text``); SWDE's drops the summary block
   from the window, when the window holds it.
4. **Budget.** The prompt keeps its last ``context_tokens - 48`` tokens (without special tokens), which is what
   lm-eval's model does to a prompt longer than its window less the 48 generated tokens.

Decoding is greedy, at most 48 tokens, up to a newline; the score is case-insensitive containment of any label
(``contains``, in [0, 1] per document).

This module imports only the standard library, ``datasets`` and ``transformers``, so that
``lm_eval run ... --include_path eval/tasks --tasks kdn_retrieval`` runs it from any checkout.
"""
from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

HUB = {"swde": "hazyresearch/based-swde-v2", "fda": "hazyresearch/based-fda", "squad": "hazyresearch/based-squad",
       "triviaqa": "hazyresearch/based_triviaqa", "nq": "hazyresearch/based_nq_2048", "drop": "hazyresearch/based_drop"}
FIELDS = {"swde": ("text", "key", "value"), "fda": ("text", "key", "value"), "squad": ("text", "value"),
          "triviaqa": ("context", "question", "answers"), "nq": ("context", "question", "answers"),
          "drop": ("context", "question", "answers")}
# (the field the window replaces, the fields whose earliest match anchors it); no fields: the document's start
CUT = {"swde": ("text", ("key", "value")), "fda": ("text", ("key", "value")), "squad": ("text", ("value",)),
       "triviaqa": ("context", ()), "nq": ("context", ("answers",)), "drop": ("context", ())}
TASKS = tuple(HUB)
# each task's definition version, as its YAML's ``metadata.version`` records it in the results; SWDE's 2.0 windows
# the whole text, summary block included (1.0 windowed only the part before it)
VERSIONS = {"swde": 2.0, "fda": 1.0, "squad": 1.0, "triviaqa": 1.0, "nq": 1.0, "drop": 1.0}
TRUNCATION = "jrt"  # the rule's name in the results' settings
CONTEXT_TOKENS = 2048  # the fork's --context_length for the five tasks, and its model's window
ANSWER_ROOM = 50  # the fork's --answer_length: tokens of the cut length the window leaves out
MAX_GEN_TOKENS = 48
RETIRED_DATA_ENV = "KDN_RETRIEVAL_DATA"  # not read: the folder is retrieval.data_dir (lm-eval: metadata data_dir)
_SWDE_SUMMARY = "Summary of information above..."
_TRIVIA_MARKERS = re.compile(r"\[PAR\]|\[DOC\]|\[TLE\]")


class Codec(NamedTuple):
    """The model's tokenizer, as the truncation uses it.

    Args:
        encode: text -> ids as the tokenizer's default call returns them (special tokens included): the window's
            token counts.
        encode_plain: text -> ids without special tokens: the prompt budget's count.
        decode: ids -> text, special tokens skipped.
    """

    encode: Callable[[str], list[int]]
    encode_plain: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]


def prompt_budget(context_tokens: int) -> int:
    """Prompt tokens that leave room for the generation in a ``context_tokens`` window."""
    budget = context_tokens - MAX_GEN_TOKENS
    if budget - ANSWER_ROOM <= 0:
        raise ValueError(f"context_tokens={context_tokens} leaves no document window; use more than "
                         f"{MAX_GEN_TOKENS + ANSWER_ROOM} (the paper: {CONTEXT_TOKENS})")
    return budget


def _first_answer(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return str(value[0]) if value else ""
    return str(value)


def anchor(task: str, record: dict[str, Any], document: str) -> int | None:
    """Character offset in ``document`` that centres the window: the earliest case-insensitive match of the
    task's answer fields; failing that, the match of the first ``alt_answers`` entry (in list order, not the
    earliest in the text) that matches; ``-1`` when nothing matches; ``0`` for a task without answer fields;
    ``None`` when an answer field is empty or one character long (drop)."""
    fields = CUT[task][1]
    if not fields:
        return 0
    pos = -1
    for name in fields:
        answer = _first_answer(record[name])
        if len(answer) <= 1:
            return None
        if (m := re.search(re.escape(answer), document, re.IGNORECASE)) and (pos < 0 or m.start() < pos):
            pos = m.start()
    if pos < 0:  # the first alternative answer that matches
        for alt in record.get("alt_answers") or []:
            if m := re.search(re.escape(str(alt)), document, re.IGNORECASE):
                return m.start()
    return pos


def window(document: str, pos: int, width: int, codec: Codec, tok_pos: int | None = None) -> str:
    """The ``width``-token window of ``document`` around character ``pos`` (decoded).

    It starts ``width // 2`` tokens before the anchor token, or at the document's start, and stops ``width`` tokens
    later or at the document's end. The anchor token is the token count of ``document[:pos]``; with ``pos = -1``
    that prefix is all but the last character, so the window is the document's tail (or ``tok_pos``, when given
    and that prefix is longer than ``width``)."""
    ids = codec.encode(document)
    centre = len(codec.encode(document[:pos]))
    if pos == -1 and tok_pos is not None and centre > width:
        centre = int(tok_pos)
    start = max(0, centre - width // 2)
    return codec.decode(ids[start: min(len(ids), start + width)])


def _strip_suffix(text: str, suffix: str) -> str:
    while suffix and text.lower().endswith(suffix.lower()):
        text = text[: -len(suffix)]
    return text


def prompt_text(task: str, record: dict[str, Any]) -> str:
    """The prompt of one (cut) record, as the fork's task builds it."""
    if task == "swde":
        key = record["key"]
        text = _strip_suffix(record["text"].split(_SWDE_SUMMARY)[0], key + ":")
        return text.strip().strip(".") + ". " + key[:1].upper() + key[1:] + ":"
    if task == "fda":
        key = record["key"]
        text = _strip_suffix(record["text"], key + ":").strip("\n").strip(".")
        return (text if text.endswith(".") else text + ".") + " " + key[:1].upper() + key[1:] + ":"
    if task == "squad":
        return record["text"].strip()
    if task not in FIELDS:
        raise ValueError(f"unknown retrieval task {task!r}: use one of {', '.join(TASKS)}")
    context, question = record["context"].strip(), record["question"].strip()
    if task == "triviaqa":
        context = _TRIVIA_MARKERS.sub("", context)
    if task == "nq":  # once, case-sensitively
        context = context[: -len(question)] if question and context.endswith(question) else context
    else:
        context = _strip_suffix(context, question)
    return context.strip().strip(".") + ". " + question


def keep_last(prompt: str, budget: int, codec: Codec) -> str:
    """``prompt`` cut to its last ``budget`` tokens (without special tokens); re-encoding the decoded cut can
    merge tokens differently, so it drops more until the text itself fits."""
    ids = codec.encode_plain(prompt)
    drop = len(ids) - budget
    while drop > 0:
        prompt = codec.decode(ids[drop:])
        if len(codec.encode_plain(prompt)) <= budget:
            break
        drop += 1
    return prompt


def labels(task: str, record: dict[str, Any]) -> list[str]:
    """The strings a continuation is scored against; ``[]`` (the record is dropped) for an empty or missing
    (``None``, as ``datasets`` fills a row without the field) answer list."""
    if task in ("swde", "fda", "squad"):
        return [str(record["value"])]
    answers = record["answers"]
    if answers is None:
        return []
    return [answers] if isinstance(answers, str) else [str(a) for a in answers]


def contains(prediction: str, labels: list[str]) -> float:
    """1.0 when any label occurs in ``prediction`` (case-insensitive; an empty label always does), else 0.0."""
    return float(any(re.search(re.escape(label), prediction, re.IGNORECASE) for label in labels))


def build_docs(task: str, records: list[dict[str, Any]], codec: Codec,
               context_tokens: int = CONTEXT_TOKENS) -> list[dict[str, Any]]:
    """``[{"index", "prompt", "answers"}]``: each record windowed, prompted and cut to the budget; the records the
    rule drops (and those without any label) are left out. ``index`` is the record's position in ``records``."""
    if task not in CUT:
        raise ValueError(f"unknown retrieval task {task!r}: use one of {', '.join(TASKS)}")
    budget = prompt_budget(context_tokens)
    field = CUT[task][0]
    width = (budget if task == "nq" else context_tokens) - ANSWER_ROOM
    docs = []
    for i, rec in enumerate(records):
        answers = labels(task, rec)
        document = str(rec[field]).strip()
        pos = anchor(task, rec, document)
        if pos is None or not answers:
            continue
        cut = dict(rec) | {field: window(document, pos, width, codec, rec.get("tok_pos"))}
        docs.append({"index": i, "prompt": keep_last(prompt_text(task, cut), budget, codec), "answers": answers})
    return docs


def _local_file(task: str, data_dir: str | None) -> Path | None:
    root = data_dir
    if not root and os.environ.get(RETIRED_DATA_ENV):  # refused: a folder named only there would be left for the hub
        raise ValueError(f"{RETIRED_DATA_ENV} is not read: pass retrieval.data_dir={os.environ[RETIRED_DATA_ENV]} "
                         "to evaluate.py (lm-eval: --metadata '{\"data_dir\": DIR}') and unset it")
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


def hf_codec(tokenizer: Any) -> Codec:
    """:class:`Codec` of a ``transformers`` tokenizer: its default call, the same without special tokens, and
    ``decode`` skipping special tokens (its own whitespace clean-up setting, as the fork decodes)."""
    return Codec(encode=lambda s: tokenizer(s)["input_ids"],
                 encode_plain=lambda s: tokenizer(s, add_special_tokens=False)["input_ids"],
                 decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))


def _tokenizer(metadata: dict[str, Any]) -> Any:
    from transformers import AutoTokenizer

    name = metadata.get("tokenizer") or metadata.get("pretrained")
    if not isinstance(name, str) or not name:
        raise ValueError("the retrieval tasks truncate with the model's tokenizer: pass --metadata "
                         "'{\"tokenizer\": \"<hf dir or name>\"}' (or --model_args pretrained=<hf dir>)")
    return AutoTokenizer.from_pretrained(name)


def _loader(task: str) -> Callable[..., Any]:
    def load(**metadata: Any) -> Any:
        import datasets

        docs = build_docs(task, load_records(task, metadata.get("data_dir")), hf_codec(_tokenizer(metadata)),
                          int(metadata.get("context_tokens", CONTEXT_TOKENS)))
        return datasets.DatasetDict({"validation": datasets.Dataset.from_list(docs)})

    load.__name__ = f"load_{task}"
    return load


load_swde, load_fda, load_squad = _loader("swde"), _loader("fda"), _loader("squad")
load_triviaqa, load_nq, load_drop = _loader("triviaqa"), _loader("nq"), _loader("drop")


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """lm-eval hook: ``{"contains": 0 or 1}`` of the generated continuation."""
    return {"contains": contains(results[0], doc["answers"])}
