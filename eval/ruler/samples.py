"""The modified RULER needle tasks (docs/protocol.md §9): task definitions, prompts, and the sample builder.

The tasks, needle, prompt template, answer prefix and depths are NVIDIA/RULER's (`scripts/synthetic.yaml`,
`scripts/data/synthetic/niah.py`, base-model template, no chat wrapper). Two changes to the essay tasks, as in
the paper:

- the essay haystack grows in 25-word steps up to the largest size whose prompt plus `max_new_tokens` fits the
  cell's token budget, found with exact token counts. RULER's current code binary-searches the size one word at a
  time; its earlier code grew essays in 500-word steps, as lm-eval's port still does;
- the essay haystack is a window of the corpus that starts at a random sentence, different per sample
  (RULER: always the corpus's first words).

S-NIAH-1's noise haystack is RULER's: whole lines of `NOISE_LINE` joined by newlines, as many as fit (one more
line would not), and the needle goes before a line drawn uniformly from them, never after the last one. In the
essays, needles go between sentences and are joined with them as RULER joins them (`_render`), spaces included.

Every sample draws from its own generator, `np.random.default_rng([seed, task_id, length, index])`, so a sample
is the same whatever the call order, the slice (`start`, `n`) and the other cells requested.
"""
from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

import numpy as np

from eval.ruler.haystack import Haystack, noise_haystack

TASKS: tuple[str, ...] = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1")
GRID: dict[str, tuple[int, ...]] = {
    "niah_single_1": (1024, 2048, 4096, 8192),
    "niah_single_2": (1024, 2048, 4096, 8192),
    "niah_single_3": (1024, 2048, 4096),
    "niah_multikey_1": (1024, 2048, 4096),
}
INCREMENT = 25  # essay haystack words added per step of the length fit (the noise haystack grows by lines)
MAX_NEW_TOKENS = 128
# each task's definition version: raised when its prompts, answers or scoring change, so that results files'
# cells of the older definition are computed again, not reused
VERSIONS: dict[str, float] = {task: 1.0 for task in TASKS}
# RULER's needle depths: 40 evenly spaced percentages
DEPTHS: tuple[int, ...] = tuple(int(d) for d in np.round(np.linspace(0, 100, num=40, endpoint=True)))

# RULER's niah template + answer prefix, in its plural form; `_singular` rewrites it as RULER does for one value
TEMPLATE = ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
            "I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
            "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?")
ANSWER_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
_TOKENS_PER_WORD_PROBE = 500  # words tokenized to estimate the window's tokens per word


@dataclass(frozen=True)
class TaskSpec:
    """One needle task: haystack kind, value kind, number of needles (each with its own key; one queried)."""

    haystack: str  # "noise" or "essay"
    value: str  # "numbers" (7 digits) or "uuids"
    keys: int


SPECS: dict[str, TaskSpec] = {
    "niah_single_1": TaskSpec("noise", "numbers", 1),
    "niah_single_2": TaskSpec("essay", "numbers", 1),
    "niah_single_3": TaskSpec("essay", "uuids", 1),
    "niah_multikey_1": TaskSpec("essay", "numbers", 4),
}


def cell_name(task: str, length: int) -> str:
    """The cell's key in results files, e.g. `niah_single_2@4096`."""
    return f"{task}@{length}"


def parse_cell(name: str) -> tuple[str, int]:
    """`(task, length)` of a grid cell name such as `niah_single_2@4096`; unknown cells are refused."""
    task, _, length = name.partition("@")
    check_task(task)
    if not length.isdigit() or int(length) not in GRID[task]:
        cells = ", ".join(cell_name(task, n) for n in GRID[task])
        raise ValueError(f"unknown RULER cell {name!r}; the grid's cells for {task} are {cells}")
    return task, int(length)


def check_task(task: str) -> TaskSpec:
    """The task's spec; an unknown name is refused with the list of tasks."""
    if task not in SPECS:
        raise ValueError(f"unknown RULER task {task!r}; choose one of {', '.join(TASKS)}")
    return SPECS[task]


