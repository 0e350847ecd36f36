"""The essay haystack: RULER's essays recognised by their text (never by the file's name), the hub dataset through
`datasets`, plain text, the KJV; its recorded identity (name, file, size, SHA-256, documents, what makes it the
paper's); whitespace as RULER collapses it; and one-line errors naming both fixes when the essays cannot be
reached."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import datasets
import pytest

from data.tokenizer import load_tokenizer
from eval.ruler import build_samples, essays, haystack, load_haystack
from eval.ruler.haystack import ESSAYS_DATASET, HaystackUnavailable, haystack_from_text

ESSAYS = [" ".join(f"Essay {e} sentence {i} says a few plain words." for i in range(150)) for e in range(3)]
FIXES = ("ruler.haystack=/path/PaulGrahamEssays.json", "ruler.haystack=kjv")


OPENING_ESSAYS = ("July 2010What hard questions do essays ask?\nThey ask plenty.", "Another essay begins here. ")


def essay_table(texts: tuple[str, ...]) -> tuple[tuple[str, int, str], ...]:
    return tuple((f"e{i}.txt", len(t), hashlib.sha256(t.encode("utf-8")).hexdigest()) for i, t in enumerate(texts))


@pytest.fixture
def ruler_opening(monkeypatch: pytest.MonkeyPatch) -> str:
    """Stands in for the 49 gkamradt essays that open RULER's file: the check's essays become these two, and the
    opening they make in RULER's sorted order is returned."""
    monkeypatch.setattr(essays, "GKAMRADT_ESSAYS", essay_table(OPENING_ESSAYS))
    return "".join(OPENING_ESSAYS)


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """`datasets.load_dataset` serving a parquet fixture through `datasets` itself; returns the calls made."""
    data = tmp_path / "essays.parquet"
    datasets.Dataset.from_dict({"text": ESSAYS, "title": [f"t{e}" for e in range(3)]}).to_parquet(str(data))
    real = datasets.load_dataset
    calls: list[tuple[str, str]] = []

    def load(name: str, split: str) -> datasets.Dataset:
        calls.append((name, split))
        return real("parquet", data_files=str(data), split=split, cache_dir=str(tmp_path / "cache"))

    monkeypatch.setattr(datasets, "load_dataset", load)
    return calls


def test_ruler_essays_are_recognised_by_their_text_not_their_name(tmp_path: Path, ruler_opening: str) -> None:
    text = ruler_opening + "\n\n".join(ESSAYS)
    ruler_file = tmp_path / "PaulGrahamEssays.json"
    ruler_file.write_text(json.dumps({"text": text}))
    renamed = tmp_path / "mine.json"
    renamed.write_text(json.dumps({"text": text}))
    plain = tmp_path / "mine.txt"
    plain.write_text(text)
    named_only = tmp_path / "other" / "PaulGrahamEssays.json"  # RULER's name, not its text
    named_only.parent.mkdir()
    named_only.write_text(json.dumps({"text": "\n\n".join(ESSAYS)}))
    a, b, c = (load_haystack(str(p)) for p in (ruler_file, renamed, plain))
    with pytest.warns(UserWarning, match="has the name of RULER's essays file but not its text"):
        d = load_haystack(str(named_only))
    assert a.words == b.words == c.words == tuple(text.split())
    check = a.describe()["check"]
    assert check.startswith("opens with the 2 essays of gkamradt/LLMTest_NeedleInAHaystack in RULER's sorted order")
    assert a.describe() == {"name": "essays", "source": str(ruler_file), "file": "PaulGrahamEssays.json",
                            "bytes": ruler_file.stat().st_size, "documents": None, "paper": True, "check": check,
                            "sha256": hashlib.sha256(ruler_file.read_bytes()).hexdigest()}
    assert (b.name, b.paper, b.file, c.name, c.paper, c.file) == ("essays", True, "mine.json", "essays", True,
                                                                  "mine.txt")
    assert d.describe() == {"name": "file", "source": str(named_only), "file": "PaulGrahamEssays.json",
                            "bytes": named_only.stat().st_size, "documents": None, "paper": False, "check": None,
                            "sha256": hashlib.sha256(named_only.read_bytes()).hexdigest()}
    only_opening = tmp_path / "opening.txt"  # the opening alone is not RULER's file: its other essays are missing
    only_opening.write_text(ruler_opening)
    assert not load_haystack(str(only_opening)).paper
    s = build_samples("niah_single_2", 512, 2, tokenizer=load_tokenizer("mistral-v1"), haystack=a)
    assert s[0]["prompt_tokens"] + 128 <= 512 and s[0]["answers"][0] in s[0]["prompt"]


