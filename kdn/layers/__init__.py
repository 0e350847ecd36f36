"""The KDN mixers as ``nn.Module``s (as fla's ``fla/layers``) and their decoding cache."""
from kdn.layers.cache import RecurrentCache
from kdn.layers.kdn import MU_CHOICES, NOISE_CHOICES, DiagonalKDN, IsotropicKDN

__all__ = ["DiagonalKDN", "IsotropicKDN", "RecurrentCache", "MU_CHOICES", "NOISE_CHOICES"]
