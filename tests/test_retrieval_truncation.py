"""Table 3's truncation, golden cases: each task's prompt from hand-built records, the expected prompt derived by hand
from the JRT fork's rule (window of ``context_tokens - 50`` tokens starting half of it before the anchor token,
stopping at the document's end; prompt cut to its last ``context_tokens - 48`` tokens).

The cases use a word tokenizer (a token is a word with its leading whitespace, or trailing whitespace alone) so
that token counts can be derived by hand. At ``context_tokens = 120``: window 70 tokens (half 35), prompt budget
72 tokens, NQ's window 72 - 50 = 22 tokens (half 11). A document ``w0 w1 ... w199`` encodes to 200 tokens; the
prefix before a match at word k (``"w0 ... w(k-1) "``) encodes to k + 1 tokens (its trailing space is one), so the
anchor token is k + 1 (k + 2 with a BOS token)."""
from __future__ import annotations

import re

import pytest

from eval.tasks import Codec, build_docs, contains

C = 120


def word_codec(bos: bool = False) -> Codec:
    vocab: dict[str, int] = {}
    inverse: dict[int, str] = {}

    def plain(text: str) -> list[int]:
        ids = []
        for piece in re.findall(r"\s*\S+|\s+", text):
            if piece not in vocab:
                vocab[piece] = len(vocab) + 1
                inverse[vocab[piece]] = piece
            ids.append(vocab[piece])
        return ids

    def encode(text: str) -> list[int]:
        return ([0] if bos else []) + plain(text)

    return Codec(encode, plain, lambda ids: "".join(inverse[i] for i in ids if i != 0))


def words(n: int, **at: int) -> list[str]:
    """``w0 .. w(n-1)`` with the word at index ``at[word]`` replaced by ``word``."""
    out = [f"w{i}" for i in range(n)]
    for word, i in at.items():
        out[i] = word
    return out


def span(ws: list[str], a: int, b: int) -> str:
    return " ".join(ws[a:b])


def prompts(task: str, records: list[dict], bos: bool = False) -> list[str]:
    return [d["prompt"] for d in build_docs(task, records, word_codec(bos), C)]


def swde(text: str, key: str = "director", value: str = "Ridley") -> dict:
    return {"text": text, "key": key, "value": value}


def test_swde_windows_around_the_answer_on_both_sides() -> None:
    ws = words(200, Ridley=100)  # anchor token 101: window 66..135
    text = " ".join(ws) + "\nSummary of information above... director:"
    assert prompts("swde", [swde(text)]) == [span(ws, 66, 136) + ". Director:"]
    assert prompts("swde", [swde(text)], bos=True) == [span(ws, 66, 136) + ". Director:"]


SUMMARY = "\nSummary of information above... director:"


def test_swde_windows_its_whole_text_summary_block_included() -> None:
    """The fork windows SWDE's whole text and drops the summary block only when it builds the prompt."""
    # the key only in the summary line anchors there: 200 words + "\nSummary", " of", " information", " above...",
    # " " before the match = token 205, window 170..205 (the block is cut off the prompt); the body alone would
    # have had no match and given its tail, 165..200
    ws = words(200)
    assert prompts("swde", [swde(" ".join(ws) + SUMMARY, value="Zanzibar")]) == [span(ws, 170, 200) + ". Director:"]
    # a body ending in "key:" and whitespace keeps that key: the window ends in the block, not in "director:"
    body = "Title: Alien. Ridley directed it. director:  \n"
    want = "Title: Alien. Ridley directed it. director:. Director:"
    assert prompts("swde", [swde(body + SUMMARY.lstrip())]) == [want]
    # an ordinary record whose window reaches into the block: anchor 191, window 156..205, the block dropped
    ws = words(200, Ridley=190)
    assert prompts("swde", [swde(" ".join(ws) + SUMMARY)]) == [span(ws, 156, 200) + ". Director:"]
    # a window that ends inside the block keeps what it holds of it: anchor 168, window 133..202
    ws = words(200, Ridley=167)
    want = span(ws, 133, 200) + "\nSummary of information. Director:"
    assert prompts("swde", [swde(" ".join(ws) + SUMMARY)]) == [want]


def test_the_window_stops_at_the_document_end_without_sliding_back() -> None:
    ws = words(200, Ridley=190)  # anchor 191: start 156, end min(200, 226)
    # FDA strips newlines and periods only: the window's leading space stays
    assert prompts("fda", [swde(" ".join(ws), "510k number")]) == [" " + span(ws, 156, 200) + ". 510k number:"]
    assert prompts("swde", [swde(" ".join(ws))]) == [span(ws, 156, 200) + ". Director:"]


