"""Batched greedy decoding through a model's Hugging Face interface and its decoding cache.

A batch of prompts is left-padded and prefilled once. Our models (:class:`models.KDNForCausalLM`, unless a subclass
redefines ``forward``) decode through :func:`models.generate`: a packed prefill, then static one-token steps
(captured in a CUDA graph on the GPU). Any other model with Hugging Face's interface decodes through its cache:
every step feeds only the newest token (``past_key_values``) and the grown padding mask. Either way the prefix is
never run again. Prompts are batched longest first, which keeps padding small and shows the slowest batches (and
any out-of-memory) at the start.

The batch size is an int, or (``batch_size=auto``, the default) resolved per device by :func:`resolve_batch_size`:
:data:`CPU_BATCH` on the CPU; on CUDA a :class:`BatchSearch` per class of prompts (one RULER context length) grows
the batch in place, on the prompts being decoded, until memory runs out or samples/s stops improving. A row's greedy
tokens do not depend on the other rows of its batch in exact arithmetic (left padding is masked; the packed prefill
and the static step keep rows apart), and the CPU and CUDA FP32 tests find them equal at every batch size; in bf16
the kernels' rounding depends on the batch's shape, so near-tied tokens may differ between batch sizes. The suites
therefore record every cell's batches.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from time import perf_counter
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


AUTO = "auto"
CPU_BATCH = 8  # `auto` on the CPU: a fixed small batch, so that CPU runs (the tests, the offline demo's 4-sample
# cells) spend nothing on a search


def resolve_batch_size(value: object, device: torch.device | str) -> int | str:
    """The batch size of a run: a positive int as given; ``"auto"`` on a CUDA device stays ``"auto"`` (each suite
    then finds its own: :class:`BatchSearch`, lm-eval's ``batch_size="auto"``), elsewhere it is :data:`CPU_BATCH`.
    Anything else is refused in one line."""
    if value == AUTO:
        return AUTO if torch.device(device).type == "cuda" else CPU_BATCH
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"batch_size must be 'auto' or a positive int, got {value!r}; pass batch_size=auto or "
                         "e.g. batch_size=64")
    return value


class BatchSearch:
    """``batch_size=auto`` on CUDA for one class of prompts (one RULER context length), searched in place.

    The prompts being decoded are the probe: batches start at ``start`` rows (at most ``cap``, the samples of a
    cell) and the size doubles, up to ``cap``, while a doubled batch decodes at least ``1 + threshold`` times the
    samples/s of the last one; a size that runs out of memory, or is no faster by that much, ends the search at the
    last size before it, which every later batch uses. So the search costs only its slower batches, not extra
    decoding. Each size counts the fastest of its first ``repeats`` full batches: the first batch at a new size also
    pays one-off costs that the run pays once anyway (a CUDA graph capture; Triton compiling and autotuning kernels
    for new shapes). An
    out-of-memory error once the search ended (a longer prompt later) halves the size. Results may depend on the
    batches in bf16 (see the module docstring), so the suites record them.
    """

    def __init__(self, start: int = 64, cap: int = 512, threshold: float = 0.1, repeats: int = 2) -> None:
        if start < 1 or cap < 1 or repeats < 1 or threshold < 0:
            raise ValueError(f"BatchSearch needs start, cap, repeats >= 1 and threshold >= 0, got start={start}, "
                             f"cap={cap}, repeats={repeats}, threshold={threshold}")
        self.size = min(start, cap)  # the rows of the next batch
        self.cap, self.threshold, self.repeats = cap, threshold, repeats
        self.done = False  # the search has ended: `size` is kept (halved only on out-of-memory)
        self.rates: dict[int, float] = {}  # size -> best samples/s of its measured batches
        self.runs: dict[int, int] = {}  # size -> full batches measured
        self.too_big: int | None = None  # the smallest size that ran out of memory

    def record(self, rows: int, seconds: float) -> None:
        """A batch of ``rows`` prompts decoded in ``seconds`` at :attr:`size`; a shorter batch (the last of a cell)
        measures nothing."""
        if self.done or rows < self.size:
            return
        b = self.size
        self.rates[b] = max(self.rates.get(b, 0.0), rows / seconds)
        self.runs[b] = self.runs.get(b, 0) + 1
        if self.runs[b] < self.repeats:
            return
        smaller = [s for s in self.rates if s < b and self.runs[s] >= self.repeats]
        if smaller and self.rates[b] < (1 + self.threshold) * self.rates[max(smaller)]:
            self.size, self.done = max(smaller), True
            return
        bigger = 2 * b
        if bigger > self.cap or (self.too_big is not None and bigger >= self.too_big):
            self.done = True
        else:
            self.size = bigger

    def out_of_memory(self) -> None:
        """A batch of :attr:`size` rows ran out of memory: the search ends at the largest measured size below it,
        or (none yet) tries half the size; an ended search halves its size. Raises when one row does not fit."""
        b = self.size
        fitted = [s for s in self.rates if s < b and self.runs[s] >= self.repeats]
        if not self.done and fitted:
            self.size, self.done = max(fitted), True
            return
        if b == 1:
            raise torch.cuda.OutOfMemoryError("one prompt alone does not fit in GPU memory; evaluate shorter "
                                              "contexts or a smaller model, or free the GPU")
        self.too_big = b if self.too_big is None else min(self.too_big, b)
        self.size = b // 2


def greedy_generate(model: Any, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, stop_ids: set[int],
                    pad_id: int, batch_size: int | BatchSearch = CPU_BATCH,
                    on_batch: Callable[[int], None] | None = None) -> list[list[int]]:
    """Greedy continuations of ``prompts`` (token lists) in batches, longest first; returned in the input order.

    ``batch_size``: rows per batch, or a :class:`BatchSearch` that sets each batch's size from the speed of the
    last ones (a batch that runs out of memory is run again, smaller). ``on_batch(n)`` is called after each batch
    of ``n`` prompts (progress bars; the sizes actually run)."""
    search = batch_size if isinstance(batch_size, BatchSearch) else None
    if search is None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size must be >= 1 or a BatchSearch, got {batch_size!r}")
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    results: list[list[int]] = [[] for _ in prompts]
    s = 0
    while s < len(order):
        chunk = order[s: s + (search.size if search is not None else batch_size)]
        t0 = perf_counter()
        try:
            gens = greedy_batch(model, [prompts[i] for i in chunk], max_new_tokens=max_new_tokens,
                                stop_ids=stop_ids, pad_id=pad_id)
        except torch.cuda.OutOfMemoryError:
            if search is None:
                raise
            gens = None  # out of the handler first: its traceback holds the failed batch's tensors
        if gens is None:
            from models.generation import release

            search.out_of_memory()
            release(model)  # static decoders of the sizes tried hold memory the smaller batch needs
            torch.cuda.empty_cache()
            continue
        if search is not None:
            search.record(len(chunk), perf_counter() - t0)  # the tokens are on the host: the batch has finished
        for i, gen in zip(chunk, gens):
            results[i] = gen
        s += len(chunk)
        if on_batch is not None:
            on_batch(len(chunk))
    return results
