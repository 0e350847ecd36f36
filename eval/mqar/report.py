"""The MQAR results JSON, its Markdown table and its plot (accuracy against state size, as in Zoology's figure).

``python -m eval.mqar.report RESULTS.json`` rewrites the table (``.md``) and plot (``.png``) beside the JSON.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from eval.mqar.config import scored_names
from eval.mqar.run import SCHEMA

MARKERS = "osD^v<>phX*P"  # one per mixer, with its colour


def load_results(path: str | Path) -> dict[str, Any]:
    """A results JSON written by ``python -m eval.mqar``; a one-line ``ValueError`` naming the problem and the fix for
    a missing or unreadable file, invalid JSON, or JSON of another kind."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as err:
        raise ValueError(f"cannot read {path} ({err.strerror or err}); pass the mqar.json that python -m eval.mqar "
                         "writes") from None
    except ValueError as err:  # JSONDecodeError, or bytes that are not UTF-8
        reason = str(err).splitlines()[0]
        raise ValueError(f"{path} is not valid JSON ({reason}); rerun the python -m eval.mqar command that wrote it "
                         "(its stored jobs are reused) to rewrite it") from None
    if not isinstance(data, dict) or data.get("benchmark") != "mqar" or data.get("schema") != SCHEMA:
        raise ValueError(f"{path} is not an MQAR results file of schema {SCHEMA}; write one with python -m eval.mqar")
    return data


def settings_of(config: dict[str, Any]) -> list[str]:
    """The settings a results file's models were scored on, in order (``config``: the file's ``config``)."""
    return scored_names(config.get("settings", []), config.get("test_settings", []))


def _cell(row: dict[str, Any], seeds: int) -> str:
    """``mean ± std`` (%) of a row's seeds; one seed has no spread to show, and a row with fewer seeds than the grid
    (a grid still filling) says how many it has."""
    n = len(row["test_acc"])
    text = f"{100 * row['test_acc_mean']:.1f}" + ("" if n == 1 else f" ± {100 * row['test_acc_std']:.1f}")
    return text if n >= seeds else f"{text} (n={n})"


def table(data: dict[str, Any]) -> str:
    """Markdown: one row per mixer, one column per ``setting / width``, cells ``mean ± std`` test accuracy (%)."""
    rows = data["rows"]
    names = settings_of(data["config"])
    cols = sorted({(r["setting"], r["width"]) for r in rows},
                  key=lambda c: (names.index(c[0]) if c[0] in names else 99, c[1]))
    mixers = [m for m in data["config"]["mixers"] if any(r["mixer"] == m for r in rows)]
    cell = {(r["mixer"], r["setting"], r["width"]): r for r in rows}
    seeds = len(data["config"]["seeds"])
    lines = [f"MQAR test accuracy (%), mean ± std over {seeds} seed(s) (a cell with fewer says n), best of the LR "
             f"sweep {data['config']['lrs']} by validation accuracy; state per column below.", "",
             "| mixer | " + " | ".join(f"{s} d{w}" for s, w in cols) + " |",
             "|---|" + "---:|" * len(cols)]
    for m in mixers:
        vals = []
        for s, w in cols:
            r = cell.get((m, s, w))
            vals.append("" if r is None else _cell(r, seeds))
        lines.append(f"| {m} | " + " | ".join(vals) + " |")
    states = []
    for s, w in cols:
        rec = [r["state"] for r in rows if r["setting"] == s and r["width"] == w and r["state_recurrent"]]
        states.append(f"{min(rec):,}–{max(rec):,}" if rec and min(rec) != max(rec) else f"{rec[0]:,}" if rec else "")
    lines.append("| recurrent state | " + " | ".join(states) + " |")
    lrs = sorted(data["config"]["lrs"])
    if len(lrs) > 1 and rows:
        counts = {lr: sum(r["best_lr"] == lr for r in rows) for lr in lrs}
        edges = counts[lrs[0]] + counts[lrs[-1]]
        best = ", ".join(f"{lr:g} in {n}" for lr, n in counts.items())
        lines += ["", f"Best rate: {best} of {len(rows)} cells; {edges} at an end of the sweep, where a rate beyond "
                  "it might do better."]
    return "\n".join(lines) + "\n"


def plot(data: dict[str, Any], path: str | Path) -> None:
    """One panel per setting: test accuracy against state size (log x), one line per mixer over the widths, each
    mixer its own colour and marker (the grid has more mixers than matplotlib has default colours); attention (its
    KV cache, not a fixed state) dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["rows"]
    settings = [s for s in settings_of(data["config"]) if any(r["setting"] == s for r in rows)]
    fig, axes = plt.subplots(1, len(settings), figsize=(4 * len(settings), 3.6), squeeze=False, sharey=True)
    colors = plt.get_cmap("tab10").colors + plt.get_cmap("tab20").colors[1::2]  # then the light shades
    for ax, s in zip(axes[0], settings):
        for i, m in enumerate(data["config"]["mixers"]):
            pts = sorted((r["state"], r["test_acc_mean"], r["test_acc_std"], r["state_recurrent"])
                         for r in rows if r["setting"] == s and r["mixer"] == m)
            if not pts:
                continue
            x, y, e = [p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts]
            ax.errorbar(x, y, yerr=e, marker=MARKERS[i % len(MARKERS)], ms=4, capsize=2, label=m,
                        color=colors[i % len(colors)], ls="-" if pts[0][3] else "--")
        ax.set_xscale("log")
        ax.set_title(f"MQAR {s}")
        ax.set_xlabel("state (elements)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("test accuracy")
    axes[0][0].set_ylim(-0.02, 1.02)
    axes[0][-1].legend(fontsize=7, loc="best")
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)


def write_report(data: dict[str, Any], results: str | Path) -> tuple[Path, Path | None]:
    """Write the table and plot beside ``results``; returns their paths (the plot's ``None`` when no job has a
    result yet: there is nothing to plot)."""
    results = Path(results)
    md, png = results.with_suffix(".md"), results.with_suffix(".png")
    tmp = md.with_name(f".{md.name}.tmp")
    tmp.write_text(table(data))
    tmp.replace(md)
    if not data["rows"]:
        return md, None
    plot(data, png)
    return md, png


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: python -m eval.mqar.report RESULTS.json")
    md, png = write_report(load_results(argv[0]), argv[0])
    print(md.read_text())
    print(f"wrote {md}{'' if png is None else f' and {png}'}")


if __name__ == "__main__":
    main(sys.argv[1:])
