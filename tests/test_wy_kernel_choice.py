"""The WY backward's choice between its Triton and TileLang key-block kernels, on the CPU: ``KDN_WY_KERNEL`` and the
``kernel`` argument are checked in one line, ``auto`` stays on Triton off Hopper, a forced TileLang off Hopper is
refused with the fix; and, where TileLang is installed, its program lowers for sm_90 (wgmma, with cp.async at the
default tiles and TMA with the producer warpgroup) with and without packed sequences."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("fla")


def _tensors() -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    k = torch.randn(1, 64, 2, 64, dtype=torch.bfloat16)
    v = torch.randn(1, 64, 2, 64, dtype=torch.bfloat16)
    return (k, v), torch.rand(1, 64, 2) + 0.1


def test_auto_and_triton_stay_on_triton_off_hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    from kdn.ops.triton.wy import use_tilelang

    tensors, beta = _tensors()
    monkeypatch.delenv("KDN_WY_KERNEL", raising=False)
    assert not use_tilelang(tensors, beta, None)
    assert not use_tilelang(tensors, beta, "auto")
    monkeypatch.setenv("KDN_WY_KERNEL", "triton")
    assert not use_tilelang(tensors, beta, None)


def test_a_forced_tilelang_off_hopper_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from kdn.ops.triton.wy import use_tilelang

    tensors, beta = _tensors()
    monkeypatch.setattr("triton.knobs.runtime.interpret", False)
    with pytest.raises(ValueError, match="sm_90 GPU.*KDN_WY_KERNEL=triton"):
        use_tilelang(tensors, beta, "tilelang")
    monkeypatch.setenv("KDN_WY_KERNEL", "tilelang")
    with pytest.raises(ValueError, match="KDN_WY_KERNEL=triton"):
        use_tilelang(tensors, beta, None)


@pytest.mark.parametrize("bad", ["cuda", "TileLang", "1"])
def test_an_unknown_kernel_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    from kdn.ops.triton.wy import use_tilelang

    tensors, beta = _tensors()
    monkeypatch.setenv("KDN_WY_KERNEL", bad)
    with pytest.raises(ValueError, match=r"is not one of \('auto', 'triton', 'tilelang'\): set KDN_WY_KERNEL") as e:
        use_tilelang(tensors, beta, None)
    assert "\n" not in str(e.value)


def test_fit_cuts_the_blocks_to_small_heads() -> None:
    from kdn.ops.tilelang import WYTiles, fit

    assert fit(WYTiles(block_k=128, block_v=128), 64, 128) == WYTiles(block_k=64, block_v=128)
    assert fit(WYTiles(), 128, 64).block_v == 64


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("ws", [False, True], ids=["cp.async", "producer"])
def test_the_tilelang_program_lowers_for_sm90(varlen: bool, ws: bool) -> None:
    tilelang = pytest.importorskip("tilelang")
    from tvm.target import Target

    from kdn.ops.tilelang.wy import WYTiles, _program, pass_configs

    tiles = WYTiles(warp_specialized=ws) if ws else WYTiles()
    target = Target("cuda -arch=sm_90")
    with target, tilelang.transform.PassContext(config=pass_configs(tiles)):
        source = tilelang.lower(_program(4, 128, 128, "bfloat16", "float32", varlen, tiles),
                                target=target).kernel_source
    assert "wgmma" in source
    assert ("tma_load" in source) == ws and "cp_async" in source
