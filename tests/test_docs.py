"""The docs say what holds now: the README's speed figures are the results docs' figures, every repository path the
docs name exists, and every doc is reachable from the README or a docs index."""
from __future__ import annotations

import fnmatch
import glob
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# A speed figure: a ratio ("1.010x"), a percentage (MFU), a throughput or a time.
FIGURE = re.compile(r"(?<![\w.])(\d[\d,]*(?:\.\d+)?)(x\b|%|\s?[MK]?\s?tokens/s\b|\sms\b)")
# A backticked name that starts at a top-level entry of the repository.
TOP = ("bench", "common", "conf", "data", "docs", "eval", "kdn", "models", "scripts", "slurm", "tests", "trainer",
       "train.py", "evaluate.py", "pyproject.toml")
TICKED = re.compile(r"`((?:" + "|".join(re.escape(t) for t in TOP) + r")(?:/[^`\s]*)?)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def docs() -> list[Path]:
    """README.md and every Markdown file under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def speed_figures(text: str) -> list[str]:
    """Each speed figure of ``text`` as written (number and unit, whitespace collapsed)."""
    return [" ".join((num + unit).split()) for num, unit in FIGURE.findall(text)]


def in_results(figure: str, results: str) -> bool:
    """Whether ``figure`` appears in ``results``: a ratio as its number (tables give ratios without the x), the
    others with their unit."""
    num = re.match(r"[\d,.]+", figure).group(0)
    unit = figure[len(num):].strip()
    if unit == "x":
        return re.search(rf"(?<![\d.]){re.escape(num)}(?![\d])", results) is not None
    return re.search(rf"(?<![\d.]){re.escape(num)}\s?{re.escape(unit)}", results) is not None


def missing_figures(readme: str, results: str) -> list[str]:
    """The README's speed figures that no results doc holds."""
    return [f for f in speed_figures(readme) if not in_results(f, results)]


def expand(name: str) -> list[str]:
    """``name`` with its ``{a,b}`` alternatives spelled out (one level, as the docs write them)."""
    m = re.search(r"\{([^{}]*)\}", name)
    if m is None:
        return [name]
    return [x for alt in m.group(1).split(",") for x in expand(name[:m.start()] + alt + name[m.end():])]


def named_paths(text: str) -> list[str]:
    """Repository paths named in backticks in ``text``, without line numbers, test ids or a trailing colon."""
    out = []
    for name in TICKED.findall(text):
        name = re.split(r"::|:\d", name)[0].rstrip(":.,;)")
        if "$" in name or "<" in name:
            continue  # a template, not a path
        out += expand(name)
    return out


def ignored(name: str) -> bool:
    """Whether git ignores ``name`` or a folder above it (``.gitignore``'s patterns): a run's output or a local file,
    which a fresh clone does not have."""
    rules = [r.strip().strip("/") for r in (ROOT / ".gitignore").read_text().splitlines()
             if r.strip() and not r.startswith("#")]
    parts = Path(name).parts
    heads = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return any(fnmatch.fnmatch(h, r) or fnmatch.fnmatch(Path(h).name, r) for h in heads for r in rules)


def missing_paths(text: str, doc: Path) -> list[str]:
    """The paths ``text`` (the text of ``doc``) names, in backticks or as relative Markdown links, that do not exist
    (outputs and local files that git ignores aside)."""
    bad = [n for n in named_paths(text) if not glob.glob(str(ROOT / n)) and not ignored(n)]
    for target in LINK.findall(text):
        target = target.split("#")[0]
        if target and "://" not in target and not target.startswith("mailto:"):
            if not (doc.parent / target).exists():
                bad.append(target)
    return bad


def linked_docs(index: Path, text: str) -> set[Path]:
    """The files that the relative Markdown links of ``index`` (its text ``text``) point to."""
    return {(index.parent / t.split("#")[0]).resolve() for t in LINK.findall(text) if "://" not in t
            and t.split("#")[0]}


def unlinked(texts: dict[Path, str]) -> list[Path]:
    """Docs under docs/ that neither the README nor a docs index (a README.md or index.md under docs/) links."""
    indexes = [p for p in texts if p == ROOT / "README.md" or p.name in ("README.md", "index.md")]
    reached = set().union(*(linked_docs(p, texts[p]) for p in indexes))
    return [p for p in texts if p != ROOT / "README.md" and p.resolve() not in reached]


def results_text() -> str:
    return "\n".join(p.read_text() for p in sorted((ROOT / "docs" / "results").glob("*.md")))


def test_readme_speed_figures_are_in_the_results_docs() -> None:
    readme = (ROOT / "README.md").read_text()
    assert speed_figures(readme), "the README quotes no speed figure; the pattern no longer matches its sentences"
    assert missing_figures(readme, results_text()) == []


def test_a_made_up_readme_figure_is_caught() -> None:
    readme = (ROOT / "README.md").read_text() + "\nThe 750M Diagonal KDN trains at 1.234x KDA, 48.6% MFU.\n"
    assert missing_figures(readme, results_text()) == ["1.234x", "48.6%"]


@pytest.mark.parametrize("doc", docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_named_path_exists(doc: Path) -> None:
    assert missing_paths(doc.read_text(), doc) == []


def test_a_wrong_path_is_caught() -> None:
    doc = ROOT / "docs" / "kernels.md"
    text = "The reference is `kdn/naive.py`, the results `bench/results/{norm,nope}_throughput.json`; see [x](gone.md)."
    assert missing_paths(text, doc) == ["kdn/naive.py", "bench/results/nope_throughput.json", "gone.md"]


def test_every_doc_is_linked_from_the_readme_or_an_index() -> None:
    assert unlinked({p: p.read_text() for p in docs()}) == []


def test_an_unlinked_doc_is_caught() -> None:
    texts = {p: p.read_text() for p in docs()}
    texts[ROOT / "docs" / "orphan.md"] = "# Nobody links this\n"
    assert unlinked(texts) == [ROOT / "docs" / "orphan.md"]
