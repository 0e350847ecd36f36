"""Held-out loss and perplexity of a model on prepared token shards (``data.prepare``)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch


@torch.no_grad()
def shard_perplexity(
    model: Any, shard_dir: str | Path, *, split: str = "val", seq_len: int = 2048, batch_size: int = 4,
    max_batches: int | None = None,
) -> dict[str, float]:
    """Token-weighted mean next-token loss over ``split`` of ``shard_dir`` and its ``exp``."""
    from data import TokenLoader

    loader = TokenLoader(shard_dir, split=split, seq_len=seq_len, batch_size=batch_size)
    if loader.vocab_size > model.config.vocab_size:
        raise ValueError(f"the shards' vocabulary ({loader.vocab_size}) exceeds the model's "
                         f"({model.config.vocab_size}); evaluate with the tokenizer the model was trained on")
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for i, batch in enumerate(loader):
        if max_batches is not None and i >= max_batches:
            break
        ids = batch["input_ids"].to(device)
        loss = model(input_ids=ids, labels=ids).loss
        n = ids.numel() - ids.shape[0]  # shifted targets
        total += float(loss) * n
        count += n
    if count == 0:
        raise ValueError(f"no {split} windows of {seq_len} tokens in {shard_dir}; lower seq_len")
    return {"loss": total / count, "ppl": math.exp(total / count), "tokens": count}
