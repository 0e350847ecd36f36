"""The CUDA kernels' launch choices and checks, on the CPU (no kernel runs): an explicit ``kernel`` argument wins over
the environment overrides (``KDN_WY_KERNEL``, ``KDN_INTRA_KERNEL``), and the descriptor intra-chunk backward refuses,
in one line naming it, any tensor it loads through a descriptor that is not aligned for one, ``dAqk`` and ``dAkk``
included; and no benchmark picks a kernel by writing those variables (they pass ``kernel=``)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("fla")


def test_an_explicit_kernel_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from kdn.ops.triton.memory import intra_kernel
    from kdn.ops.triton.utils import kernel_choice
    from kdn.ops.triton.wy import use_tilelang

    choices = ("auto", "a", "b")
    monkeypatch.setenv("KDN_TEST_KERNEL", "a")
    assert kernel_choice("b", "KDN_TEST_KERNEL", choices, "test kernel") == "b"
    assert kernel_choice("auto", "KDN_TEST_KERNEL", choices, "test kernel") == "auto"
    assert kernel_choice(None, "KDN_TEST_KERNEL", choices, "test kernel") == "a"
    monkeypatch.setenv("KDN_TEST_KERNEL", "unknown")  # a bad override is not read when the argument is given
    assert kernel_choice("b", "KDN_TEST_KERNEL", choices, "test kernel") == "b"

    cpu = (torch.randn(1, 64, 1, 32),)
    monkeypatch.setenv("KDN_INTRA_KERNEL", "fla")
    assert intra_kernel(True, cpu, "kdn") == "kdn" and intra_kernel(True, cpu, "auto") == "kdn"
    assert intra_kernel(True, cpu) == "fla"
    monkeypatch.setenv("KDN_INTRA_KERNEL", "tma")  # forced by the environment, refused on the CPU; not when chosen
    assert intra_kernel(True, cpu, "fla") == "fla"

    k = torch.randn(1, 64, 2, 64, dtype=torch.bfloat16)
    monkeypatch.setattr("triton.knobs.runtime.interpret", False)
    monkeypatch.setenv("KDN_WY_KERNEL", "tilelang")  # would refuse off Hopper
    assert not use_tilelang((k, k), torch.rand(1, 64, 2) + 0.1, "triton")


@pytest.mark.parametrize("bad", ["", "TMA", "cuda"])
def test_an_unknown_explicit_kernel_is_refused_naming_the_argument(monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    from kdn.ops.triton.memory import intra_kernel

    monkeypatch.setenv("KDN_INTRA_KERNEL", "kdn")
    with pytest.raises(ValueError, match=r"is not one of \('auto', 'tma', 'kdn', 'fla'\): pass kernel= one") as e:
        intra_kernel(True, (torch.randn(1, 64, 1, 32),), bad)
    assert "\n" not in str(e.value)


def _intra_inputs(K: int = 32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = {n: torch.randn(1, 64, 2, K, generator=g) for n in ("q", "k", "k_precond", "dq", "dk", "dk_precond", "dg")}
    x["g"] = -torch.rand(1, 64, 2, K, generator=g).cumsum(1)
    x["beta"] = torch.rand(1, 64, 2, generator=g) + 0.1
    x["db"] = torch.randn(1, 64, 2, generator=g)
    x["dAqk"], x["dAkk"] = (torch.randn(1, 64, 2, 64, generator=g) for _ in range(2))
    return x


def _shifted(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a tensor whose base is one element (4 bytes) past a 16-byte boundary."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype)
    out = buf[1:].view(t.shape)
    out.copy_(t)
    return out


def _strided(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values through a view whose last stride is 2."""
    out = torch.empty(*t.shape, 2, dtype=t.dtype)[..., 0]
    out.copy_(t)
    return out


@pytest.mark.parametrize("name", ["dAqk", "dAkk", "q", "g", "dk_precond", "dg"])
@pytest.mark.parametrize("make", [_shifted, _strided], ids=["unaligned", "strided"])
def test_the_descriptor_backward_checks_every_tensor_it_loads(name: str, make: object) -> None:
    from kdn.ops.triton.intra_tma import chunk_asym_bwd_intra_tma

    x = _intra_inputs()
    x[name] = make(x[name])
    with pytest.raises(ValueError, match=rf"TMA needs 16-byte aligned tensors .* and {name} are not: pass contiguous"
                       ) as e:
        chunk_asym_bwd_intra_tma(**x)
    assert "\n" not in str(e.value)


def test_no_benchmark_writes_a_kernel_override() -> None:
    """``os.environ[...] = ``, ``os.environ.update/setdefault(...)`` or ``os.putenv`` naming a ``KDN_*_KERNEL``."""
    root = Path(__file__).resolve().parents[1]
    writes = []
    for path in sorted(root.glob("bench/**/*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Assign, ast.Call)) and "os.environ" in ast.unparse(node) \
                    or isinstance(node, ast.Call) and "putenv" in ast.unparse(node.func):
                text = ast.unparse(node)
                if "_KERNEL" in text and (isinstance(node, ast.Assign) or any(
                        w in ast.unparse(node.func) for w in ("update", "setdefault", "putenv"))):
                    writes.append(f"{path.relative_to(root)}:{node.lineno}: {text}")
    assert not writes, f"benchmarks choose kernels through the environment, pass kernel= instead: {writes}"
