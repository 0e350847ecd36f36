"""Modified RULER generator and scorer: prompts, determinism, needle depths, length fit, windows, noise lines,
RULER's joins of sentences and needles, bad input."""
from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
import uuid

import numpy as np
import pytest

from data.tokenizer import load_tokenizer
from eval.ruler import GRID, TASKS, build_samples, cell_name, load_haystack, parse_cell, postprocess, string_match_all
from eval.ruler import samples as ruler_samples
from eval.ruler.generate import main as generate_main
from eval.ruler.haystack import NOISE_LINE, haystack_from_text, noise_haystack, split_sentences

REQUIRED = ("task", "length", "index", "prompt", "answers", "depth", "haystack_words", "prompt_tokens")
HEADER = ("A special magic {kind} is hidden within the following text. Make sure to memorize it. "
          "I will quiz you about the {kind} afterwards.\n")
QUESTION = ("\nWhat is the special magic {kind} for {key} mentioned in the provided text? "
            "The special magic {kind} for {key} mentioned in the provided text is")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("mistral-v1")


@pytest.fixture(scope="module")
def kjv():
    return load_haystack(None)


def load_haystack_text(text: str):
    return haystack_from_text(text, "test", "00")


def _kind(task: str) -> str:
    return "uuid" if task == "niah_single_3" else "number"


def _context(sample: dict) -> str:
    """The prompt's haystack-with-needles part, checked against RULER's singular template."""
    kind, key = _kind(sample["task"]), sample["query"]
    header, question = HEADER.format(kind=kind), QUESTION.format(kind=kind, key=key)
    prompt = sample["prompt"]
    assert prompt.startswith(header) and prompt.endswith(question), prompt[:200] + " ... " + prompt[-200:]
    return prompt[len(header):-len(question)]


def _needle(kind: str, key: str, value: str) -> str:
    return f"One of the special magic {kind}s for {key} is: {value}."


def test_grid_and_cells():
    assert TASKS == ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1")
    assert sum(len(GRID[t]) for t in TASKS) == 14
    assert GRID["niah_single_1"] == GRID["niah_single_2"] == (1024, 2048, 4096, 8192)
    assert GRID["niah_single_3"] == GRID["niah_multikey_1"] == (1024, 2048, 4096)
    assert cell_name("niah_single_2", 4096) == "niah_single_2@4096"
    assert parse_cell("niah_multikey_1@2048") == ("niah_multikey_1", 2048)
    for bad in ("niah_single_3@8192", "niah_single_2", "nope@1024"):
        with pytest.raises(ValueError, match="unknown RULER"):
            parse_cell(bad)


def test_sentence_splitter():
    """Blank lines are whitespace like any other (RULER collapses it before splitting): "Heading without a period"
    runs on into the next paragraph's sentence."""
    text = ("Mr. Smith went to Washington. He said \"Hello.\" Then J. R. R. Tolkien wrote e.g. books! "
            "Why? 3 more. lower case does not start one.\n\nHeading without a period\n\nNext paragraph.")
    words, starts = split_sentences(text)
    assert words == text.split()
    firsts = [words[i] for i in starts]
    assert firsts == ["Mr.", "He", "Then", "Why?", "3", "Heading"]