def test_the_real_opening_is_required_and_a_paper_haystack_says_why(tmp_path: Path) -> None:
    """Without the reference swapped for a fixture, a made-up essays file is not RULER's; and no code path can call
    a haystack the paper's without saying what identifies it."""
    fake = tmp_path / "PaulGrahamEssays.json"
    fake.write_text(json.dumps({"text": "July 2010What hard liquor, cigarettes, heroin. " * 20_000}))
    with pytest.warns(UserWarning, match="not the paper's haystack"):
        h = load_haystack(str(fake))
    assert (h.name, h.paper, h.check) == ("file", False, None)
    table = essays.GKAMRADT_ESSAYS
    assert haystack.RULER_OPENING_ESSAYS == len({name for name, _, _ in table}) == 49
    assert sum(chars for _, chars, _ in table) == 643_830 and [n for n, _, _ in table] == sorted(n for n, _, _ in table)
    assert len({digest for _, _, digest in table}) == 49
    with pytest.raises(ValueError, match="without a check"):
        haystack_from_text("Some words here.", "x", "00", paper=True)


def test_whitespace_is_collapsed_before_sentences_are_split() -> None:
    """RULER replaces every run of whitespace with one space before sentence splitting: a line break or a blank line
    (an essay's title or date line) ends no sentence by itself."""
    h = haystack_from_text("How to Start\n\nMarch 2005\n\nYou need three things.\n\nThen more. And  more.", "t", "00")
    assert h.words == ("How", "to", "Start", "March", "2005", "You", "need", "three", "things.", "Then", "more.",
                       "And", "more.")
    assert [h.words[i] for i in h.sentence_starts] == ["How", "Then", "And"]


