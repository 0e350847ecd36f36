"""Training FLOPs per token, for model FLOPs utilisation (MFU)."""
from __future__ import annotations

from models.configuration import KDNConfig
from models.layers.delta import DELTA_MIXERS
from models.registry import mamba3_state_size, mixer_heads
from models.sizes import build_on_meta

SCAN_CHUNK = 64


def _mixing_flops(cfg: KDNConfig, layer_idx: int, seq_len: int) -> float:
    """Forward FLOPs per token of a layer's sequence mixing (the part that is not a weight matmul)."""
    H, K = cfg.num_heads, cfg.head_dim
    name, kwargs = cfg.layer_mixer(layer_idx)
    if name == "attn":
        window = cfg.layer_window(layer_idx)
        context = sum(min(t + 1, window or seq_len) for t in range(seq_len)) / seq_len
        return 4.0 * H * K * context  # q k^T and p v
    if name in DELTA_MIXERS or name.startswith("kdn"):
        H = mixer_heads(cfg, kwargs)
        # chunked delta rule: state read, output and update (3 x K V), intra-chunk k k^T, q k^T and mixing
        return 2.0 * H * (3 * K * K + SCAN_CHUNK * (2 * K + K) / 2)
    if name.startswith("mamba3"):
        inner = int(kwargs.get("expand", 2) * cfg.hidden_size)
        P = kwargs.get("head_dim", 64)
        heads, N = inner // P, mamba3_state_size(cfg, kwargs)
        R = kwargs.get("mimo_rank", 4) if name == "mamba3_mimo" else 1
        chunk = kwargs.get("chunk_size", max(64 // R, 8) if R > 1 else 64)
        return 2.0 * heads * (3 * R * N * P + chunk * R * (R * N + P) / 2)
    raise ValueError(f"no FLOP model for mixer {name!r}")


def count_flops_per_token(cfg: KDNConfig, seq_len: int) -> float:
    """Approximate training FLOPs per token at context ``seq_len``: ``6 x`` the matmul parameters (every
    2-D weight, LM head included, embedding lookup excluded) plus ``3 x`` the forward sequence-mixing FLOPs
    (attention scores, chunked scans)."""
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    model = build_on_meta(cfg)
    embedding = model.model.embeddings.weight
    matmul = sum(p.numel() for p in model.parameters() if p.dim() == 2 and p is not embedding)
    if cfg.tie_word_embeddings:
        matmul += embedding.numel()
    mixing = sum(_mixing_flops(cfg, i, seq_len) for i in range(cfg.num_layers))
    return 6.0 * matmul + 3.0 * mixing