@pytest.mark.parametrize("task", TASKS)
def test_prompt_needles_and_depth(task, tok, kjv):
    """RULER's singular template; one needle per key at its depth, on a sentence boundary of a real window."""
    spec = ruler_samples.SPECS[task]
    hay = noise_haystack(1024) if spec.haystack == "noise" else kjv
    adjs, nouns = (set(x) for x in ruler_samples.key_words())
    for s in build_samples(task, 1024, 6, tokenizer=tok, haystack=kjv, seed=3):
        assert set(REQUIRED) <= set(s) and s["task"] == task and s["length"] == 1024
        kind = _kind(task)
        context = _context(s)
        assert len(s["keys"]) == spec.keys == len(set(s["keys"])) == len(s["values"]) == len(s["depths"])
        assert len(set(s["depths"])) == spec.keys
        assert spec.haystack == "noise" or set(s["depths"]) <= set(ruler_samples.DEPTHS)
        assert s["query"] in s["keys"]
        q = s["keys"].index(s["query"])
        assert s["answers"] == [s["values"][q]] and s["depth"] == s["depths"][q]
        for key, value in zip(s["keys"], s["values"]):
            assert any(key[:i] in adjs and key[i + 1:] in nouns for i, c in enumerate(key) if c == "-"), key
            if kind == "number":
                assert re.fullmatch(r"[1-9]\d{6}", value)
            else:
                assert uuid.UUID(value).version == 4 and str(uuid.UUID(value)) == value
            assert context.count(_needle(kind, key, value)) == 1
            assert s["prompt"].count(value) == 1
        # strip the needles: what is left is exactly the haystack window
        sep = "\n" if spec.haystack == "noise" else " "
        pieces = context.split(sep)
        needles = {_needle(kind, k, v) for k, v in zip(s["keys"], s["values"])}
        if spec.haystack == "noise":
            hay_text = [p for p in pieces if p not in needles]
            assert all(p == NOISE_LINE for p in hay_text)
            words = " ".join(hay_text).split()
        else:
            text = context
            for nd in needles:
                text = text.replace(nd, "\0")
            words = [w for w in text.split() if w != "\0"]
        w0, n = s["window_start"], s["haystack_words"]
        assert n % (25 if spec.haystack == "essay" else len(NOISE_LINE.split())) == 0
        assert words == list(hay.words[w0:w0 + n])
        before = context[:context.index(_needle(kind, s["query"], s["answers"][0]))]
        for nd in needles:
            before = before.replace(nd, "")
        assert len(before.split()) == s["offsets"][q]
        if spec.haystack == "noise":  # before a whole line, never after the last; depth = the line's share
            lines = n // len(NOISE_LINE.split())
            line, rest = divmod(s["offsets"][q], len(NOISE_LINE.split()))
            assert rest == 0 and 0 <= line < lines and s["depth"] == 100 * line // lines
            continue
        # the queried needle sits before sentence int(S * (depth / 100)) of the window, RULER's float product
        starts = [int(i) - w0 for i in hay.sentence_starts if w0 <= i < w0 + n]
        assert starts[0] == 0
        bounds = starts + [n]
        expect = bounds[int((len(bounds) - 1) * (s["depth"] / 100))]
        assert s["offsets"][q] == expect
        assert expect == n or (w0 + expect) in set(int(i) for i in hay.sentence_starts)


def _ruler_context(hay, s: dict) -> str:
    """RULER's context of a sample, built as niah.py builds it: the window's sentences, the insertion positions
    int(S * depth / 100) sorted, and [sentences, needle, sentences, ..., needle, sentences] joined by spaces."""
    w0, n = s["window_start"], s["haystack_words"]
    bounds = [int(i) - w0 for i in hay.sentence_starts if w0 <= i < w0 + n] + [n]
    sents = [" ".join(hay.words[w0 + a:w0 + b]) for a, b in zip(bounds[:-1], bounds[1:])]
    order = sorted(range(len(s["keys"])), key=lambda i: s["depths"][i])
    needles = [_needle(_kind(s["task"]), s["keys"][i], s["values"][i]) for i in order]
    at = [0, *sorted(int(len(sents) * (s["depths"][i] / 100)) for i in order), len(sents)]
    parts: list[str] = []
    for i in range(1, len(at)):
        parts.append(" ".join(sents[at[i - 1]:at[i]]))
        if i - 1 < len(needles):
            parts.append(needles[i - 1])
    return " ".join(parts)