def _singular(template: str) -> str:
    """RULER's rewrite of the template when one value is asked for (one query, one value per key)."""
    return (template.replace("Some", "A").replace("are all", "is").replace("are", "is")
            .replace("answers", "answer"))


def prompt_template(task: str) -> str:
    """The task's full prompt with `{context}` and `{query}` left to fill (ends with the answer prefix)."""
    spec = check_task(task)
    kind = spec.value[:-1]  # one query, one value per key: RULER's singular form throughout
    return _singular(TEMPLATE + ANSWER_PREFIX).replace("{type_needle_v}", kind)


@lru_cache(maxsize=1)
def key_words() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """wonderwords' adjective and noun lists (sorted, de-duplicated); keys are `adjective-noun`."""
    def read(name: str) -> tuple[str, ...]:
        text = resources.files("wonderwords.assets").joinpath(name).read_text(encoding="utf-8")
        return tuple(sorted({w.strip() for w in text.splitlines() if w.strip()}))

    return read("adjectivelist.txt"), read("nounlist.txt")


def _value(rng: np.random.Generator, kind: str) -> str:
    if kind == "numbers":
        return str(int(rng.integers(10**6, 10**7)))
    return str(uuid.UUID(int=int.from_bytes(rng.bytes(16), "big"), version=4))


def _depth_offsets(hay: Haystack, start: int, n_words: int, depths: list[int]) -> list[int]:
    """Word offsets in the window (`n_words` words from `start`) of needles at `depths` percent.

    A window of S sentences (a partial first or last one counts) has boundaries b_0 = 0 < ... < b_S = n_words;
    a needle at depth d goes before sentence `int(S * (d / 100))`, RULER's floating-point product (one less than
    floor(S * d / 100) where it rounds down, e.g. S = 150, d = 82: 122, not 123).
    """
    s = hay.sentence_starts
    lo, hi = np.searchsorted(s, [start, start + n_words], side="left")
    rel = [int(x) - start for x in s[lo:hi]]
    if not rel or rel[0] != 0:
        rel.insert(0, 0)
    bounds = rel + [n_words]
    n_sent = len(bounds) - 1
    return [bounds[int(n_sent * (d / 100))] for d in depths]


def _line_offsets(fractions: list[float], lines: int, line_words: int) -> list[int]:
    """Word offsets of needles that go before line floor(u * lines) of the noise text, one per u in [0, 1).

    For uniform u this is a uniform draw from range(lines), as RULER draws a needle's line: never after the last.
    """
    return [line_words * int(u * lines) for u in fractions]


def _render(hay: Haystack, start: int, n_words: int, needles: list[tuple[int, str]]) -> str:
    """The context: `n_words` haystack words from `start`, each `(offset, needle)` before window word `offset`
    (needles at one offset keep their order in `needles`).

    Essays are joined as RULER joins them: the runs of sentences between needles and the needles alternate in one
    list joined by spaces, a run with no sentence being an empty string; so a needle before the first sentence
    leaves a leading space, one after the last a trailing space, and two needles at one boundary are two spaces
    apart. Noise lines and needles are lines joined by newlines (a needle is inserted before a line)."""
    placed = sorted(needles, key=lambda x: x[0])
    if hay.line_words is None:
        cuts = [0, *(offset for offset, _ in placed), n_words]
        parts = [_segment(hay, start + cuts[0], start + cuts[1])]
        for i, (_, text) in enumerate(placed):
            parts += [text, _segment(hay, start + cuts[i + 1], start + cuts[i + 2])]
        return " ".join(parts)
    parts = []
    prev = 0
    for offset, text in placed:
        if offset > prev:
            parts.append(_segment(hay, start + prev, start + offset))
        parts.append(text)
        prev = offset
    if n_words > prev:
        parts.append(_segment(hay, start + prev, start + n_words))
    return "\n".join(parts)


def _segment(hay: Haystack, a: int, b: int) -> str:
    """Haystack words a..b-1 as text: spaces between words, and newlines between lines of the noise text."""
    if hay.line_words is None:
        return " ".join(hay.words[a:b])
    w = hay.line_words
    cuts = [a, *range(a - a % w + w, b, w), b]
    return "\n".join(" ".join(hay.words[x:y]) for x, y in zip(cuts[:-1], cuts[1:]))


