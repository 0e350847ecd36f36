"""Overwrite diagnostics (Fig. 2 / Table 6): the distribution of the effective write strength
``beta_eff = k^T kappa`` over layers, heads and tokens, on a probe of held-out sequences (paper: eight
2048-token sequences). A ``beta_eff`` near 1 rewrites almost all of the residual at that key.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)
OVERWRITE = 0.9  # the share of writes at or above this strength is reported as "overwrite"


@torch.no_grad()
def probe_beta_eff(model: Any, shard_dir: str | Path, *, n_seqs: int = 8, seq_len: int = 2048,
                   split: str = "val") -> dict[int, torch.Tensor]:
    """``{layer index: beta_eff [n_seqs, seq_len, H]}`` for every layer that has one."""
    from data import TokenLoader

    # the loader raises a ValueError when the split has fewer than n_seqs windows of seq_len tokens
    batch = next(iter(TokenLoader(shard_dir, split=split, seq_len=seq_len, batch_size=n_seqs)))
    ids = batch["input_ids"].to(next(model.parameters()).device)
    out = model(input_ids=ids, output_beta_eff=True)
    betas = {i: b.float().cpu() for i, b in enumerate(out.beta_eff or ()) if b is not None}
    if not betas:
        raise ValueError(f"model mixer {model.config.mixer!r} has no layer with an effective write strength "
                         "(only delta-rule and KDN mixers do)")
    return betas


def summarize(betas: dict[int, torch.Tensor]) -> dict[str, Any]:
    """Pooled and per-layer mean, quantiles and overwrite share; per-head means."""
    def stats(x: torch.Tensor) -> dict[str, float]:
        flat = x.flatten().double()
        qs = torch.quantile(flat, torch.tensor(QUANTILES, dtype=torch.float64))
        return {"mean": float(flat.mean()), **{f"q{int(q * 100)}": float(v) for q, v in zip(QUANTILES, qs)},
                "overwrite_share": float((flat >= OVERWRITE).double().mean())}

    pooled = torch.cat([b.flatten() for b in betas.values()])
    return {
        "pooled": stats(pooled),
        "layers": {str(i): {**stats(b), "head_means": b.double().mean(dim=(0, 1)).tolist()} for i, b in betas.items()},
    }


def plot(betas: dict[int, torch.Tensor], path: Path) -> None:
    """One histogram of ``beta_eff`` per layer, written atomically as a PNG."""
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, b in betas.items():
        ax.hist(b.flatten().numpy(), bins=50, range=(0, 1), histtype="step", density=True, label=f"layer {i}")
    ax.set_xlabel("effective write strength  k^T kappa")
    ax.set_ylabel("density")
    ax.legend(fontsize=7)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
