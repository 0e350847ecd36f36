"""The essay haystack by name: RULER's essays JSON, the hub dataset through `datasets`, plain text, the KJV; its
recorded identity; and one-line errors naming both fixes when the essays cannot be reached."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import datasets
import pytest

from data.tokenizer import load_tokenizer
from eval.ruler import build_samples, load_haystack
from eval.ruler.haystack import ESSAYS_DATASET, HaystackUnavailable

ESSAYS = [" ".join(f"Essay {e} sentence {i} says a few plain words." for i in range(150)) for e in range(3)]
FIXES = ("ruler.haystack=/path/PaulGrahamEssays.json", "ruler.haystack=kjv")


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


def test_ruler_essays_json_other_json_and_text(tmp_path: Path) -> None:
    text = "\n\n".join(ESSAYS)
    ruler_file = tmp_path / "PaulGrahamEssays.json"
    ruler_file.write_text(json.dumps({"text": text}))
    other = tmp_path / "mine.json"
    other.write_text(json.dumps({"text": text}))
    plain = tmp_path / "mine.txt"
    plain.write_text(text)
    a, b, c = (load_haystack(str(p)) for p in (ruler_file, other, plain))
    assert a.words == b.words == c.words == tuple(text.split())
    assert len(a.sentence_starts) == 450 and int(a.sentence_starts[150]) == len(ESSAYS[0].split())
    assert a.describe() == {"name": "essays", "source": str(ruler_file), "paper": True,
                            "sha256": hashlib.sha256(ruler_file.read_bytes()).hexdigest()}
    assert b.describe() == {"name": "file", "source": str(other), "paper": False,
                            "sha256": hashlib.sha256(other.read_bytes()).hexdigest()}
    assert (c.name, c.paper, c.sha256) == ("file", False, hashlib.sha256(plain.read_bytes()).hexdigest())
    s = build_samples("niah_single_2", 512, 2, tokenizer=load_tokenizer("mistral-v1"), haystack=a)
    assert s[0]["prompt_tokens"] + 128 <= 512 and s[0]["answers"][0] in s[0]["prompt"]


@pytest.mark.parametrize("spec", ["essays", "paul_graham", f"hub:{ESSAYS_DATASET}"])
def test_hub_essays_load_through_datasets(spec: str, hub: list[tuple[str, str]]) -> None:
    h = load_haystack(spec)
    assert hub == [(ESSAYS_DATASET, "train")]
    text = "\n\n".join(ESSAYS)  # one essay per row, each starting a sentence
    assert h.words == tuple(text.split()) and int(h.sentence_starts[300]) == 2 * len(ESSAYS[0].split())
    assert h.describe() == {"name": "essays", "source": f"hub:{ESSAYS_DATASET}", "paper": True,
                            "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest()}


def test_other_hub_dataset_is_not_the_papers(hub: list[tuple[str, str]]) -> None:
    h = load_haystack("hub:someone/texts")
    assert hub == [("someone/texts", "train")] and (h.name, h.paper, h.source) == ("hub", False, "hub:someone/texts")


def test_kjv_by_name() -> None:
    k = load_haystack("kjv")
    assert (k.name, k.paper) == ("kjv", False) and "King James" in k.source and len(k) > 700_000
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