@pytest.mark.parametrize("task", ["niah_single_2", "niah_multikey_1"])
def test_essay_prompts_are_rulers_join_of_their_window(task, tok, kjv):
    """40 samples at 1K, each prompt's context equal to RULER's construction from the same window, depths and
    needles; among them needles before the first sentence, after the last, and two at one boundary."""
    shapes = set()
    for s in build_samples(task, 1024, 40, tokenizer=tok, haystack=kjv, seed=0):
        context = _context(s)
        assert context == _ruler_context(kjv, s)
        shapes |= {name for name, seen in (("leading", context.startswith(" ")), ("trailing", context.endswith(" ")),
                                           ("double", "  " in context.strip())) if seen}
    assert shapes == ({"leading", "trailing"} if task == "niah_single_2" else {"leading", "trailing", "double"})


def test_join_shapes_are_rulers():
    """Golden contexts of a three-sentence window: RULER's list of runs and needles joined by single spaces keeps an
    empty run as an empty string, so the spaces around it stay."""
    hay = load_haystack_text("One two. Three four. Five six.")
    render = ruler_samples._render
    assert render(hay, 0, 6, [(2, "A.")]) == "One two. A. Three four. Five six."
    assert render(hay, 0, 6, [(0, "A.")]) == " A. One two. Three four. Five six."  # before the first sentence
    assert render(hay, 0, 6, [(6, "A.")]) == "One two. Three four. Five six. A. "  # after the last
    assert render(hay, 0, 6, [(2, "A."), (2, "B.")]) == "One two. A.  B. Three four. Five six."  # one boundary
    assert render(hay, 0, 6, [(0, "A."), (0, "B."), (6, "C.")]) == " A.  B. One two. Three four. Five six. C. "
    assert render(hay, 2, 4, [(4, "A."), (4, "B.")]) == "Three four. Five six. A.  B. "


def test_depth_is_rulers_float_product():
    """A needle at depth d goes before sentence int(S * (d / 100)): with S = 150 and d = 82 that is 122 (the float
    product is 122.99999999999999), where integer arithmetic would give 123."""
    hay = load_haystack_text(" ".join(f"Sentence {i}." for i in range(150)))
    assert ruler_samples._depth_offsets(hay, 0, 300, [82, 41, 100, 0]) == [2 * 122, 2 * 61, 300, 0]
    assert 150 * 82 // 100 == 123 and 150 * 41 // 100 == 61


@pytest.mark.parametrize("task,length", [("niah_single_1", 512), ("niah_single_2", 1024),
                                         ("niah_single_3", 768), ("niah_multikey_1", 1024)])
def test_fit_is_tight(task, length, tok, kjv):
    """prompt + 128 tokens fits the budget; one more step (25 essay words, one noise line) would not."""
    spec = ruler_samples.SPECS[task]
    hay = noise_haystack(length) if spec.haystack == "noise" else kjv
    step = 25 if spec.haystack == "essay" else len(NOISE_LINE.split())
    template = ruler_samples.prompt_template(task)
    for s in build_samples(task, length, 4, tokenizer=tok, haystack=kjv):
        assert s["prompt_tokens"] == len(tok.encode(s["prompt"]))
        assert s["prompt_tokens"] + 128 <= length
        texts = [_needle(_kind(task), k, v) for k, v in zip(s["keys"], s["values"])]
        needles = sorted(zip(s["offsets"], s["depths"], texts))
        if spec.haystack == "essay":  # the needles' sentences in the longer window
            wider = ruler_samples._depth_offsets(hay, s["window_start"], s["haystack_words"] + step, s["depths"])
            more_needles = sorted(zip(wider, s["depths"], texts))
        else:  # the same line: the noise lines all tokenize alike
            more_needles = needles
        more = template.format(context=ruler_samples._render(hay, s["window_start"], s["haystack_words"] + step,
                                                             [(a, t) for a, _, t in more_needles]),
                               query=s["query"])
        assert len(tok.encode(more)) + 128 > length
        same = template.format(context=ruler_samples._render(hay, s["window_start"], s["haystack_words"],
                                                             [(a, t) for a, _, t in needles]), query=s["query"])
        assert same == s["prompt"]


