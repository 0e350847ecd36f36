"""The KDN mixers as ``nn.Module``s (as fla's ``fla/layers``) and their decoding cache."""
from kdn.layers.cache import RecurrentCache
from kdn.layers.kdn import (
    MU_CHOICES,
    NOISE_CHOICES,
    DiagonalKDN,
    DiagonalKDNConfig,
    IsotropicKDN,
    IsotropicKDNConfig,
)

__all__ = ["DiagonalKDN", "IsotropicKDN", "DiagonalKDNConfig", "IsotropicKDNConfig", "RecurrentCache", "MU_CHOICES",
           "NOISE_CHOICES"]