def test_the_earliest_of_key_and_value_anchors_the_window() -> None:
    ws = words(200, Director=40, Ridley=150)  # the key at word 40 (case-insensitive): anchor 41, window 6..75
    assert prompts("swde", [swde(" ".join(ws))]) == [span(ws, 6, 76) + ". Director:"]
    ws = words(200, Ridley=40, director=150)  # the value first: the same window
    assert prompts("swde", [swde(" ".join(ws))]) == [span(ws, 6, 76) + ". Director:"]


def test_no_match_takes_the_tail() -> None:
    ws = words(200)  # the prefix is all but the last character: 200 tokens, start 165
    assert prompts("swde", [swde(" ".join(ws), "director", "K123")]) == [span(ws, 165, 200) + ". Director:"]
    nq = {"context": " ".join(ws), "question": "Who?", "answers": ["Paris"]}  # NQ: start 200 - 11
    assert prompts("nq", [nq]) == [span(ws, 189, 200) + ". Who?"]


@pytest.mark.parametrize("key,value", [("director", "5"), ("director", ""), ("d", "Ridley"), ("", "Ridley")])
def test_one_character_or_empty_key_or_value_is_dropped(key: str, value: str) -> None:
    ws = words(30, Ridley=10)
    kept = swde(" ".join(ws) + " 5")
    assert len(prompts("swde", [swde(" ".join(ws), key, value), kept])) == 1
    assert [d["index"] for d in build_docs("fda", [swde(" ".join(ws), key, value), kept], word_codec(), C)] == [1]


def test_a_document_shorter_than_the_window_is_kept_whole() -> None:
    ws = words(30, Ridley=20)
    assert prompts("swde", [swde(" ".join(ws) + "..\n")]) == [span(ws, 0, 30) + ". Director:"]
    assert prompts("swde", [swde(" ".join(ws))], bos=True) == [span(ws, 0, 30) + ". Director:"]


def test_a_window_at_the_start_counts_the_bos_token() -> None:
    ws = words(200, Ridley=10)  # anchor 11 (12 with BOS): start 0, 70 tokens, one of them BOS
    assert prompts("swde", [swde(" ".join(ws))]) == [span(ws, 0, 70) + ". Director:"]
    assert prompts("swde", [swde(" ".join(ws))], bos=True) == [span(ws, 0, 69) + ". Director:"]


def test_squad_windows_its_text_and_keeps_the_question_only_inside_the_window() -> None:
    ws = words(200, Ridley=100)
    long = {"text": " ".join(ws) + ". Who built it? It was built by", "value": "Ridley"}
    short = {"text": "  " + span(ws, 90, 110) + ". It was built by ", "value": "Ridley"}
    one = {"text": "It was built by", "value": "R"}
    assert prompts("squad", [long, short, one]) == [span(ws, 66, 136), span(ws, 90, 110) + ". It was built by"]


def test_triviaqa_and_drop_keep_the_head_of_the_context() -> None:
    ws = words(200, Paris=150)  # no answer field: anchor 0, tokens 0..69 whatever the answer
    drop = {"context": " ".join(ws) + " Who won?", "question": "Who won?", "answers": ["Paris"]}
    assert prompts("drop", [drop]) == [span(ws, 0, 70) + ". Who won?"]
    assert prompts("drop", [drop], bos=True) == [span(ws, 0, 69) + ". Who won?"]
    trivia = {"context": "[DOC] [TLE] Title [PAR] " + " ".join(ws), "question": "Who won?", "answers": ["Paris"]}
    assert prompts("triviaqa", [trivia]) == ["Title  " + span(ws, 0, 66) + ". Who won?"]


def test_question_suffixes() -> None:
    tail = "Paris is big. who is it?Who is it?"
    nq = {"context": tail, "question": " Who is it? ", "answers": ["Paris"]}
    drop = {"context": tail, "question": "Who is it?", "answers": ["Paris"]}
    assert prompts("nq", [nq]) == ["Paris is big. who is it?. Who is it?"]  # once, case-sensitively
    assert prompts("drop", [drop]) == ["Paris is big. Who is it?"]  # repeatedly, any case
    fda = swde("Device: a pump..\n510k Number:510K number:", "510k number", "pump")
    assert prompts("fda", [fda]) == ["Device: a pump. 510k number:"]
    swde_rec = swde("Title: Alien.\nDirector: Ridley.\n\nSummary of information above... director:")
    assert prompts("swde", [swde_rec]) == ["Title: Alien.\nDirector: Ridley. Director:"]