def test_deterministic_across_calls_orders_and_cells(tok, kjv):
    cells = [("niah_single_2", 512), ("niah_multikey_1", 768), ("niah_single_1", 512), ("niah_single_3", 512)]
    first = {c: build_samples(*c, 6, tokenizer=tok, haystack=kjv, seed=5) for c in cells}
    # reverse cell order, and each cell in two slices requested back to front
    again = {}
    for c in reversed(cells):
        tail = build_samples(*c, 4, tokenizer=tok, haystack=kjv, seed=5, start=2)
        head = build_samples(*c, 2, tokenizer=tok, haystack=kjv, seed=5, start=0)
        again[c] = head + tail
    assert again == first
    # threads do not change the samples
    assert build_samples(*cells[1], 6, tokenizer=tok, haystack=kjv, seed=5, workers=1) == first[cells[1]]
    assert build_samples(*cells[1], 6, tokenizer=tok, haystack=kjv, seed=5, workers=3) == first[cells[1]]
    assert [s["index"] for s in first[cells[0]]] == list(range(6))
    # a fresh haystack object and tokenizer give the same samples
    assert build_samples(*cells[1], 6, tokenizer=load_tokenizer("mistral-v1"), haystack=load_haystack(None),
                         seed=5) == first[cells[1]]
    # the seed and the cell change the samples
    other = build_samples(*cells[0], 6, tokenizer=tok, haystack=kjv, seed=6)
    assert all(a["answers"] != b["answers"] for a, b in zip(other, first[cells[0]]))
    longer = build_samples("niah_single_2", 768, 6, tokenizer=tok, haystack=kjv, seed=5)
    assert all(a["answers"] != b["answers"] for a, b in zip(longer, first[cells[0]]))


def test_windows_differ_between_samples(tok, kjv):
    for task in ("niah_single_2", "niah_single_3", "niah_multikey_1"):
        ss = build_samples(task, 512, 8, tokenizer=tok, haystack=kjv)
        assert len({s["window_start"] for s in ss}) == 8
        assert len({_context(s)[:200] for s in ss}) == 8
    noise = build_samples("niah_single_1", 512, 4, tokenizer=tok, haystack=None)
    assert all(s["window_start"] == 0 for s in noise)


