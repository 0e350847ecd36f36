"""Batched greedy decoding through a model's Hugging Face interface and its decoding cache.

A batch of prompts is left-padded and prefilled once. Our models (:class:`models.KDNForCausalLM`, unless a subclass
redefines ``forward``) decode through :func:`models.generate`: a packed prefill, then static one-token steps
(captured in a CUDA graph on the GPU). Any other model with Hugging Face's interface decodes through its cache:
every step feeds only the newest token (``past_key_values``) and the grown padding mask. Either way the prefix is
never run again. Prompts are batched longest first, which keeps padding small and shows the slowest batches (and
any out-of-memory) at the start.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor


def _cache_of(out: Any) -> Any:
    """The decoding cache of a model output (``past_key_values``, or ``cache`` in newer transformers)."""
    cache = getattr(out, "past_key_values", None)
    return cache if cache is not None else getattr(out, "cache", None)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """``(input_ids [B, L], attention_mask [B, L])`` with each prompt right-aligned (left padding)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        ids[i, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


@torch.no_grad()
def greedy_batch(model: Any, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, stop_ids: set[int],
                 pad_id: int) -> list[list[int]]:
    """Greedy continuations of one batch of token prompts, each cut before its first token in ``stop_ids``
    (at most ``max_new_tokens`` tokens). Decoding ends once every row has stopped."""
    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, pad_id, device)
    from models import KDNForCausalLM, generate

    if isinstance(model, KDNForCausalLM) and type(model).forward is KDNForCausalLM.forward:
        gen = generate(model, ids, max_new_tokens, attention_mask=mask, eos_token_id=sorted(stop_ids),
                       pad_token_id=pad_id)
        cut = []
        for row, n in zip(gen.sequences[:, ids.shape[1]:].tolist(), gen.lengths.tolist()):
            row = row[:n]
            cut.append(row[: next((j for j, t in enumerate(row) if t in stop_ids), n)])
        return cut
    B = ids.shape[0]
    out = model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
    cache = _cache_of(out)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    stops = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
    steps: list[Tensor] = []
    for t in range(max_new_tokens):
        nxt = out.logits[:, -1].argmax(-1)
        done |= torch.isin(nxt, stops)
        steps.append(torch.where(done, torch.full_like(nxt, -1), nxt))
        if bool(done.all()) or t == max_new_tokens - 1:
            break
        mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device=device)], 1)
        out = model(input_ids=nxt[:, None], attention_mask=mask, past_key_values=cache, use_cache=True)
        cache = _cache_of(out)
    table = torch.stack(steps, 1).tolist() if steps else [[] for _ in range(B)]
    return [row[: row.index(-1)] if -1 in row else row for row in table]


def greedy_generate(model: Any, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, stop_ids: set[int],
                    pad_id: int, batch_size: int = 8,
                    on_batch: Callable[[int], None] | None = None) -> list[list[int]]:
    """Greedy continuations of ``prompts`` (token lists) in batches of ``batch_size``, longest first; returned in
    the input order. ``on_batch(n)`` is called after each batch of ``n`` prompts (progress bars)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    results: list[list[int]] = [[] for _ in prompts]
    for s in range(0, len(order), batch_size):
        chunk = order[s: s + batch_size]
        for i, gen in zip(chunk, greedy_batch(model, [prompts[i] for i in chunk], max_new_tokens=max_new_tokens,
                                              stop_ids=stop_ids, pad_id=pad_id)):
            results[i] = gen
        if on_batch is not None:
            on_batch(len(chunk))
    return results
