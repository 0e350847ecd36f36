"""Uncertainty diagnostics of trained mixers (Fig. 2, Table 6 and the filter's calibration).

``python -m eval.diagnostics MODEL [MODEL...] [--out DIR] [--shards DIR] [--n-seqs 8] [--seq-len 2048]``
(MODEL: a run directory or its ``hf/`` export) writes into ``--out`` (default: ``diagnostics/`` in the first
MODEL's run directory), with a progress bar on a terminal and a line per step (and every 30 s within a long one)
otherwise:
- ``beta_eff.png/.pdf``: the density of ``beta_eff = k^T kappa`` over layers, heads and tokens, one panel per model,
  the mean marked (``--at-init``: a first row of the same configurations freshly initialised, as in Fig. 2);
  ``beta_eff.md/.csv``: the means and quantiles (``--paper``: with the paper's means);
- ``mu_intervention.md/.csv``: one trained KDN's weights evaluated at mu = 1, sqrt(d_k), d_k, 4 d_k (mean
  ``beta_eff``), the paper's fixed-weight intervention;
- ``filter_<model>.png`` and ``filter.md``: per layer and head, the distributions of the uncertainty ``p`` (Diagonal)
  or ``b`` (Isotropic), the observation noise ``r`` and the process noise ``omega``, and the normalised innovation
  squared ``NIS_t = ||delta_t||^2 / (d_v (z_t + r_t))``, ``delta_t = v_t - S^_t^T k_t``, ``z_t = k_t^T P^_t k_t``
  (about 1 when the tracked uncertainty is calibrated). A fixed-gain delta rule (KDA, DeltaNet, Gated DeltaNet) has
  no noise scale: its gain ``beta`` fixes only ``z / r``, so its NIS takes ``r = 1`` (``z = r beta ||k||^2 /
  (1 - beta ||k||^2)``);
- ``diagnostics.json``: every number above.
NIS comes from a float64 token loop of the recurrence over the first ``--filter-seqs`` probe sequences.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import Tensor

import kdn
from eval.overwrite import probe_beta_eff, summarize
from eval.tables.figures import pyplot, save
from eval.tables.paper import BETA_EFF_MEANS, MU_INTERVENTION
from eval.tables.render import write_atomic

DEFAULT_SHARDS = Path("data/cache/embedded-kjv-val10-mistral-v1")  # conf/data/embedded_long.yaml's shards
MU_SWEEP = ("1", "sqrt", "dk", "4dk")
SAMPLE = 4096  # values kept per head and quantity for the distributions
QUANTILES = (0.1, 0.5, 0.9)
TICK_TOKENS = 64  # the float64 loop reports its progress this often


@dataclass
class FilterTerms:
    """One layer's filter inputs in float64. ``kind``: ``diag``, ``iso`` or ``delta`` (a fixed-gain rule).

    ``k [B,T,H,K]`` (L2-normalised), ``v [B,T,H,V]``, ``g [B,T,H,K]`` log-retention; KDN: ``omega [B,T,H,K]``
    (``[B,T,H]`` iso), ``r [B,T,H]``, prior ``p0 [B,H,K]`` (``[B,H]`` iso), ``mu`` float or ``[H]``;
    delta rules: ``beta [B,T,H]``."""

    kind: str
    k: Tensor
    v: Tensor
    g: Tensor
    omega: Tensor | None = None
    r: Tensor | None = None
    p0: Tensor | None = None
    mu: float | Tensor | None = None
    beta: Tensor | None = None


def layer_terms(layer: torch.nn.Module, x: Tensor) -> FilterTerms | None:
    """Recompute a mixer's filter inputs from its own modules for its input ``x [B, T, d_model]``; ``None`` for a
    mixer without a Kalman or scalar-gain delta rule. This is the one place that reads mixer internals: the front
    end's projections and gate, the KDN noise heads and prior, a delta rule's write terms."""
    f64 = torch.float64
    if isinstance(layer, (kdn.DiagonalKDN, kdn.IsotropicKDN)):
        extra = {"r": getattr(layer, "r_proj", None), "omega": getattr(layer, "omega_proj", None)}
        p, _ = layer.front.inputs(x, extra)
        omega, r = layer.noise_terms(p)
        mu = layer.mu()
        return FilterTerms("iso" if isinstance(layer, kdn.IsotropicKDN) else "diag", p["k"].to(f64), p["v"].to(f64),
                           layer.front.log_retention(p).to(f64), omega.to(f64), r.to(f64),
                           layer.initial_uncertainty(x.shape[0]).to(f64),
                           mu.to(f64) if isinstance(mu, Tensor) else float(mu))
    if not (hasattr(layer, "write_terms") and hasattr(layer, "front")):
        return None
    p, _ = layer.front.inputs(x, layer.write_projections())
    terms = layer.write_terms(p)
    if "beta" not in terms:
        return None
    k = p["k"].to(f64)
    g = layer.front.log_retention(p).to(f64) if layer.gate != "none" else torch.zeros_like(k)
    if g.dim() == 3:  # one decay per head
        g = g[..., None].expand_as(k)
    return FilterTerms("delta", k, p["v"].to(f64), g, beta=terms["beta"].to(f64))


def set_mu(layer: torch.nn.Module, choice: str) -> str:
    """Set a KDN layer's information scale (one of ``MU_SWEEP``) in place; returns the previous choice."""
    before = layer.mu_choice
    layer.mu_choice = choice
    return before


