"""Print the parameter-matching table: ``python -m models.size_table [--sizes 750m 1.3b] [--pattern recurrent]``.

For every size: the matching target and its source; for every mixer: total, non-embedding and block-stack
parameters, the solved FFN width, the recurrent memory per layer (elements per sequence; for sliding-window
attention its bounded KV cache) and the deviation of the block stack from the target. At ``1.3b`` also the
authors' released configs of the pattern beside ours: their block stack, ours at their FFN width and ours as
solved, with the differences. Models are built on the meta device.
"""
from __future__ import annotations

import argparse

from models.registry import MIXERS
from models.sizes import (
    AUTHORS_1_3B,
    AUTHORS_SOURCE,
    GDN2_AUTHORS_LAYOUT,
    SIZES,
    block_stack_parameters,
    match_target,
    model_config,
    paper_pattern,
    parameter_counts,
)


def _widths(w: int | list[int]) -> str:
    """One width, or the distinct per-layer widths and how many layers have each (``5504x5/5568x11``)."""
    if isinstance(w, int):
        return str(w)
    return "/".join(f"{v}x{w.count(v)}" for v in sorted(set(w)))


def _mean_width(w: int | list[int]) -> float:
    return float(w) if isinstance(w, int) else sum(w) / len(w)


def table_rows(sizes: list[str], pattern: str, vocab_size: int) -> list[dict]:
    """One dict per (size, mixer): ``size, mixer, total, non_embedding, block_stack, ffn, state, deviation``."""
    rows = []
    for size in sizes:
        target = match_target(size, pattern, vocab_size).block_stack
        for mixer in MIXERS:
            cfg = model_config(size, mixer, pattern, vocab_size)
            total, non_embedding = parameter_counts(cfg)
            block_stack = block_stack_parameters(cfg)
            name, kwargs = cfg.layer_mixer(0)
            rows.append({
                "size": size, "mixer": mixer, "total": total, "non_embedding": non_embedding,
                "block_stack": block_stack, "ffn": _widths(cfg.intermediate_size),
                "state": MIXERS[name].state_size(cfg, 0, kwargs), "deviation": (block_stack - target) / target,
            })
    return rows


def authors_rows(pattern: str) -> list[dict]:
    """One dict per released 1.3B config of ``pattern``: ``name, mixer, their_ffn, their_block_stack, ours_at_their_ffn,
    our_ffn, our_mean_ffn, our_block_stack`` (GDN-2 in the authors' layout, :data:`GDN2_AUTHORS_LAYOUT`)."""
    rows = []
    for c in AUTHORS_1_3B:
        if c.pattern != paper_pattern(pattern, SIZES["1.3b"]["num_layers"]):
            continue
        kwargs = {"mixer_kwargs": GDN2_AUTHORS_LAYOUT} if c.mixer == "gdn2" else {}
        at_theirs = model_config("1.3b", c.mixer, pattern, intermediate_size=c.ffn_width, **kwargs)
        solved = model_config("1.3b", c.mixer, pattern, **kwargs)
        rows.append({
            "name": c.name, "mixer": c.mixer, "their_ffn": c.ffn_width, "their_block_stack": c.block_stack,
            "ours_at_their_ffn": block_stack_parameters(at_theirs), "our_ffn": _widths(solved.intermediate_size),
            "our_mean_ffn": _mean_width(solved.intermediate_size), "our_block_stack": block_stack_parameters(solved),
        })
    return rows


def format_table(rows: list[dict], targets: dict[str, tuple[int, str]] | None = None) -> str:
    """The rows as an aligned text table (after each size's target and source, when ``targets`` maps sizes to
    ``(block stack, source)``), ending with the maximum absolute deviation."""
    head = (f"{'size':>5}  {'mixer':<12} {'total':>14} {'non-embedding':>14} {'block stack':>14} {'FFN':>15} "
            f"{'state/layer':>12} {'dev':>9}")
    lines = []
    for size in dict.fromkeys(r["size"] for r in rows):
        if targets and size in targets:
            count, source = targets[size]
            lines.append(f"target {size}: {count:,} block-stack parameters ({source})")
    lines += [head, "-" * len(head)]
    for r in rows:
        state = "growing" if r["state"] is None else f"{r['state']:,}"
        lines.append(f"{r['size']:>5}  {r['mixer']:<12} {r['total']:>14,} {r['non_embedding']:>14,} "
                     f"{r['block_stack']:>14,} {r['ffn']:>15} {state:>12} {100 * r['deviation']:>+8.4f}%")
    worst = max(abs(r["deviation"]) for r in rows)
    lines.append(f"max block-stack parameter deviation: {100 * worst:.4f}%")
    return "\n".join(lines)


def format_authors(rows: list[dict]) -> str:
    """The released configs beside ours (:func:`authors_rows`) as an aligned text table."""
    head = (f"{'config':<14} {'mixer':<9} {'their FFN':>9} {'their stack':>14} {'ours @ their FFN':>16} {'diff':>7} "
            f"{'our FFN (mean)':>24} {'our stack':>14} {'diff':>9}")
    lines = [f"authors' released 1.3B configs ({AUTHORS_SOURCE}; GDN-2 in the authors' layout {GDN2_AUTHORS_LAYOUT})",
             head, "-" * len(head)]
    for r in rows:
        ours = f"{r['our_ffn']} ({r['our_mean_ffn']:.1f})"
        lines.append(f"{r['name']:<14} {r['mixer']:<9} {r['their_ffn']:>9} {r['their_block_stack']:>14,} "
                     f"{r['ours_at_their_ffn']:>16,} {r['ours_at_their_ffn'] - r['their_block_stack']:>+7,} "
                     f"{ours:>24} {r['our_block_stack']:>14,} {r['our_block_stack'] - r['their_block_stack']:>+9,}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["750m", "1.3b"], choices=list(SIZES))
    parser.add_argument("--pattern", default="recurrent", help="recurrent, hybrid_swa or a layer-code string")
    parser.add_argument("--vocab-size", type=int, default=32000)
    args = parser.parse_args(argv)
    targets = {}
    for size in args.sizes:
        t = match_target(size, args.pattern, args.vocab_size)
        targets[size] = (t.block_stack, t.source)
    print(format_table(table_rows(args.sizes, args.pattern, args.vocab_size), targets))
    if "1.3b" in args.sizes:
        rows = authors_rows(args.pattern)
        if rows:
            print()
            print(format_authors(rows))


if __name__ == "__main__":
    main()