def test_nq_centres_on_its_first_answer_with_the_shorter_window() -> None:
    ws = words(200, Paris=100, France=20)  # answers[0] at word 100: anchor 101, start 90, 22 tokens
    nq = {"context": " ".join(ws), "question": "Where?", "answers": ["Paris", "France"]}
    assert prompts("nq", [nq]) == [span(ws, 90, 112) + ". Where?"]
    assert prompts("nq", [nq | {"answers": ["P", "Paris"]}, nq | {"answers": []}]) == []


def test_alt_answers_anchor_on_the_first_entry_that_matches() -> None:
    """With no match of the answer field, the first matching ``alt_answers`` entry in list order anchors the window:
    here Paris (word 150), not the last matching entry (Rome, word 100) nor the earliest in the text (Lyon, 40)."""
    ws = words(200, Lyon=40, Rome=100, Paris=150, Zurich=180)
    nq = {"context": " ".join(ws), "question": "Where?", "answers": ["Bern"],
          "alt_answers": ["Geneva", "Paris", "Lyon", "Rome"]}
    assert prompts("nq", [nq]) == [span(ws, 140, 162) + ". Where?"]  # anchor 151: start 140, 22 tokens
    # a match of the answer field wins over every alternative: Zurich at word 180, anchor 181
    assert prompts("nq", [nq | {"answers": ["Zurich"]}]) == [span(ws, 170, 192) + ". Where?"]
    swde_rec = swde(" ".join(ws), "director", "Bern") | {"alt_answers": ["Oslo", "rome", "Paris"]}
    assert prompts("swde", [swde_rec]) == [span(ws, 66, 136) + ". Director:"]  # Rome (any case): anchor 101


def test_tok_pos_centres_a_long_document_without_a_match() -> None:
    ws = words(200)
    nq = {"context": " ".join(ws), "question": "Where?", "answers": ["Bern"], "tok_pos": 50}
    assert prompts("nq", [nq]) == [span(ws, 39, 61) + ". Where?"]  # centre token 50, not the tail
    # not when an answer matches, nor when the document's prefix fits the window (then its tail, 9..20)
    assert prompts("nq", [nq | {"answers": ["w120"]}]) == [span(ws, 110, 132) + ". Where?"]
    short = words(20)
    assert prompts("nq", [nq | {"context": " ".join(short)}]) == [span(short, 9, 20) + ". Where?"]


def test_tok_pos_is_not_taken_when_the_prefix_is_exactly_the_window() -> None:
    """A record with no match whose prefix (all but the last character) is exactly the window's width (NQ's 22
    tokens: 22 words) keeps its tail, as a shorter one does; ``tok_pos`` takes over only past the width."""
    ws = words(22)
    nq = {"context": " ".join(ws), "question": "Where?", "answers": ["Bern"], "tok_pos": 5}
    assert prompts("nq", [nq]) == [span(ws, 11, 22) + ". Where?"]  # centre token 22: start 11, not tok_pos's 0
    longer = words(23)
    assert prompts("nq", [nq | {"context": " ".join(longer)}]) == [span(longer, 0, 22) + ". Where?"]  # from the start


@pytest.mark.parametrize("task", ["triviaqa", "drop"])
def test_records_without_a_label_are_dropped(task: str) -> None:
    """An empty (or missing) answer list leaves nothing to score (the fork's scorer raises): the record is left
    out, not kept and scored 0; an empty label is a label (it always matches)."""
    ws = words(30)
    recs = [{"context": " ".join(ws), "question": "Who?", "answers": answers} for answers in
            ([], ["w3"], None, [""], ())]
    docs = build_docs(task, recs, word_codec(), C)
    assert [(d["index"], d["answers"]) for d in docs] == [(1, ["w3"]), (3, [""])]


def test_the_question_counts_against_the_budget() -> None:
    ws = words(60, Paris=30)  # the document fits the 70-token window alone
    question = " ".join(f"q{i}" for i in range(20)) + "?"
    drop = {"context": " ".join(ws), "question": question, "answers": ["Paris"]}
    # 60 + 20 = 80 tokens: the last 72 stay, from token 8 on
    [prompt] = prompts("drop", [drop])
    assert prompt == " " + span(ws, 8, 60) + ". " + question
    assert len(word_codec().encode_plain(prompt)) == C - 48


def test_scoring_matches_any_label_case_insensitively() -> None:
    assert contains(" the answer is PARIS.", ["London", "paris"]) == 1.0
    assert contains("Lond", ["London"]) == 0.0
    assert contains("a+b", ["A+B"]) == 1.0  # a label is literal text, not a pattern
    assert contains("anything", [""]) == 1.0 and contains("anything", ["  "]) == 0.0
    drop = {"context": " ".join(words(10)), "question": "Q?", "answers": [""]}
    assert [d["answers"] for d in build_docs("drop", [drop], word_codec(), C)] == [[""]]
