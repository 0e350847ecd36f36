"""fla's internals go through one module (kdn.ops.fla_internals), on the CPU: every name it lists resolves in the
installed fla, a name fla moved is refused in one line naming the pinned version, and no other module of ``kdn/`` or
``models/`` imports from fla anything but an op package's or ``fla.modules``' public names."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

pytest.importorskip("fla")

ROOT = Path(__file__).resolve().parents[1]
PUBLIC_PACKAGES = ("fla.modules", "fla.layers")  # besides each op's package, fla.ops.<op>


def test_every_internal_resolves_in_the_pinned_fla() -> None:
    from kdn.ops import fla_internals

    for name, module in fla_internals.NAMES.items():
        assert getattr(fla_internals, name) is getattr(importlib.import_module(module), name), name


@pytest.mark.parametrize("how", ["attribute", "from-import"])
def test_a_moved_internal_is_refused_in_one_line_naming_the_pin(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    from kdn.ops import fla_internals

    monkeypatch.delattr("fla.ops.gla.chunk.chunk_gla_fwd_o_gk")  # as if fla moved it
    with pytest.raises(ImportError, match=r"fla's fla\.ops\.gla\.chunk\.chunk_gla_fwd_o_gk is not in "
                       r"flash-linear-attention .*; pip install flash-linear-attention==0\.6\.0$") as e:
        if how == "attribute":
            fla_internals.chunk_gla_fwd_o_gk  # noqa: B018
        else:
            exec("from kdn.ops.fla_internals import chunk_gla_fwd_o_gk", {})
    assert "\n" not in str(e.value)
    monkeypatch.setitem(fla_internals.NAMES, "exp2", "fla.ops.utils.moved")  # a module fla renamed
    with pytest.raises(ImportError, match=r"fla\.ops\.utils\.moved\.exp2 is not in .*==0\.6\.0$"):
        fla_internals.resolve("exp2")
    with pytest.raises(AttributeError, match="has no attribute 'unlisted'"):
        fla_internals.unlisted  # noqa: B018


def _public(module: str, names: list[str]) -> bool:
    """Whether ``from module import names`` reads only fla's public API: an op's package ``fla.ops.<op>`` or a
    public package, and names in its ``__all__``."""
    parts = module.split(".")
    if not (module in PUBLIC_PACKAGES or (len(parts) == 3 and parts[1] == "ops")):
        return False
    exported = getattr(importlib.import_module(module), "__all__", [])
    return all(n in exported for n in names)


def test_only_fla_internals_reaches_past_flas_public_api() -> None:
    private = []
    for path in sorted([*ROOT.glob("kdn/**/*.py"), *ROOT.glob("models/**/*.py")]):
        if path == ROOT / "kdn/ops/fla_internals.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "fla":
                if not _public(node.module, [a.name for a in node.names]):
                    private.append(f"{path.relative_to(ROOT)}:{node.lineno} from {node.module}")
            elif isinstance(node, ast.Import):
                private += [f"{path.relative_to(ROOT)}:{node.lineno} import {a.name}" for a in node.names
                            if a.name.split(".")[0] == "fla" and a.name not in PUBLIC_PACKAGES]
    assert not private, f"fla internals used outside kdn/ops/fla_internals.py: {private}"
