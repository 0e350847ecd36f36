"""RULER's scoring for the needle tasks: `postprocess` and `string_match_all`."""
from __future__ import annotations

import re
from collections.abc import Sequence

_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess(pred: str) -> str:
    """RULER's prediction clean-up: strip, map every control character (U+0000..U+001F) to a newline, strip."""
    return _CONTROL.sub("\n", pred.strip()).strip()


def string_match_all(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """Mean over samples of the fraction of a sample's references found in its prediction, x100.

    Args:
        preds: N raw predictions (each is `postprocess`ed first).
        refs: N non-empty lists of reference strings; matching is case-insensitive substring search.

    Returns:
        The score in percent, rounded to 2 decimals as RULER reports it.
    """
    if len(preds) != len(refs):
        raise ValueError(f"string_match_all got {len(preds)} predictions for {len(refs)} reference lists; "
                         "pass one reference list per prediction")
    if not preds:
        raise ValueError("string_match_all got no predictions; score at least one sample")
    total = 0.0
    for i, (pred, ref) in enumerate(zip(preds, refs)):
        if isinstance(ref, str) or not ref:
            raise ValueError(f"sample {i}: references must be a non-empty list of strings, got {ref!r}")
        text = postprocess(pred).lower()
        total += sum(r.lower() in text for r in ref) / len(ref)
    return round(total / len(preds) * 100, 2)
