"""Fig. 4 (mixer throughput against sequence length) and the loss curves of a sweep.

Every figure is written atomically (temporary file, then ``os.replace``) with the Agg backend.
"""
from __future__ import annotations

import json
import os
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

from eval.tables.runs import Run

MIXER_LABELS = {"kdn_diag": "Diagonal KDN", "kdn_iso": "Isotropic KDN", "kda": "KDA", "deltanet": "DeltaNet",
                "gdn": "Gated DeltaNet", "gdn2": "GDN-2", "mamba3_siso": "Mamba-3 SISO",
                "mamba3_mimo": "Mamba-3 MIMO", "attn": "Transformer (full causal)"}


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: Path) -> Path:
    """Save ``fig`` to ``path`` (its suffix picks the format) atomically and close it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    fig.savefig(tmp, dpi=130)
    os.replace(tmp, path)
    return path


def read_throughput(path: str | Path) -> tuple[dict[str, Any], dict[str, list[tuple[int, float]]]]:
    """``(header, {mixer: [(T, tokens/s)] sorted by T})`` from ``bench.mixer_throughput``'s JSON; entries without a
    measurement (an ``error`` or no ``tokens_per_s``) are listed in one warning."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
        header, results = data.get("header", {}), data["results"]
    except (OSError, json.JSONDecodeError, KeyError, AttributeError) as e:
        raise ValueError(f"{path} is not a bench.mixer_throughput result ({type(e).__name__}: {e}); "
                         "write one with python -m bench.mixer_throughput") from None
    lines: dict[str, list[tuple[int, float]]] = defaultdict(list)
    failed: dict[tuple[str, str], list[str]] = defaultdict(list)  # (mixer, error) -> lengths
    for r in results:
        tps = r.get("tokens_per_s")
        if tps is None:
            failed[(str(r.get("mixer")), str(r.get("error", "no tokens_per_s"))[:100])].append(str(r.get("T")))
        else:
            lines[r["mixer"]].append((int(r["T"]), float(tps)))
    if failed:
        warnings.warn(f"{path}: not plotted (no measurement): " + "; ".join(
            f"{m} at T={','.join(ts)}: {err}" for (m, err), ts in failed.items()), stacklevel=2)
    if not lines:
        raise ValueError(f"{path} has no measured entry; rerun python -m bench.mixer_throughput on a GPU")
    return header, {m: sorted(v) for m, v in lines.items()}


def throughput_figure(path: str | Path, out: Path, stem: str = "fig4_throughput") -> list[Path]:
    """Fig. 4: tokens/s against sequence length, one line per mixer, log-x; ``<stem>.png`` and ``.pdf``."""
    header, lines = read_throughput(path)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for mixer, pts in lines.items():
        ax.plot([t for t, _ in pts], [v / 1e6 for _, v in pts], marker="o", label=MIXER_LABELS.get(mixer, mixer))
    ts = sorted({t for pts in lines.values() for t, _ in pts})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ts, [f"{t // 1024}K" if t >= 1024 else str(t) for t in ts])
    ax.set_xlabel("sequence length")
    ax.set_ylabel("tokens/s (millions)")
    ax.set_title(f"{header.get('device', '')} batch {header.get('batch', '?')}, d_model {header.get('d_model', '?')}, "
                 f"{header.get('dtype', '')}", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths = [save(fig, out / f"{stem}.{ext}") for ext in ("png", "pdf")]
    plt.close(fig)
    return paths


def _tokens_per_step(run: Run) -> float | None:
    pts = [(r["step"], r["tokens"]) for r in run.train if r.get("tokens") is not None and r.get("step")]
    return pts[-1][1] / pts[-1][0] if pts else None


def loss_curves(runs: list[Run], path: Path) -> Path | None:
    """Training and validation loss against tokens, one line per run, two panels (PNG); ``None`` without
    records. A validation record's tokens are its step times the run's tokens per step."""
    runs = [r for r in runs if r.train or r.val]
    if not runs:
        return None
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4), sharex=True)
    for run in runs:
        label = f"{run.name} (seed {run.seed})"
        per_step = _tokens_per_step(run)
        tr = [(r["tokens"], r["loss"]) for r in run.train if r.get("tokens") is not None]
        line = a.plot([t for t, _ in tr], [v for _, v in tr], lw=1, label=label)[0] if tr else None
        if per_step is not None and run.val:
            b.plot([r["step"] * per_step for r in run.val], [r["val_loss"] for r in run.val], marker=".",
                   lw=1, label=label, color=line.get_color() if line is not None else None)
    for ax, title in ((a, "training loss"), (b, "validation loss")):
        ax.set_xlabel("tokens")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    a.set_ylabel("loss (nats/token)")
    a.legend(fontsize=6)
    fig.tight_layout()
    save(fig, path)
    plt.close(fig)
    return path
