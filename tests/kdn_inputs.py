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


def packed_diagonal_gain(k: Tensor, g: Tensor, omega: Tensor, r: Tensor, mu: Tensor, p0: Tensor,
                         lens: tuple[int, ...] | None) -> tuple[Tensor, Tensor]:
    """The PyTorch reference Diagonal gain (``kdn.ops.torch_gain.diagonal_gain``) of ``[1, sum(lens), ...]`` packed
    sequences, one at a time (``lens`` None: the batch as it is); an empty sequence keeps its ``p0``. Returns
    ``kappa [1, T, H, K]`` and ``p_T [N, H, K]``."""
    import itertools

    from kdn.ops import torch_gain as gain

    if lens is None:
        return gain.diagonal_gain(k, g, omega, r, mu, p0)
    cu = [0, *itertools.accumulate(lens)]
    parts = [gain.diagonal_gain(k[:, a:b], g[:, a:b], omega[:, a:b], r[:, a:b], mu, p0[i:i + 1]) if b > a
             else (k[:, :0], p0[i:i + 1]) for i, (a, b) in enumerate(zip(cu, cu[1:]))]
    return torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 0)
