"""Cloze retrieval (Table 3) with the model's real tokenizer: the window and the prompt budget, and the suite end
to end through lm-eval on local files with the hub datasets' field names (golden prompts:
test_retrieval_truncation.py)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from eval_fixtures import export_toy_run, oracle_from

import evaluate
from data import load_tokenizer
from eval.harness import Unavailable
from eval.tasks import VERSIONS, Codec, build_docs

TOK = load_tokenizer("mistral-v1")
CODEC = Codec(TOK.encode, TOK.encode, TOK.decode)


def _records(task: str, i: int, filler: int = 3) -> dict:
    pad = " ".join(["Filler words about nothing in particular."] * filler)
    answer = f"Answer{i}x"
    if task in ("swde", "fda"):
        return {"text": f"Record {i}. {pad} The director is {answer}. {pad}\ndirector:", "key": "director",
                "value": answer, "doc_id": str(i)}
    if task == "squad":
        return {"text": f"Record {i}. {pad} It was built by {answer}. {pad}. Who built it? It was built by",
                "value": answer, "doc_id": str(i)}
    ctx = f"[DOC] [TLE] Record {i}. [PAR] {pad} The winner was {answer}. {pad}" if task == "triviaqa" else \
        f"Record {i}. {pad} The winner was {answer}. {pad}"
    return {"context": ctx + " Who won?", "question": "Who won?", "answers": [answer, "ignored alias"]}


def test_real_tokenizer_window_is_centred_and_stops_at_the_document_end() -> None:
    for where, centred in ((0.5, True), (0.97, False)):
        words = [f"w{i}" for i in range(3000)]
        words.insert(int(where * len(words)), "The code is Zanzibar77.")
        rec = {"context": " ".join(words), "question": "What is the code?", "answers": ["zanzibar77"]}
        ids = TOK.encode(rec["context"])
        centre = len(TOK.encode(rec["context"][: rec["context"].index("Zanzibar77")]))
        [doc] = build_docs("nq", [rec], CODEC, 2048)
        prompt = doc["prompt"]
        assert "Zanzibar77" in prompt and prompt.endswith(". What is the code?")
        body = len(TOK.encode(prompt[: prompt.index(". What is the code?")]))
        width = 2048 - 48 - 50  # NQ's window
        expected = width if centred else len(ids) - (centre - width // 2)  # no sliding back at the end
        assert abs(body - expected) <= 2, (where, body, expected)
        assert len(TOK.encode(prompt)) <= 2000


def test_a_document_that_fits_alone_still_fits_with_its_question() -> None:
    context = " ".join(f"w{i}" for i in range(524)) + " Zanzibar77"  # 1,992 tokens: within the 1,998 window
    n_doc = len(TOK.encode(context))
    assert 1980 < n_doc <= 1998
    question = " ".join(["Which of the numbered words came first in the list above?"] * 5)
    rec = {"context": context, "question": question, "answers": ["Zanzibar77"]}
    [doc] = build_docs("drop", [rec], CODEC, 2048)
    n = len(TOK.encode(doc["prompt"]))
    assert n_doc + len(TOK.encode(question)) > 2000 >= n >= 1990, n
    assert doc["prompt"].endswith("Zanzibar77. " + question)


@pytest.fixture(scope="module")
def retrieval_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("retrieval")
    for task in ("swde", "fda", "squad", "triviaqa", "nq", "drop"):
        rows = [_records(task, i) for i in range(3)]
        if task in ("triviaqa", "drop"):  # no label to score: left out, not scored 0
            rows.insert(1, _records(task, 9) | {"answers": []})
        (root / f"{task}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_toy_run(tmp_path_factory.mktemp("r") / "run")


def _answer_of(prompt_ids: list[int]) -> str:
    m = re.search(r"Record (\d+)", TOK.decode(prompt_ids))
    return f"Answer{m.group(1)}x" if m else "none"


@pytest.mark.parametrize("right", [True, False])
def test_suite_scores_100_for_the_right_answer_and_0_for_none(right: bool, run_dir: Path, retrieval_data: Path,
                                                              tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def answer(ids: list[int]) -> list[int]:
        return TOK.encode(" " + _answer_of(ids) + "\nmore") if right else []

    real = evaluate.load_model

    def load(path: Path, device: str, dtype: str) -> tuple:
        return oracle_from(path, answer), real(path, device=device, dtype=dtype)[1]

    monkeypatch.setattr(evaluate, "load_model", load)
    tasks = ["swde", "fda", "squad", "triviaqa", "nq", "drop"] if right else ["swde", "triviaqa"]
    out = evaluate.run(evaluate.compose([f"model={run_dir}", "suites=[retrieval]", f"out_dir={tmp_path}",
                                         f"retrieval.data_dir={retrieval_data}", "batch_size=2", "progress=false",
                                         "log_samples=true", f"retrieval.tasks=[{','.join(tasks)}]"]))
    rep = json.loads((tmp_path / "retrieval.json").read_text())
    assert rep == out["reports"]["retrieval"]
    assert list(rep["results"]) == tasks and all(r["n"] == 3 for r in rep["results"].values())
    assert {r["score"] for r in rep["results"].values()} == {100.0 if right else 0.0}
    assert rep["summary"] == ({"mean": 100.0} if right else {})  # the mean needs all six tasks
    assert rep["settings"]["context_tokens"] == 2048 and rep["settings"]["max_new_tokens"] == 48
    assert rep["settings"]["truncation"] == "jrt" and rep["settings"]["tasks"] == {t: VERSIONS[t] for t in tasks}
    lines = [json.loads(x) for x in (tmp_path / "retrieval.samples.jsonl").read_text().splitlines()]
    assert len(lines) == 3 * len(tasks) and {x["score"] for x in lines} == {1.0 if right else 0.0}


def test_an_unreachable_dataset_names_the_local_path(run_dir: Path, tmp_path: Path) -> None:
    base = [f"model={run_dir}", "suites=[retrieval]", f"out_dir={tmp_path}", "offline=true", "progress=false",
            "retrieval.tasks=[fda]"]
    with pytest.raises(Unavailable, match=r"cannot be reached.*retrieval.data_dir=DIR.*fda.jsonl"):
        evaluate.run(evaluate.compose(base))
    out = evaluate.run(evaluate.compose(base + ["skip_unavailable=true"]))
    assert "retrieval.data_dir" in out["skipped"]["retrieval/fda"] and not (tmp_path / "retrieval.json").exists()
    with pytest.raises(ValueError, match=r"unknown retrieval task\(s\) \['quac'\]"):
        evaluate.run(evaluate.compose(base[:-1] + ["retrieval.tasks=[quac]"]))


def test_the_records_folder_is_named_by_data_dir_only(retrieval_data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``KDN_RETRIEVAL_DATA`` is not a second spelling of ``retrieval.data_dir``: set alone, it is refused in one line
    naming the key (it would otherwise leave the run to the hub unnoticed); beside ``data_dir`` it is not read."""
    from eval.tasks.utils import load_records

    monkeypatch.setenv("KDN_RETRIEVAL_DATA", str(retrieval_data))
    with pytest.raises(ValueError) as err:
        load_records("fda")
    assert str(err.value) == (f"KDN_RETRIEVAL_DATA is not read: pass retrieval.data_dir={retrieval_data} to "
                              "evaluate.py (lm-eval: --metadata '{\"data_dir\": DIR}') and unset it")
    monkeypatch.setenv("KDN_RETRIEVAL_DATA", "/no/such/folder")
    assert [r["value"] for r in load_records("fda", str(retrieval_data))] == \
        [json.loads(x)["value"] for x in (retrieval_data / "fda.jsonl").read_text().splitlines()]