def _largest_fit(n_tokens: Callable[[int], int], avail: int, k_max: int, guess: int) -> int:
    """Largest k in [1, k_max] with n_tokens(k) <= avail, given n_tokens(1) <= avail and n_tokens rising in k.

    Searches outward from `guess` by doubling steps, then bisects; the answer k satisfies
    n_tokens(k) <= avail and (k == k_max or n_tokens(k + 1) > avail), both evaluated.
    """
    def fits(k: int) -> bool:
        return k <= 1 or (k <= k_max and n_tokens(k) <= avail)

    g = min(max(guess, 1), k_max)
    if fits(g):
        lo, step = g, 1
        while lo < k_max and fits(lo + step):
            lo += step
            step *= 2
        hi = min(lo + step, k_max + 1)
    else:
        hi, step = g, 1
        while not fits(max(hi - step, 1)):
            hi = max(hi - step, 1)
            step *= 2
        lo = max(hi - step, 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _check_int(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")


def build_samples(task: str, length: int, n: int, *, tokenizer, haystack: Haystack | None, seed: int = 0,
                  start: int = 0, max_new_tokens: int = MAX_NEW_TOKENS, workers: int | None = None) -> list[dict]:
    """Samples `start .. start + n - 1` of the cell (task, length), each from its own RNG.

    Args:
        task: one of `TASKS`.
        length: the cell's token budget; prompt tokens + `max_new_tokens` <= length (any length >= the
            template's own size is accepted; the paper's grid is `GRID`).
        n: number of samples.
        tokenizer: a `data.tokenizer.Tokenizer` (only `encode_batch` is used; counts exclude BOS/EOS).
        haystack: the essay haystack (`load_haystack`); `niah_single_1` uses RULER's noise text instead.
        seed: the evaluation seed; with (task, length, index) it determines each sample.
        start: index of the first sample.
        max_new_tokens: tokens reserved for the answer.
        workers: threads that build samples concurrently (default: min(8, CPU count)); the samples do not
            depend on it. Tokenizing dominates the time, and SentencePiece releases the GIL while it runs.

    Returns:
        One dict per sample: task, length, index, seed, prompt (ending with the answer prefix), answers
        (list[str]), depth (percent, of the queried needle; for the noise text, its line's share of the lines),
        haystack_words, prompt_tokens, keys, values, depths (one per needle), query (the queried key),
        window_start (first haystack word), offsets (per needle, the haystack words before it in the window).
    """
    spec = check_task(task)
    _check_int("length", length, 1)
    _check_int("n", n, 0)
    _check_int("start", start, 0)
    _check_int("seed", seed, 0)
    _check_int("max_new_tokens", max_new_tokens, 1)
    if spec.haystack == "noise":
        hay = noise_haystack(length)
    elif haystack is None:
        raise ValueError(f"task {task} needs an essay haystack: pass haystack=load_haystack(path), "
                         "or load_haystack(None) for the built-in text")
    else:
        hay = haystack
    task_id = TASKS.index(task)
    threads = min(8, os.cpu_count() or 1) if workers is None else workers
    _check_int("workers", threads, 1)

    def one(i: int) -> dict:
        return _sample(task, task_id, spec, hay, int(length), i, int(seed), int(max_new_tokens), tokenizer)

    if threads == 1 or n <= 1:
        return [one(i) for i in range(start, start + n)]
    with ThreadPoolExecutor(min(threads, n)) as pool:
        return list(pool.map(one, range(start, start + n)))


def _sample(task: str, task_id: int, spec: TaskSpec, hay: Haystack, length: int, index: int, seed: int,
            max_new_tokens: int, tokenizer) -> dict:
    """Sample `index` of the cell: draws (keys, values, depths, query, window), then fits the haystack size."""
    rng = np.random.default_rng([seed, task_id, length, index])
    adjs, nouns = key_words()
    keys: list[str] = []
    while len(keys) < spec.keys:
        key = f"{adjs[int(rng.integers(len(adjs)))]}-{nouns[int(rng.integers(len(nouns)))]}"
        if key not in keys:
            keys.append(key)
    values: list[str] = []
    while len(values) < spec.keys:  # distinct, so the queried value names one needle
        value = _value(rng, spec.value)
        if value not in values:
            values.append(value)
    if hay.line_words is None:
        depths = [DEPTHS[int(i)] for i in rng.choice(len(DEPTHS), size=spec.keys, replace=False)]
    else:  # each needle's u in [0, 1) picks its line once the number of lines is known
        fractions = [float(u) for u in rng.random(spec.keys)]
    q = int(rng.integers(spec.keys))
    texts = [NEEDLE.format(type_needle_v=spec.value, key=k, value=v) for k, v in zip(keys, values)]

    # essays grow by words, the noise text by whole lines; the window may hold up to `length` words: each word is
    # at least one token, so that is more than fits
    step = INCREMENT if hay.line_words is None else hay.line_words
    unit = f"{INCREMENT}-word step" if hay.line_words is None else "line"
    k_max = min(length, len(hay)) // step
    cell = cell_name(task, length)
    if k_max == 0:
        raise ValueError(f"haystack {hay.source} has {len(hay)} words, fewer than one {unit}; "
                         f"give a longer haystack file for {cell}")
    window = step * k_max
    if hay.line_words is None:
        candidates = int(np.searchsorted(hay.sentence_starts, len(hay) - window, side="right"))
        w0 = int(hay.sentence_starts[int(rng.integers(candidates))])
        order = sorted(range(spec.keys), key=lambda i: depths[i])  # needles at one sentence: shallower first

        def offsets(k: int) -> list[int]:
            return _depth_offsets(hay, w0, step * k, depths)
    else:
        w0 = 0
        order = sorted(range(spec.keys), key=lambda i: fractions[i])

        def offsets(k: int) -> list[int]:
            return _line_offsets(fractions, k, step)
    template = prompt_template(task)
    prompts: dict[int, str] = {}
    counts: dict[int, int] = {}

    def n_tokens(k: int) -> int:
        if k not in counts:
            at = offsets(k)
            context = _render(hay, w0, step * k, [(at[i], texts[i]) for i in order])
            prompts[k] = template.format(context=context, query=keys[q])
            counts[k] = len(tokenizer.encode_batch([prompts[k]])[0])
        return counts[k]

    avail = length - max_new_tokens
    first = n_tokens(1)
    if first > avail:
        raise ValueError(f"{cell}: budget {length} is below the template's own length ({first} tokens with its "
                         f"needles and one {unit} of haystack, + {max_new_tokens} new tokens); use a larger length "
                         f"(sample {index} needs >= {first + max_new_tokens})")
    probe = min(_TOKENS_PER_WORD_PROBE, window)
    per_word = max(len(tokenizer.encode_batch([" ".join(hay.words[w0:w0 + probe])])[0]) / probe, 1e-3)
    guess = 1 + int((avail - first) / (per_word * step))
    if 1 < guess <= k_max:  # one secant step through the exact counts at 1 and at the first guess
        slope = max((n_tokens(guess) - first) / (guess - 1), 1.0)
        guess += int(np.floor((avail - n_tokens(guess)) / slope))
    k = _largest_fit(n_tokens, avail, k_max, guess)
    if k == k_max:
        raise ValueError(f"haystack {hay.source} is too short for {cell}: a window of {window} words of its "
                         f"{len(hay)} still fits the budget; give a longer haystack file (ruler.haystack=PATH)")
    at = offsets(k)
    if hay.line_words is not None:  # the needle's line as a percentage of the lines
        depths = [100 * (a // step) // k for a in at]
    return {"task": task, "length": length, "index": index, "seed": seed, "prompt": prompts[k],
            "answers": [values[q]], "depth": depths[q], "haystack_words": step * k,
            "prompt_tokens": counts[k], "keys": keys, "values": values, "depths": depths, "query": keys[q],
            "window_start": w0, "offsets": at}
