"""The analytic floors of bench.roofline: hand-computed values, scaling, and the errors."""
from __future__ import annotations

import pytest

from bench import roofline


def test_flops_match_hand_count() -> None:
    # C=64, K=V=128: 6*64*128 + 4*64*128 + 2*64*64/3 + 6*128*128 FLOPs per token and head, forward; x3 fwd+bwd
    per = 6 * 64 * 128 + 4 * 64 * 128 + 2 * 64 * 64 / 3 + 6 * 128 * 128
    assert roofline.memory_flops(4, 8192, 16, 128, 128) == pytest.approx(3 * per * 4 * 8192 * 16)


def test_bytes_scale_with_tokens_and_differ_by_mixer() -> None:
    b1 = roofline.kernel_bytes("kdn_diag", 1, 1000, 4, 64, 64)
    assert roofline.kernel_bytes("kdn_diag", 2, 1000, 4, 64, 64) == pytest.approx(2 * b1)
    assert roofline.kernel_bytes("kdn_diag", 1, 3000, 4, 64, 64) == pytest.approx(3 * b1)
    # Diagonal's noise is per channel (FP32 [B,T,H,K]); Isotropic's per head
    assert roofline.kernel_bytes("kdn_diag", 1, 1000, 4, 64, 64) > roofline.kernel_bytes("kdn_iso", 1, 1000, 4, 64, 64)
    # one token, one head, K = V = 1, kda: inputs 3*2 (q,k,v) + 4 (g) + 2 (beta) = 12, output 2
    assert roofline.kernel_bytes("kda", 1, 1, 1, 1, 1) == (12 + 2) + (12 + 2 + 12)


def test_achieved_rates_and_errors() -> None:
    rates = roofline.achieved("kdn_iso", 4, 8192, 16, 128, 128, ms=10.0, device="NVIDIA H200")
    assert rates["kernel_tflops"] == pytest.approx(roofline.memory_flops(4, 8192, 16, 128, 128) / 1e-2 / 1e12)
    assert rates["hbm_frac"] == pytest.approx(rates["kernel_gbps"] / 4800)
    assert rates["tflops_frac"] == pytest.approx(rates["kernel_tflops"] / 989)
    # each GPU against its own ceilings; none for one the table does not know
    h100 = roofline.achieved("kdn_iso", 4, 8192, 16, 128, 128, ms=10.0, device="NVIDIA H100 80GB HBM3")
    assert h100["hbm_frac"] == pytest.approx(rates["kernel_gbps"] / 3350)
    assert roofline.ceilings("NVIDIA H100 PCIe") == (756.0, 2.0)
    other = roofline.achieved("kdn_iso", 4, 8192, 16, 128, 128, ms=10.0, device="NVIDIA A100-SXM4-80GB")
    assert "hbm_frac" not in other and other["kernel_gbps"] == rates["kernel_gbps"]
    with pytest.raises(ValueError, match="no byte model"):
        roofline.kernel_bytes("mamba3_siso", 1, 1, 1, 1, 1)
    with pytest.raises(ValueError, match="positive"):
        roofline.achieved("kda", 1, 1, 1, 1, 1, ms=0.0, device="NVIDIA H200")