@pytest.mark.parametrize("spec", ["essays", "paul_graham", f"hub:{ESSAYS_DATASET}"])
def test_hub_essays_load_through_datasets(spec: str, hub: list[tuple[str, str]]) -> None:
    h = load_haystack(spec)
    assert hub == [(ESSAYS_DATASET, "train")]
    text = " ".join(ESSAYS)  # one essay per row, joined by spaces as lm-eval's RULER port joins them
    assert h.words == tuple(text.split()) and int(h.sentence_starts[300]) == 2 * len(ESSAYS[0].split())
    assert h.describe() == {"name": "essays", "source": f"hub:{ESSAYS_DATASET}", "file": None,
                            "bytes": len(text.encode("utf-8")), "documents": 3, "paper": True,
                            "check": f"the hub dataset {ESSAYS_DATASET}, which lm-eval's RULER port reads (identified "
                                     "by its name)", "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest()}


def test_other_hub_dataset_is_not_the_papers(hub: list[tuple[str, str]]) -> None:
    h = load_haystack("hub:someone/texts")
    assert hub == [("someone/texts", "train")] and (h.name, h.paper, h.source) == ("hub", False, "hub:someone/texts")
    assert (h.check, h.documents) == (None, 3)


def test_kjv_by_name() -> None:
    k = load_haystack("kjv")
    assert (k.name, k.paper, k.check, k.file, k.documents) == ("kjv", False, None, None, 1189)
    assert "King James" in k.source and len(k) > 700_000
    assert load_haystack(None).describe() == k.describe()


def test_unreachable_essays_name_both_fixes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def offline(name: str, split: str) -> None:
        raise ConnectionError(f"Couldn't reach '{name}' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    for spec, why in (("essays", "OfflineModeIsEnabled"), (str(tmp_path / "PaulGrahamEssays.json"), "does not exist")):
        with pytest.raises(HaystackUnavailable) as err:
            load_haystack(spec)
        msg = str(err.value)
        assert "\n" not in msg and why in msg and all(fix in msg for fix in FIXES), msg


def test_offline_without_a_cache_names_both_fixes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`datasets` itself, offline, with empty caches: the essays are unreachable, and the error says what to do."""
    import huggingface_hub

    for env in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(env, "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    with pytest.raises(HaystackUnavailable) as err:
        load_haystack("essays")
    assert "\n" not in str(err.value) and all(fix in str(err.value) for fix in FIXES), err.value


def test_bad_haystacks_one_line_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    no_text = tmp_path / "PaulGrahamEssays.json"
    no_text.write_text(json.dumps({"body": ESSAYS[0]}))
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n ")
    for path, msg in ((no_text, 'no string under "text"'), (broken, "not valid JSON"), (empty, "has no words")):
        with pytest.raises(ValueError, match=msg) as err:
            load_haystack(str(path))
        assert "\n" not in str(err.value)
    monkeypatch.setattr(datasets, "load_dataset", lambda name, split: datasets.Dataset.from_dict({"body": ["a b"]}))
    with pytest.raises(ValueError, match="has no string field 'text'"):
        load_haystack("essays")


def test_the_essays_are_accepted_in_either_of_rulers_orders_and_a_refusal_says_what_was_found(
        tmp_path: Path, ruler_opening: str) -> None:
    rest = "\n\n".join(ESSAYS)
    first, second = OPENING_ESSAYS
    older = tmp_path / "older.txt"  # a download made before RULER sorted its file list: same essays, other order
    older.write_text(second + first + rest)
    h = load_haystack(str(older))
    assert h.paper and h.name == "essays"
    assert h.check.startswith("opens with the 2 essays of gkamradt/LLMTest_NeedleInAHaystack in another order than "
                              "RULER's sorted one")
    cases = {  # text -> what the warning must say was found
        ruler_opening: "it holds the 2 gkamradt essays and nothing after them: the download got none of "
                       "paulgraham.com's essays",
        first + "Another essay begins HERE. " + rest: f"it opens with 1 of the 2 gkamradt essays RULER's download puts "
                                                     f"first, then differs from every other one at character "
                                                     f"{len(first)}",
        first + first + rest: f"it opens with 1 of the 2 gkamradt essays RULER's download puts first, then differs "
                              f"from every other one at character {len(first)}",
        rest: "it does not open with any of the 2 gkamradt essays RULER's download puts first",
    }
    for i, (text, found) in enumerate(cases.items()):
        named = tmp_path / str(i) / "PaulGrahamEssays.json"
        named.parent.mkdir()
        named.write_text(json.dumps({"text": text}))
        with pytest.warns(UserWarning) as caught:
            h = load_haystack(str(named))
        assert not h.paper and h.check is None
        assert [str(w.message) for w in caught] == [
            f"{named} has the name of RULER's essays file but not its text ({found}): it is recorded as an ordinary "
            "file, not the paper's haystack; download it again with RULER's script"]


def test_a_haystack_directory_is_refused_as_a_directory(tmp_path: Path) -> None:
    with pytest.raises(HaystackUnavailable) as refusal:
        load_haystack(str(tmp_path))
    assert str(refusal.value) == (f"haystack {tmp_path} is a directory, not a file; give the file itself (e.g. "
                                  f"ruler.haystack={tmp_path / 'PaulGrahamEssays.json'}) or ruler.haystack=kjv")