def test_noise_haystack_is_whole_lines_with_the_needle_before_one(tok):
    """S-NIAH-1's context: whole noise lines, ending on one; the needle line is followed by at least one line."""
    for length in (512, 2048):
        for s in build_samples("niah_single_1", length, 12, tokenizer=tok, haystack=None, seed=1):
            lines = _context(s).split("\n")
            i = lines.index(_needle("number", s["query"], s["answers"][0]))
            assert lines[:i] + lines[i + 1:] == [NOISE_LINE] * (s["haystack_words"] // len(NOISE_LINE.split()))
            assert i < len(lines) - 1 and lines[-1] == NOISE_LINE
    # u in [0, 1) maps onto lines 0 .. n-1: the first line and the last, never past it
    assert ruler_samples._line_offsets([0.0, 0.5, 1 - 1e-12], 7, 19) == [0, 3 * 19, 6 * 19]


def test_tasks_at_one_length_draw_different_samples(tok, kjv):
    """The task is part of a sample's seed: two tasks at one length share no key and no value."""
    by_task = {t: build_samples(t, 1024, 4, tokenizer=tok, haystack=kjv) for t in TASKS}
    for a, b in itertools.combinations(TASKS, 2):
        for x, y in zip(by_task[a], by_task[b]):
            assert not set(x["keys"]) & set(y["keys"]) and not set(x["values"]) & set(y["values"]), (a, b)


def test_bad_input_one_line_errors(tmp_path, tok, kjv):
    short = tmp_path / "short.txt"
    short.write_text(" ".join(f"Word{i} here." for i in range(100)))
    cases = [
        (dict(task="niah_single_9", length=1024), "unknown RULER task"),
        (dict(task="niah_single_2", length=1024, haystack=load_haystack(str(short))), "too short"),
        (dict(task="niah_single_2", length=150), "below the template's own length"),
        (dict(task="niah_single_1", length=200), "below the template's own length"),
        (dict(task="niah_single_2", length=1024, haystack=None), "needs an essay haystack"),
        (dict(task="niah_single_2", length=0), "length=0"),
    ]
    for kw, msg in cases:
        kw.setdefault("haystack", kjv)
        with pytest.raises(ValueError, match=msg) as err:
            build_samples(kw.pop("task"), kw.pop("length"), 2, tokenizer=tok, **kw)
        assert "\n" not in str(err.value)


def test_scorer_edge_cases():
    assert postprocess("  \x00The Value\tis 12\x1f\n ") == "The Value\nis 12"
    assert postprocess("") == ""
    assert string_match_all([" The special magic number is 1234567."], [["1234567"]]) == 100.0
    assert string_match_all(["ABC-def"], [["abc-DEF"]]) == 100.0  # case-insensitive
    assert string_match_all(["1234\x00567"], [["1234567"]]) == 0.0  # control chars become newlines
    assert string_match_all(["a 1 b 2"], [["1", "2", "3", "4"]]) == 50.0  # fraction of several refs
    assert string_match_all(["", "   \n"], [["1234567"], ["7654321"]]) == 0.0  # empty predictions
    assert string_match_all(["x 1", "y", "z"], [["1"], ["2"], ["3"]]) == 33.33  # rounded as RULER reports
    for preds, refs, msg in ((["a"], [], "1 predictions for 0"), ([], [], "no predictions"),
                             (["a"], [[]], "non-empty list"), (["a"], ["a"], "non-empty list")):
        with pytest.raises(ValueError, match=msg):
            string_match_all(preds, refs)


def test_cli_writes_jsonl(tmp_path):
    out = tmp_path / "cells" / "s2.jsonl"
    generate_main(["task=niah_single_2", "length=512", "n=3", f"out={out}", "seed=1"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert set(REQUIRED) <= set(r) and r["task"] == "niah_single_2" and r["length"] == 512
        assert isinstance(r["answers"], list) and r["answers"][0] in r["prompt"]
        assert r["prompt_tokens"] + 128 <= 512 and r["haystack_words"] > 0
    assert sorted(p.name for p in out.parent.iterdir()) == ["s2.jsonl"]
    res = subprocess.run([sys.executable, "-m", "eval.ruler.generate", "task=niah_x", "length=512", "n=1",
                          f"out={tmp_path / 'x.jsonl'}"], capture_output=True, text=True)
    assert res.returncode != 0 and res.stderr.strip().count("\n") == 0 and "unknown RULER task" in res.stderr
    with pytest.raises(ValueError, match=r"^size: unknown key \(valid keys: haystack, length, max_new_tokens, n, "):
        generate_main(["task=niah_single_2", "size=512", "n=3", f"out={out}"])
    with pytest.raises(ValueError, match=r"^lenght: unknown key \(did you mean 'length'\?\)$"):
        generate_main(["task=niah_single_2", "lenght=512", "n=3", f"out={out}"])
    with pytest.raises(ValueError, match=r"^length: missing; give length=\.\.\.$"):
        generate_main(["task=niah_single_2", "n=3", f"out={out}"])
    with pytest.raises(ValueError, match=r"^n='3x' is not an int"):
        generate_main(["task=niah_single_2", "length=512", "n=3x", f"out={out}"])


def test_samples_are_not_degenerate(tok, kjv):
    """Depths, keys and values spread over their ranges: no two samples of a cell share a generator state."""
    ss = build_samples("niah_single_2", 256, 40, tokenizer=tok, haystack=kjv)
    depths = np.array([s["depth"] for s in ss])
    assert len(set(depths.tolist())) >= 20 and depths.min() <= 10 and depths.max() >= 90
    assert len({s["query"] for s in ss}) == 40 and len({s["answers"][0] for s in ss}) == 40