@torch.no_grad()
def filter_trace(t: FilterTerms, tick: Callable[[int, int], None] | None = None) -> dict[str, Tensor]:
    """The recurrence token by token in float64. Returns ``nis``, ``beta_eff``, ``z``, ``r`` ``[B,T,H]``, the
    posterior uncertainty ``unc`` (``[B,T,H,K]`` diag, ``[B,T,H]`` iso; absent for delta rules) and the final
    memory ``S [B,H,K,V]``. ``tick(done, T)`` is called every ``TICK_TOKENS`` tokens and at the end."""
    k, v, a = t.k, t.v, t.g.exp()
    B, T, H, K = k.shape
    V = v.shape[-1]
    S = k.new_zeros(B, H, K, V)
    u = t.p0.clone() if t.p0 is not None else None
    out: dict[str, list[Tensor]] = {"nis": [], "beta_eff": [], "z": [], "r": [], "unc": []}
    for i in range(T):
        kt, at = k[:, i], a[:, i]
        S_hat = at[..., None] * S
        delta = v[:, i] - torch.einsum("bhkv,bhk->bhv", S_hat, kt)
        kk = (kt * kt).sum(-1)
        if t.kind == "diag":
            r = t.r[:, i]
            p_hat = at * at * u + t.omega[:, i]
            z = (p_hat * kt * kt).sum(-1)
            kappa = p_hat * kt / (r + z)[..., None]
            u = p_hat / (1 + (t.mu / r)[..., None] * kt * kt * p_hat)
        elif t.kind == "iso":
            r = t.r[:, i]
            b_hat = (at * at).mean(-1) * u + t.omega[:, i]
            z = b_hat * kk
            kappa = (b_hat / (r + z))[..., None] * kt
            u = b_hat / (1 + t.mu * kk / (K * r) * b_hat)
        else:  # fixed gain: beta ||k||^2 = z / (r + z) with r = 1
            r = torch.ones_like(kk)
            bk = t.beta[:, i] * kk
            z = r * bk / (1 - bk).clamp_min(1e-12)
            kappa = t.beta[:, i][..., None] * kt
        out["nis"].append((delta * delta).sum(-1) / (V * (z + r)))
        out["beta_eff"].append((kappa * kt).sum(-1))
        out["z"].append(z)
        out["r"].append(r)
        if u is not None:
            out["unc"].append(u)
        S = S_hat + kappa[..., None] * delta[..., None, :]
        if tick is not None and ((i + 1) % TICK_TOKENS == 0 or i + 1 == T):
            tick(i + 1, T)
    res = {name: torch.stack(xs, 1) for name, xs in out.items() if xs}
    res["S"] = S
    return res


def _per_head(x: Tensor, gen: torch.Generator) -> Tensor:
    """``x [B, T, H, ...]`` -> up to ``SAMPLE`` values per head, ``[H, m]`` float32 (a fixed-seed subsample)."""
    flat = x.transpose(0, 2).reshape(x.shape[2], -1).float()
    if flat.shape[1] > SAMPLE:
        flat = flat[:, torch.randperm(flat.shape[1], generator=gen)[:SAMPLE]]
    return flat.cpu()


