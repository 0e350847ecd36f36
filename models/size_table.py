"""Print the parameter-matching table: ``python -m models.size_table [--sizes 750m 1.3b] [--pattern recurrent]``.

For every mixer and size: total and non-embedding parameters, the solved FFN width, the recurrent
memory per layer (elements per sequence; for sliding-window attention its bounded KV cache) and the
deviation of the non-embedding count from the KDA model. Models are built on the meta device.
"""
from __future__ import annotations

import argparse

from models.registry import MIXERS
from models.sizes import REFERENCE_MIXER, SIZES, model_config, parameter_counts


def _widths(w: int | list[int]) -> str:
    """One width, or the distinct per-layer widths and how many layers have each (``5504x5/5568x11``)."""
    if isinstance(w, int):
        return str(w)
    return "/".join(f"{v}x{w.count(v)}" for v in sorted(set(w)))


def table_rows(sizes: list[str], pattern: str, vocab_size: int) -> list[dict]:
    """One dict per (size, mixer): ``size, mixer, total, non_embedding, ffn, state, deviation``."""
    rows = []
    for size in sizes:
        reference = parameter_counts(model_config(size, REFERENCE_MIXER, pattern, vocab_size))[1]
        for mixer in MIXERS:
            cfg = model_config(size, mixer, pattern, vocab_size)
            total, non_embedding = parameter_counts(cfg)
            name, kwargs = cfg.layer_mixer(0)
            rows.append({
                "size": size, "mixer": mixer, "total": total, "non_embedding": non_embedding,
                "ffn": _widths(cfg.intermediate_size), "state": MIXERS[name].state_size(cfg, kwargs),
                "deviation": (non_embedding - reference) / reference,
            })
    return rows


def format_table(rows: list[dict]) -> str:
    """The rows as an aligned text table, ending with the maximum absolute deviation."""
    head = f"{'size':>5}  {'mixer':<12} {'total':>14} {'non-embedding':>14} {'FFN':>15} {'state/layer':>12} {'dev':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        state = "growing" if r["state"] is None else f"{r['state']:,}"
        lines.append(f"{r['size']:>5}  {r['mixer']:<12} {r['total']:>14,} {r['non_embedding']:>14,} {r['ffn']:>15} "
                     f"{state:>12} {100 * r['deviation']:>+8.4f}%")
    worst = max(abs(r["deviation"]) for r in rows)
    lines.append(f"max non-embedding parameter deviation: {100 * worst:.4f}%")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["750m", "1.3b"], choices=list(SIZES))
    parser.add_argument("--pattern", default="recurrent", help="recurrent, hybrid_swa or a layer-code string")
    parser.add_argument("--vocab-size", type=int, default=32000)
    args = parser.parse_args(argv)
    print(format_table(table_rows(args.sizes, args.pattern, args.vocab_size)))


if __name__ == "__main__":
    main()
