"""Cloze retrieval (Table 3): prompts, answer-centred truncation, scoring, and the suite end to end through lm-eval
on local files with the hub datasets' field names."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from eval_fixtures import export_toy_run, oracle_from

import evaluate
from data import load_tokenizer
from eval.harness import Unavailable
from eval.tasks import build_docs, contains, split_prompt, truncate

TOK = load_tokenizer("mistral-v1")


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


def test_prompts_follow_the_task_text() -> None:
    doc, q, ans = split_prompt("swde", {"text": "Title: Alien.\nDirector: Scott.\nSummary of information above... "
                                                 "director:", "key": "director", "value": "Scott"})
    assert doc + q == "Title: Alien.\nDirector: Scott. Director:" and ans == ["Scott"]
    doc, q, _ = split_prompt("fda", {"text": "Device: a pump..\n510k number:", "key": "510k number", "value": "K1"})
    assert doc + q == "Device: a pump. 510k number:"
    doc, q, ans = split_prompt("triviaqa", {"context": "[DOC] [TLE] Paris [PAR] is in France. Where is Paris?",
                                            "question": "Where is Paris?", "answers": ["France"]})
    assert doc + q == "Paris  is in France. Where is Paris?" and ans == ["France"]
    doc, q, _ = split_prompt("nq", {"context": "Some context.", "question": " Who? ", "answers": ["x"]})
    assert doc + q == "Some context. Who?"
    doc, q, _ = split_prompt("squad", {"text": "  A context. The answer is", "value": "x"})
    assert doc + q == "A context. The answer is" and q == " The answer is"
    with pytest.raises(ValueError, match="unknown retrieval task 'quac'"):
        split_prompt("quac", {})


@pytest.mark.parametrize("where", [0.05, 0.5, 0.97])
def test_truncation_keeps_the_answer_and_fits_2k(where: float) -> None:
    words = [f"w{i}" for i in range(3000)]
    words.insert(int(where * len(words)), "The code is Zanzibar77.")
    document = " ".join(words) + "."
    prompt = truncate(document, " What is the code?", ["zanzibar77"], TOK.encode, TOK.decode, 2048)
    n = len(TOK.encode(prompt))
    assert 2048 - 60 <= n <= 2048
    assert "Zanzibar77" in prompt and prompt.endswith(" What is the code?")
    body = TOK.encode(prompt[: prompt.index("Zanzibar77")])
    if 0.2 < where < 0.8:  # centred: about half of the window before the answer
        assert abs(len(body) - (2048 - 50) / 2) < 40
    short = "A short document about Zanzibar77."
    assert truncate(short, " Q?", ["Zanzibar77"], TOK.encode, TOK.decode) == short + " Q?"


def test_documents_without_an_answer_are_dropped() -> None:
    recs = [_records("nq", 0), {"context": "c", "question": "q", "answers": []},
            {"context": "c", "question": "q", "answers": ["  "]}]
    docs = build_docs("nq", recs, TOK.encode, TOK.decode)
    assert [d["index"] for d in docs] == [0] and docs[0]["answers"] == ["Answer0x", "ignored alias"]


def test_contains_is_case_insensitive_max_over_labels() -> None:
    assert contains(" the answer is PARIS.", ["London", "paris"]) == 1.0
    assert contains("", ["paris"]) == 0.0
    assert contains("anything", ["", "  "]) == 0.0
    assert contains("Lond", ["London"]) == 0.0


@pytest.fixture(scope="module")
def retrieval_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("retrieval")
    for task in ("swde", "fda", "squad", "triviaqa", "nq", "drop"):
        rows = [_records(task, i) for i in range(3)]
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