def _stats(x: Tensor) -> dict[str, float]:
    x = x.double().flatten()
    qs = torch.quantile(x, torch.tensor(QUANTILES, dtype=torch.float64))
    return {"mean": float(x.mean()), **{f"q{int(100 * q)}": float(v) for q, v in zip(QUANTILES, qs)}}


def mixers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """``(layer index, mixer)`` of every block of a ``KDNForCausalLM``."""
    return [(i, block.mixer) for i, block in enumerate(model.model.layers)]


@torch.no_grad()
def filter_stats(model: torch.nn.Module, ids: Tensor,
                 tick: Callable[[int, int, int], None] | None = None) -> dict[int, dict[str, Tensor]]:
    """Per layer with a filter: per-head samples ``[H, m]`` of ``nis``, ``beta_eff``, ``r``, ``omega`` and ``unc``
    (``p`` or ``b``), from one forward pass over ``ids [B, T]`` (forward pre-hooks on the mixers); ``tick(layer,
    done, T)`` reports the float64 loop's progress."""
    found: dict[int, dict[str, Tensor]] = {}
    gen = torch.Generator().manual_seed(0)

    def hook(idx: int) -> Any:
        def run(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            x = args[0] if args else kwargs["hidden_states"]
            terms = layer_terms(module, x)
            if terms is None:
                return
            tr = filter_trace(terms, None if tick is None else lambda done, T: tick(idx, done, T))
            rec = {"kind": terms.kind, "nis": _per_head(tr["nis"], gen), "beta_eff": _per_head(tr["beta_eff"], gen),
                   "nis_mean": tr["nis"].mean(dim=(0, 1)).float().cpu()}
            if terms.kind != "delta":
                rec.update(r=_per_head(tr["r"], gen), omega=_per_head(terms.omega, gen),
                           unc=_per_head(tr["unc"], gen))
            found[idx] = rec
        return run

    handles = [m.register_forward_pre_hook(hook(i), with_kwargs=True) for i, m in mixers(model)]
    try:
        model(input_ids=ids)
    finally:
        for h in handles:
            h.remove()
    return found


def resolve_model(path: str | Path) -> Path:
    """The Hugging Face directory of a run directory (``<run>/hf``) or the directory itself."""
    path = Path(path)
    if (path / "hf" / "config.json").is_file():
        return path / "hf"
    if (path / "config.json").is_file():
        return path
    raise ValueError(f"{path} is neither a run directory with hf/config.json nor an exported model (config.json); "
                     "pass runs/<name> after train.py has exported it")


def model_label(path: Path, model: torch.nn.Module) -> str:
    """``<run name> (<mixer>[ mu=<mu>])``."""
    name = path.parent.name if path.name == "hf" else path.name
    cfg = model.config
    mu = (cfg.mixer_kwargs or {}).get("mu", "dk") if cfg.mixer.startswith("kdn") else None
    return f"{name} ({cfg.mixer}{f' mu={mu}' if mu is not None else ''})"


def paper_key(model: torch.nn.Module) -> str | None:
    """The key of the paper's mean ``beta_eff`` for this mixer and mu (``eval.tables.paper.BETA_EFF_MEANS``)."""
    cfg = model.config
    key = cfg.mixer if cfg.mixer == "kda" else f"{cfg.mixer} mu={(cfg.mixer_kwargs or {}).get('mu', 'dk')}"
    return key if key in BETA_EFF_MEANS else None


def probe_shards(shards: str | None, stream: TextIO | None = None, default: Path = DEFAULT_SHARDS) -> Path:
    """``shards`` or the offline ``default``, prepared from the embedded corpus on first use (10% held out), which is
    announced on ``stream`` (default: stderr) with the folder it goes to."""
    if shards is not None:
        return Path(shards)
    if not (default / "meta.json").is_file():
        from data import PrepareConfig, prepare

        stream = stream or sys.stderr
        print(f"diagnostics: preparing the probe shards (the embedded corpus, 10% held out) in {default}; done "
              "once, later runs reuse them (or pass --shards DIR)", file=stream, flush=True)
        prepare(PrepareConfig(source="embedded", val_fraction=0.1, out_dir=str(default), progress=stream.isatty()))
    return default


def default_out(model: str | Path) -> Path:
    """``<run dir>/diagnostics`` of ``model`` (a run directory or its ``hf/`` export)."""
    path = resolve_model(model)
    return (path.parent if path.name == "hf" else path) / "diagnostics"


class Progress:
    """The steps of a diagnostics run on ``stream``: a tqdm bar on a terminal, else a line when a step starts and
    one at most every ``every_s`` seconds within it (e.g. the float64 loop), each with the elapsed time."""

    def __init__(self, total: int, stream: TextIO | None = None, every_s: float = 30.0) -> None:
        from tqdm.auto import tqdm

        self.stream = stream or sys.stderr
        self.total, self.every_s, self.done = total, every_s, 0
        self.t0 = self.last = time.perf_counter()
        self.what = ""
        self.bar = tqdm(total=total, file=self.stream, desc="diagnostics", unit="step", dynamic_ncols=True,
                        bar_format="{desc}: {n:.1f}/{total} steps |{bar}| {elapsed}<{remaining} {postfix}",
                        ) if self.stream.isatty() else None

    def _line(self, text: str) -> None:
        self.last = time.perf_counter()
        print(f"diagnostics [{self.done}/{self.total}] {text} ({self.last - self.t0:.0f} s)", file=self.stream,
              flush=True)

    def start(self, what: str) -> None:
        """Begin the next step (the previous one counts as done)."""
        if self.what:
            self.done += 1
        self.what = what
        if self.bar is not None:
            self.bar.n = self.done
            self.bar.set_postfix_str(what)
        else:
            self._line(what)

    def within(self, fraction: float, detail: str) -> None:
        """``fraction`` (0..1) of the current step is done."""
        if self.bar is not None:
            self.bar.n = self.done + fraction
            self.bar.set_postfix_str(f"{self.what}: {detail}")
        elif time.perf_counter() - self.last >= self.every_s:
            self._line(f"{self.what}: {detail}")

    def layer_tick(self, n_layers: int) -> Callable[[int, int, int], None]:
        """A ``filter_stats`` tick ``(layer, done, T)`` that reports the loop's share of the current step."""
        def tick(layer: int, done: int, total: int) -> None:
            self.within((layer + done / total) / n_layers, f"layer {layer + 1}/{n_layers}, token {done}/{total}")
        return tick

    def close(self) -> None:
        """Every step is done."""
        self.done = self.total
        if self.bar is not None:
            self.bar.n = self.done
            self.bar.close()


def probe_ids(shard_dir: Path, n_seqs: int, seq_len: int, device: torch.device) -> Tensor:
    """The first ``n_seqs`` validation windows of ``seq_len`` tokens, ``[n_seqs, seq_len]``."""
    from data import TokenLoader

    batch = next(iter(TokenLoader(shard_dir, split="val", seq_len=seq_len, batch_size=n_seqs)))
    return batch["input_ids"].to(device)


def mu_intervention(model: torch.nn.Module, shard_dir: Path, n_seqs: int, seq_len: int,
                    tick: Callable[[int, str], None] | None = None) -> dict[str, float]:
    """Mean ``beta_eff`` of the same weights at each mu of ``MU_SWEEP`` (every KDN layer changed, then restored);
    ``tick(i, mu)`` is called before the ``i``-th mu's probe."""
    layers = [m for _, m in mixers(model) if isinstance(m, (kdn.DiagonalKDN, kdn.IsotropicKDN))]
    if not layers:
        raise ValueError(f"the mu intervention needs a KDN model; {model.config.mixer!r} has no mu")
    before = [set_mu(m, MU_SWEEP[0]) for m in layers]
    out = {}
    try:
        for i, choice in enumerate(MU_SWEEP):
            if tick is not None:
                tick(i, choice)
            for m in layers:
                set_mu(m, choice)
            out[choice] = summarize(probe_beta_eff(model, shard_dir, n_seqs=n_seqs, seq_len=seq_len))["pooled"]["mean"]
    finally:
        for m, b in zip(layers, before):
            set_mu(m, b)
    return out


def density_figure(betas: dict[str, dict[int, Tensor]], out: Path,
                   init: dict[str, dict[int, Tensor]] | None = None) -> list[Path]:
    """One panel per model: the density of ``beta_eff`` pooled over layers, heads and tokens, mean dashed; with
    ``init`` (the same configurations freshly initialised) a first row at initialisation, as in Fig. 2."""
    plt = pyplot()
    rows = [("at initialisation", init), ("trained", betas)] if init else [("", betas)]
    n = len(betas)
    fig, axes = plt.subplots(len(rows), n, figsize=(3.2 * n, 2.8 * len(rows)), squeeze=False)
    for ax_row, (when, panel) in zip(axes, rows):
        for ax, (label, b) in zip(ax_row, panel.items()):
            flat = torch.cat([x.flatten() for x in b.values()]).numpy()
            ax.hist(flat, bins=60, range=(0, 1), density=True, color="C0", alpha=0.7)
            ax.axvline(float(flat.mean()), color="k", ls="--", lw=1, label=f"mean {flat.mean():.3f}")
            ax.set_title(f"{label}{f', {when}' if when else ''}", fontsize=8)
            ax.set_xlabel(r"$\beta^{\mathrm{eff}}_t = k_t^\top \kappa_t$", fontsize=8)
            ax.legend(fontsize=7)
        ax_row[0].set_ylabel("density")
    fig.tight_layout()
    paths = [save(fig, out / f"beta_eff.{ext}") for ext in ("png", "pdf")]
    plt.close(fig)
    return paths


def fresh_copy(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """The same configuration freshly initialised (seed ``seed``), on the model's device and dtype, in eval mode."""
    import models

    p = next(model.parameters())
    torch.manual_seed(seed)
    return models.build_model(model.config).to(device=p.device, dtype=p.dtype).eval()


def filter_figure(stats: dict[int, dict[str, Any]], label: str, path: Path) -> Path:
    """Rows: layers; columns: ``p``/``b``, ``r``, ``omega``, NIS; one step histogram per head, log-x."""
    plt = pyplot()
    import numpy as np

    cols = ("unc", "r", "omega", "nis")
    names = {"unc": "uncertainty p (diag) / b (iso)", "r": "observation noise r", "omega": "process noise omega",
             "nis": "NIS (1 = calibrated)"}
    layers = sorted(stats)
    fig, axes = plt.subplots(len(layers), 4, figsize=(12, 1.9 * len(layers) + 0.6), squeeze=False)
    for row, i in zip(axes, layers):
        for ax, col in zip(row, cols):
            x = stats[i].get(col)
            if x is None:
                ax.set_axis_off()
                continue
            x = x.clamp_min(1e-12).log10().numpy()
            lo, hi = float(x.min()), float(x.max())
            if hi - lo < 1e-3:  # a constant (e.g. untrained or fixed) quantity: one visible bin
                lo, hi = lo - 0.05, hi + 0.05
            edges = np.linspace(lo, hi, 41)
            for h in range(x.shape[0]):
                ax.hist(x[h], bins=edges, histtype="step", density=True, lw=0.7)
            if col == "nis":
                ax.axvline(0.0, color="k", ls="--", lw=0.8)
            ax.set_title(f"layer {i} ({stats[i]['kind']}): {names[col]}", fontsize=7)
            ax.set_xlabel("log10", fontsize=7)
            ax.tick_params(labelsize=6)
            ax.ticklabel_format(axis="x", useOffset=False)
    fig.suptitle(f"{label}: one line per head", fontsize=9)
    fig.tight_layout()
    save(fig, path)
    plt.close(fig)
    return path


def _table(header: list[str], rows: list[list[str]]) -> tuple[str, str]:
    md = "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                   + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"
    csv = "\n".join(",".join(f'"{c}"' if "," in c else c for c in r) for r in [header, *rows]) + "\n"
    return md, csv


def _row(label: str, summary: dict[str, Any], paper: str | None) -> list[str]:
    pooled = summary["pooled"]
    return [label, f"{pooled['mean']:.3f}", *(f"{pooled[f'q{q}']:.3f}" for q in (10, 50, 90)),
            f"{pooled['overwrite_share']:.3f}"] + ([paper] if paper is not None else [])


def _clean(x: Any) -> Any:
    """``x`` with every non-finite float replaced by ``None`` (strict JSON)."""
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return None if isinstance(x, float) and not math.isfinite(x) else x


def run(models_: list[str], out: Path, *, shards: str | None = None, n_seqs: int = 8, seq_len: int = 2048,
        filter_seqs: int = 2, filter_len: int | None = None, intervene: str | None = None, paper: bool = False,
        at_init: bool = False, device: str = "auto", stream: TextIO | None = None,
        progress_every_s: float = 30.0) -> dict[str, Any]:
    """Every diagnostic of the module docstring, written into ``out``.

    Args: ``models_``: run or hf directories; ``shards``: token shards with a ``val`` split (``None``: the offline
    default); ``n_seqs x seq_len``: the ``beta_eff`` probe; ``filter_seqs x filter_len``: its part that the float64
    loop runs on; ``intervene``: the model of the mu sweep (``None``: the first KDN model); ``stream``: where the
    progress goes (default stderr), a line at most every ``progress_every_s`` seconds within a step off a terminal.
    Returns: what ``diagnostics.json`` holds (per model: ``beta_eff`` summary, per layer and head filter statistics;
    ``mu_intervention``)."""
    from eval.harness import load_model

    out.mkdir(parents=True, exist_ok=True)
    shard_dir = probe_shards(shards, stream)
    progress = Progress(len(models_) * (4 if at_init else 3) + 2, stream, progress_every_s)
    report: dict[str, Any] = {"probe": {"shards": str(shard_dir), "n_seqs": n_seqs, "seq_len": seq_len,
                                        "filter_seqs": filter_seqs, "filter_len": filter_len or seq_len},
                              "models": {}}
    betas: dict[str, dict[int, Tensor]] = {}
    init: dict[str, dict[int, Tensor]] = {}
    mean_rows, nis_rows = [], []
    target: tuple[str, torch.nn.Module] | None = None
    for spec in models_:
        path = resolve_model(spec)
        progress.start(f"loading {path}")
        model, _ = load_model(path, device=device)
        label = model_label(path, model)
        if label in report["models"]:
            label = f"{label} [{len(report['models'])}]"
        ids = probe_ids(shard_dir, n_seqs, seq_len, next(model.parameters()).device)
        if int(ids.max()) >= model.config.vocab_size:
            raise ValueError(f"{shard_dir} holds token ids up to {int(ids.max())} but {path} has a vocabulary of "
                             f"{model.config.vocab_size}; pass --shards prepared with the model's tokenizer")
        progress.start(f"{label}: beta_eff probe, {n_seqs} x {seq_len} tokens")
        betas[label] = probe_beta_eff(model, shard_dir, n_seqs=n_seqs, seq_len=seq_len)
        summary = summarize(betas[label])
        progress.start(f"{label}: float64 filter loop, {filter_seqs} x {filter_len or seq_len} tokens per layer")
        stats = filter_stats(model, ids[:filter_seqs, :filter_len or seq_len], progress.layer_tick(len(mixers(model))))
        report["models"][label] = {"path": str(path), "mixer": model.config.mixer, "beta_eff": summary, "filter": {
            str(i): {q: [_stats(h) for h in st[q]] for q in ("nis", "beta_eff", "unc", "r", "omega") if q in st}
            for i, st in stats.items()}}
        pk = paper_key(model)
        mean_rows.append(_row(label, summary, (f"{BETA_EFF_MEANS[pk]:.3f}" if pk else "—") if paper else None))
        for i, st in stats.items():
            heads = st["nis_mean"].tolist()
            nis_rows.append([label, str(i), st["kind"], f"{sum(heads) / len(heads):.3g}",
                             f"{float(st['nis'].median()):.3g}", f"{min(heads):.3g}", f"{max(heads):.3g}"])
        if at_init:
            progress.start(f"{label}: beta_eff probe at initialisation")
            init[label] = probe_beta_eff(fresh_copy(model), shard_dir, n_seqs=n_seqs, seq_len=seq_len)
            report["models"][label]["beta_eff_at_init"] = summarize(init[label])
            mean_rows.append(_row(f"{label}, at initialisation", report["models"][label]["beta_eff_at_init"],
                                  "—" if paper else None))
        if stats:
            filter_figure(stats, label, out / f"filter_{path.parent.name if path.name == 'hf' else path.name}.png")
        if target is None and (spec == intervene or (intervene is None and model.config.mixer.startswith("kdn"))):
            target = (label, model)
    if intervene is not None and target is None:
        raise ValueError(f"--intervene {intervene} is not one of the MODEL arguments")
    progress.start(f"figures and tables in {out}")
    density_figure(betas, out, init or None)
    header = ["model", "mean", "q10", "q50", "q90", "share >= 0.9"] + (["paper mean"] if paper else [])
    for name, table in (("beta_eff", _table(header, mean_rows)), ("filter", _table(
            ["model", "layer", "rule", "mean NIS", "median NIS", "min head mean", "max head mean"], nis_rows))):
        write_atomic(out / f"{name}.md", table[0])
        write_atomic(out / f"{name}.csv", table[1])
    if target is not None:
        progress.start(f"mu intervention on {target[0]}")
        sweep = mu_intervention(target[1], shard_dir, n_seqs, seq_len,
                                lambda i, mu: progress.within(i / len(MU_SWEEP), f"mu={mu}"))
        report["mu_intervention"] = {"model": target[0], "mean_beta_eff": sweep}
        rows = [[c, f"{v:.3f}"] + ([f"{MU_INTERVENTION[c]:.3f}"] if paper else []) for c, v in sweep.items()]
        md, csv = _table(["mu", "mean beta_eff"] + (["paper"] if paper else []), rows)
        note = (f"Weights of {target[0]}, mu changed in every layer, on the probe above ({n_seqs} x {seq_len} "
                "tokens; the paper's sweep ran on separate 4096-token sequences, so compare directions, not levels).")
        write_atomic(out / "mu_intervention.md", f"{note}\n\n{md}")
        write_atomic(out / "mu_intervention.csv", csv)
    write_atomic(out / "diagnostics.json", json.dumps(_clean(report), indent=1, allow_nan=False) + "\n")
    progress.close()
    return report


def main(argv: list[str] | None = None) -> int:
    doc = __doc__ or ""
    ap = argparse.ArgumentParser(prog="python -m eval.diagnostics", description=doc.split("\n\n")[0])
    ap.add_argument("models", nargs="+", help="run directories (runs/<name>) or exported hf/ directories")
    ap.add_argument("--out", help="output folder (default: diagnostics/ in the first MODEL's run directory)")
    ap.add_argument("--shards", help=f"token shard directory with a val split (default: {DEFAULT_SHARDS}, "
                                     "prepared from the embedded corpus on first use)")
    ap.add_argument("--n-seqs", type=int, default=8, help="probe sequences (default 8)")
    ap.add_argument("--seq-len", type=int, default=2048, help="tokens per probe sequence (default 2048)")
    ap.add_argument("--filter-seqs", type=int, default=2, help="probe sequences the float64 NIS loop runs on")
    ap.add_argument("--filter-len", type=int, help="tokens of those sequences (default: --seq-len)")
    ap.add_argument("--intervene", help="the MODEL whose weights the mu sweep uses (default: the first KDN model)")
    ap.add_argument("--paper", action="store_true", help="add the paper's mean beta_eff and mu sweep")
    ap.add_argument("--at-init", action="store_true", help="also probe each configuration freshly initialised")
    ap.add_argument("--device", default="auto", help="cpu, cuda, or auto")
    a = ap.parse_args(argv)
    for name, v in (("--n-seqs", a.n_seqs), ("--seq-len", a.seq_len), ("--filter-seqs", a.filter_seqs)):
        if v < 1:
            ap.error(f"{name} must be >= 1, got {v}")
    if a.filter_seqs > a.n_seqs or (a.filter_len is not None and not 1 <= a.filter_len <= a.seq_len):
        ap.error("--filter-seqs must be <= --n-seqs and --filter-len within 1..--seq-len")
    try:
        out = Path(a.out) if a.out else default_out(a.models[0])
    except ValueError as e:
        ap.error(str(e))
    print(f"diagnostics: writing into {out}/", file=sys.stderr, flush=True)
    report = run(a.models, out, shards=a.shards, n_seqs=a.n_seqs, seq_len=a.seq_len,
                 filter_seqs=a.filter_seqs, filter_len=a.filter_len, intervene=a.intervene, paper=a.paper,
                 at_init=a.at_init, device=a.device)
    for label, m in report["models"].items():
        print(f"{label}: mean beta_eff {m['beta_eff']['pooled']['mean']:.3f}")
    if "mu_intervention" in report:
        print("mu intervention:", report["mu_intervention"]["mean_beta_eff"])
    print(f"wrote {out}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
