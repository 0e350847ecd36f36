"""Random KDN inputs shared by the kdn tests (never zeros)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def make_inputs(
    B: int, T: int, H: int, K: int, V: int, *, isotropic: bool = False, dtype: torch.dtype = torch.float64,
    g_min: float = -2.0, seed: int = 0, requires_grad: bool = False,
) -> dict[str, Tensor]:
    """``q, k`` (unit-norm k), ``v``, ``g in [g_min, 0)``, ``omega > 0``, ``r > 0``."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x = {
        "q": rnd(B, T, H, K),
        "k": F.normalize(rnd(B, T, H, K), dim=-1),
        "v": rnd(B, T, H, V),
        "g": g_min * torch.rand(B, T, H, K, generator=gen, dtype=torch.float64),
        "omega": torch.rand(*((B, T, H) if isotropic else (B, T, H, K)), generator=gen, dtype=torch.float64) + 0.05,
        "r": torch.rand(B, T, H, generator=gen, dtype=torch.float64) * 2 + 0.05,
    }
    return {n: t.to(dtype).requires_grad_(requires_grad) for n, t in x.items()}


def make_state(B: int, H: int, K: int, V: int, *, isotropic: bool, dtype: torch.dtype = torch.float64,
               seed: int = 1) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    S = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64)
    p = torch.rand(*((B, H) if isotropic else (B, H, K)), generator=gen, dtype=torch.float64) + 0.1
    return S.to(dtype), p.to(dtype)


def rel_err(x: Tensor, ref: Tensor) -> float:
    """``||x - ref|| / ||ref||`` in float64."""
    x, ref = x.detach().double(), ref.detach().double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()
