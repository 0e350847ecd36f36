"""The package says each thing once: ``kdn`` re-exports ``kdn.ops``' own list, the ``State`` alias has one
declaration, and the ops follow fla's layout (``naive``, ``chunk``: the Triton chunked entry, ``fused_recurrent``),
with the PyTorch chunked path named as such."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_kdn_reexports_the_ops_list() -> None:
    import kdn
    import kdn.ops

    assert set(kdn.ops.__all__) <= set(kdn.__all__)
    for name in kdn.ops.__all__:
        assert getattr(kdn, name) is getattr(kdn.ops, name), name
    assert sorted(n for n in kdn.__all__ if n not in kdn.ops.__all__) == sorted(
        ["DiagonalKDN", "IsotropicKDN", "RecurrentCache", "DeltaFrontEnd", "GatedRMSNorm", "ShortConv"])


def test_state_alias_is_declared_once() -> None:
    declared = [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "kdn").rglob("*.py"))
                if re.search(r"^State\s*=", p.read_text(), re.M)]
    assert declared == ["kdn/ops/utils.py"]
    from kdn.ops import api, naive, torch_chunk, utils

    assert api.State is naive.State is torch_chunk.State is utils.State


def test_ops_follow_fla_layout() -> None:
    """``kdn.ops.chunk`` holds the Triton chunked entry points the API dispatches to; the PyTorch path is
    ``torch_chunk`` / ``torch_gain``."""
    pytest.importorskip("triton")
    from kdn.ops import chunk, torch_chunk, torch_gain

    for name in ("chunk_diagonal_kdn", "chunk_isotropic_kdn", "chunk_kda"):
        assert callable(getattr(chunk, name)), name
    assert callable(torch_chunk.torch_diagonal_kdn) and callable(torch_gain.diagonal_gain)
    assert not (ROOT / "kdn/ops/triton/kdn.py").exists() and not (ROOT / "kdn/ops/gain.py").exists()
