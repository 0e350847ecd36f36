"""Fast generation for :class:`models.KDNForCausalLM`: one packed prefill, then a one-token step of constant host
cost over static buffers, replayed from a CUDA graph on CUDA.

- **Prefill**: a left-padded batch ``[B, T]`` is packed into ``[1, sum of lengths]`` with ``cu_seqlens`` (no padding
  is computed) and run once through the model with a :class:`models.cache.KDNCache`; the logits of each prompt's last
  token give the first new token, and the cache is copied into a :class:`models.cache.StaticKDNCache`.
- **Decode**: :class:`StaticDecoder` runs the model on ``[bucket, 1]`` token ids against the static cache: every
  layer reads and writes fixed buffers (recurrent states, conv windows, attention rings), with no host sync; an
  attention layer reads only the prefix of its ring that the call's context needs (:func:`ring_views`). On CUDA the
  step is captured once per (batch bucket, dtype, autocast dtype, attention ring lengths, ring views) and replayed;
  graphs live on the model (:func:`decoders`) and are reused by later calls.
- **Sampling**: greedy, temperature, top-k, top-p (Gumbel-max draws, no host sync); EOS tokens and stop strings end
  rows independently; the host looks at the rows every ``check_every`` tokens (the only syncs of the loop).

``generate(model, input_ids, max_new_tokens, ...)`` returns :class:`GenerateOutput`; ``model.generate(...)`` routes
here on CUDA (see :meth:`models.KDNForCausalLM.generate`).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from models.cache import KDNCache, StaticKDNCache

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
RING_MULTIPLE = 256  # a full-attention ring's length is rounded up to it, so that close lengths share a graph


@dataclass
class GenerateOutput:
    """``sequences [B, T + n]`` (the prompts as given, then the new tokens, ``pad`` after a row's end);
    ``lengths [B]``: new tokens per row (its EOS or stop string included); ``scores [B, n, V]``: the FP32 logits of
    every new token (``output_scores``), else ``None``."""

    sequences: Tensor
    lengths: Tensor
    scores: Tensor | None = None


@dataclass
class DecoderPool:
    """The static decoders of one model, keyed by ``(bucket, dtype, autocast dtype, device, cuda_graph)``, with the
    graphs' memory pool and the parameter addresses and versions they were captured against."""

    decoders: dict[tuple, StaticDecoder] = field(default_factory=dict)
    params: tuple[tuple[int, int], ...] = ()
    pool: Any = None
    replaced: int = 0  # graphs captured by decoders since replaced (longer attention rings)

    @property
    def captures(self) -> int:
        """CUDA graphs captured so far."""
        return self.replaced + sum(d.captures for d in self.decoders.values())


def decoders(model: torch.nn.Module) -> DecoderPool:
    """The model's :class:`DecoderPool` (created on first use; emptied when a parameter moved or was updated in place
    since, as its version counter tells: the graphs read weights that the layers keep between steps, such as the
    stacked input projections)."""
    params = tuple((p.data_ptr(), p._version) for p in model.parameters())
    pool = model.__dict__.get("_static_decoders")
    if pool is None or pool.params != params:
        pool = DecoderPool(params=params)
        model.__dict__["_static_decoders"] = pool
    return pool


class StaticDecoder:
    """The one-token step of ``model`` for ``batch_size`` rows over a :class:`StaticKDNCache`.

    ``ids [batch_size, 1]`` is the input buffer; :meth:`step` returns the logits ``[batch_size, V]`` of the next
    token (a buffer the graph rewrites on every replay when captured). The step reads the cache's current ring views
    (:meth:`StaticKDNCache.set_views`); one CUDA graph is kept per views, all in the memory pool ``pool``, so
    switching between views captured before captures nothing.
    """

    def __init__(self, model: torch.nn.Module, batch_size: int, ring_lengths: dict[int, int], device: torch.device,
                 cuda_graph: bool, pool: Any = None) -> None:
        self.model, self.batch_size, self.cuda_graph, self.pool = model, batch_size, cuda_graph, pool
        self.cache = StaticKDNCache(batch_size, ring_lengths)
        self.ids = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
        self.graphs: dict[tuple[int, ...], tuple[torch.cuda.CUDAGraph, Tensor]] = {}  # views -> (graph, logits)
        self.captures = 0

    @property
    def views(self) -> tuple[int, ...]:
        """The cache's ring views, one per attention layer (the key of the step's graph)."""
        return tuple(self.cache.views.values())

    @property
    def graph(self) -> torch.cuda.CUDAGraph | None:
        """The step's CUDA graph for the current views (``None`` before :meth:`capture`)."""
        captured = self.graphs.get(self.views)
        return captured[0] if captured is not None else None

    def _forward(self) -> Tensor:
        out = self.model(input_ids=self.ids, cache=self.cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1]

    def capture(self) -> None:
        """Capture the step in a CUDA graph (after two warm-up steps on a side stream). The warm-up and the capture
        advance the state: load the prefill afterwards."""
        # under autocast, casts must not come from autocast's weight cache: its tensors are freed when the outer
        # autocast region ends, while the graph would keep reading their memory
        amp = torch.autocast("cuda", enabled=torch.is_autocast_enabled("cuda"),
                             dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), amp:
            for _ in range(2):
                self._forward()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool), amp:
            logits = self._forward()
        self.graphs[self.views] = graph, logits
        self.captures += 1

    def step(self) -> Tensor:
        """The next-token logits ``[batch_size, V]`` of the tokens in :attr:`ids`; the cache advances one token."""
        captured = self.graphs.get(self.views)
        if captured is not None:
            captured[0].replay()
            return captured[1]
        return self._forward()


def check_prompts(input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
    """The boolean mask ``[B, T]`` of real tokens, after checking the prompts: 2-D token ids, a mask of the same
    shape with each row left-padded (zeros, then ones) and at least one token."""
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        raise ValueError(f"input_ids must be an integer tensor [B, T], got {getattr(input_ids, 'shape', input_ids)!r}")
    if attention_mask is None:
        return torch.ones_like(input_ids, dtype=torch.bool)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {list(attention_mask.shape)} but input_ids "
                         f"{list(input_ids.shape)}; pass one 0/1 entry per prompt token")
    mask = attention_mask.to(device=input_ids.device) != 0
    if bool((mask[:, 1:] < mask[:, :-1]).any()):
        raise ValueError("attention_mask must be left-padded (each row zeros, then ones); pad prompts on the left")
    if not bool(mask[:, -1].all()):
        raise ValueError("every prompt needs at least one token (a row of attention_mask is all zeros)")
    return mask


def _round_up(n: int) -> int:
    return -(-n // RING_MULTIPLE) * RING_MULTIPLE


def ring_lengths(model: torch.nn.Module, longest: int, max_cache_len: int | None) -> dict[int, int]:
    """Each attention layer's ring: its window when sliding; for full attention ``max_cache_len`` (default: the
    ``longest`` context rounded up to :data:`RING_MULTIPLE`), which must hold ``longest`` tokens. A decoder's rings
    may be longer than a call's (they grow to the longest call); each call reads its :func:`ring_views`."""
    from models.layers.attention import Attention

    rings = {}
    for i, block in enumerate(model.model.layers):
        mixer = block.mixer
        if not isinstance(mixer, Attention):
            continue
        if mixer.window is not None:
            rings[i] = mixer.window
            continue
        cap = max_cache_len if max_cache_len is not None else _round_up(longest)
        if longest > cap:
            raise ValueError(f"the prompt and new tokens need {longest} positions but the full-attention layers hold "
                             f"max_cache_len={cap}; shorten the prompt, lower max_new_tokens or raise max_cache_len")
        rings[i] = cap
    return rings


def ring_views(rings: dict[int, int], longest: int) -> dict[int, int]:
    """The slots each attention layer reads for contexts of ``longest`` positions (prompt and new tokens): the first
    ``longest`` rounded up to :data:`RING_MULTIPLE`, at most its whole ring ``rings[layer]``. Exact: below the view no
    token wraps (a prompt of ``L`` keys fills slots ``[0, L)``, the new tokens the next ones), so the slots past it
    hold no valid key; a sliding layer whose window is shorter than ``longest`` reads (and wraps) its whole ring."""
    need = _round_up(longest)
    return {i: min(n, need) for i, n in rings.items()}


@torch.no_grad()
def prefill(model: torch.nn.Module, input_ids: Tensor, mask: Tensor) -> tuple[Tensor, KDNCache]:
    """Run the left-padded prompts ``input_ids [B, T]`` (``mask [B, T]`` of real tokens) once, packed: returns the
    last token's logits ``[B, V]`` (FP32) and the cache of the ``B`` sequences."""
    lengths = mask.sum(1)
    cu_seqlens = F.pad(lengths.cumsum(0), (1, 0))
    packed = input_ids[mask][None]
    cache = KDNCache()
    h, cache, _ = model.model(packed, cache=cache, use_cache=True, cu_seqlens=cu_seqlens)
    logits = model.lm_head(h[0, cu_seqlens[1:] - 1])
    return logits.float(), cache


def select(logits: Tensor, do_sample: bool, temperature: float, top_k: int, top_p: float,
           generator: torch.Generator | None) -> Tensor:
    """The next token of each row, ``[B]``, from ``logits [B, V]``: the argmax, or a draw from
    ``softmax(logits / temperature)`` restricted to the ``top_k`` most likely tokens and to the smallest set of
    probability ``>= top_p``."""
    if not do_sample:
        return logits.argmax(-1)
    x = logits.float() / temperature
    if top_k:
        kth = x.topk(min(top_k, x.shape[-1]), -1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = x.sort(-1, descending=True)
        probs = sorted_x.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # the most likely token always stays
        x = torch.full_like(x, float("-inf")).scatter(-1, order, sorted_x.masked_fill(drop, float("-inf")))
    u = torch.rand(x.shape, generator=generator, device=x.device).clamp_(min=1e-20)
    return (x - (-u.log()).log()).argmax(-1)


def _decoder(model: torch.nn.Module, bucket: int, rings: dict[int, int], device: torch.device,
             cuda_graph: bool) -> StaticDecoder:
    """The model's decoder for ``bucket`` rows in the current dtype and autocast state: one per such key, reused while
    its attention rings hold ``rings`` (a full-attention ring at least as long); otherwise replaced by one whose rings
    are the larger of both, so that the cache memory stays that of one decoder per key."""
    pool = decoders(model)
    dtype = next(model.parameters()).dtype
    amp = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
    key = (bucket, dtype, amp, device, cuda_graph)
    decoder = pool.decoders.get(key)
    if decoder is not None and all(decoder.cache.ring_lengths[i] >= n for i, n in rings.items()):
        return decoder
    if decoder is not None:
        rings = {i: max(n, decoder.cache.ring_lengths[i]) for i, n in rings.items()}
        pool.replaced += decoder.captures
        del pool.decoders[key]
    if cuda_graph and pool.pool is None:
        pool.pool = torch.cuda.graph_pool_handle()
    decoder = StaticDecoder(model, bucket, rings, device, cuda_graph, pool.pool)
    pool.decoders[key] = decoder
    return decoder


def release(model: torch.nn.Module) -> None:
    """Drop the model's static decoders (their caches and CUDA graphs)."""
    model.__dict__.pop("_static_decoders", None)


def _check_settings(max_new_tokens: int, temperature: float, top_k: int, top_p: float, check_every: int,
                    stop_strings: Sequence[str] | None, tokenizer: Any) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}; use do_sample=False for greedy decoding")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0: no limit), got {top_k!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 1:
        raise ValueError(f"check_every must be a positive int, got {check_every!r}")
    if stop_strings and tokenizer is None:
        raise ValueError("stop_strings need a tokenizer (with a decode method) to read the new tokens; pass tokenizer=")


def _bucket(B: int, batch_buckets: Sequence[int] | None) -> int:
    buckets = sorted(batch_buckets) if batch_buckets is not None else None
    if buckets is None:
        return next((b for b in BUCKETS if b >= B), 1 << (B - 1).bit_length())
    if not buckets or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in buckets):
        raise ValueError(f"batch_buckets must be positive ints, got {batch_buckets!r}")
    if B > buckets[-1]:
        raise ValueError(f"a batch of {B} rows is larger than the largest batch bucket ({buckets[-1]}); split the "
                         "batch or add a larger bucket to batch_buckets")
    return next(b for b in buckets if b >= B)


def _stop_ends(out: Tensor, lengths: Tensor, since: int, steps: int, stop_strings: Sequence[str],
               tokenizer: Any) -> dict[int, int]:
    """Rows whose new tokens (the first ``steps``, or up to the row's end when an EOS or a stopping criterion ended
    it) contain a stop string: ``{row: new tokens up to and including the token that completes it}``. Rows that
    ended within ``since`` tokens were read by the previous look and are skipped."""
    tokens = out[:, :steps].tolist()
    ends = {}
    for row, n in enumerate(lengths.clamp(max=steps).tolist()):
        if n <= since:
            continue
        toks = tokens[row][:n]
        if not any(s in tokenizer.decode(toks) for s in stop_strings):
            continue
        lo, hi = 1, n  # the shortest prefix whose text holds a stop string
        while lo < hi:
            mid = (lo + hi) // 2
            if any(s in tokenizer.decode(toks[:mid]) for s in stop_strings):
                hi = mid
            else:
                lo = mid + 1
        ends[row] = lo
    return ends


@torch.no_grad()
def generate(
    model: torch.nn.Module, input_ids: Tensor, max_new_tokens: int, *, attention_mask: Tensor | None = None,
    do_sample: bool = False, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
    eos_token_id: int | Sequence[int] | None = None, pad_token_id: int | None = None,
    stop_strings: str | Sequence[str] | None = None, tokenizer: Any = None, cuda_graph: bool | None = None,
    batch_buckets: Sequence[int] | None = None, max_cache_len: int | None = None,
    generator: torch.Generator | None = None, output_scores: bool = False, check_every: int = 16,
    stopping_criteria: Sequence[Any] | None = None,
) -> GenerateOutput:
    """Generate up to ``max_new_tokens`` tokens per prompt with a packed prefill and static one-token steps.

    Args:
        model: a :class:`models.KDNForCausalLM` (its parameters' dtype is the decoding dtype).
        input_ids: ``[B, T]`` prompts, left-padded when of different lengths.
        max_new_tokens: new tokens per row at most.
        attention_mask: ``[B, T]``, 1 for tokens and 0 for (left) padding; ``None``: no padding.
        do_sample, temperature, top_k, top_p: greedy decoding, or sampling (``top_k = 0`` and ``top_p = 1``: no cut).
        eos_token_id: token(s) that end a row (kept in the output); ``None``: rows run to ``max_new_tokens``.
        pad_token_id: fills a row after its end (default: the first EOS token, else 0).
        stop_strings: strings that end a row once its new text contains one (needs ``tokenizer``).
        cuda_graph: capture and replay the step (default: on CUDA); ``False`` runs the same step eagerly.
        batch_buckets: the batch sizes a step is built for (default :data:`BUCKETS`, then powers of two); a batch
            runs in the smallest bucket that holds it, the rows beyond it idle.
        max_cache_len: positions a full-attention layer holds (prompt and new tokens); default the need, rounded
            up to :data:`RING_MULTIPLE`. However long a decoder's rings have grown, a step reads the first slots of
            each, the need rounded up to :data:`RING_MULTIPLE` (:func:`ring_views`).
        generator: the random generator of sampling (on the model's device).
        output_scores: also return every new token's FP32 logits.
        check_every: new tokens between the host's looks at EOS and stop strings (its only syncs).
        stopping_criteria: callables ``(sequences [B, T + t], scores) -> bool [B]`` (``transformers``'
            ``StoppingCriteria``), called after every new token (a host sync each); a row they flag ends there.

    Returns:
        :class:`GenerateOutput` (``sequences [B, T + n]``, ``n`` the most new tokens of any row).
    """
    if isinstance(stop_strings, str):
        stop_strings = [stop_strings]
    _check_settings(max_new_tokens, temperature, top_k, top_p, check_every, stop_strings, tokenizer)
    mask = check_prompts(input_ids, attention_mask)
    B, T = input_ids.shape
    device = input_ids.device
    bucket = _bucket(B, batch_buckets)
    longest = int(mask.sum(1).max()) + max_new_tokens
    rings = ring_lengths(model, longest, max_cache_len)
    eos = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
    if cuda_graph is None:
        cuda_graph = device.type == "cuda"
    if cuda_graph and device.type != "cuda":
        raise ValueError("cuda_graph=True needs the model and input_ids on a CUDA device; pass cuda_graph=False")

    logits, cache = prefill(model, input_ids, mask)
    decoder = None
    if max_new_tokens > 1:
        decoder = _decoder(model, bucket, rings, device, cuda_graph)
        decoder.cache.set_views(ring_views(decoder.cache.ring_lengths, longest))
        decoder.cache.load(cache, B)
        if cuda_graph and decoder.graph is None:
            decoder.capture()
            decoder.cache.load(cache, B)
    del cache

    eos_t = torch.tensor(eos, device=device, dtype=torch.long)
    out = torch.full((B, max_new_tokens), pad, dtype=torch.long, device=device)
    lengths = torch.full((B,), max_new_tokens, dtype=torch.long, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    scores = [] if output_scores else None
    steps = since = 0  # since: new tokens when the host last looked at the stop strings
    tok = out[:, 0]
    for t in range(max_new_tokens):
        if t:
            decoder.ids[:B, 0].copy_(tok)
            logits = decoder.step()[:B]
        if scores is not None:
            scores.append(logits.float().clone())
        tok = select(logits, do_sample, temperature, top_k, top_p, generator)
        tok = torch.where(done, pad, tok)
        out[:, t] = tok
        steps = t + 1
        if eos:
            ends = torch.isin(tok, eos_t) & ~done
            lengths = torch.where(ends, t + 1, lengths)
            done = done | ends
        if stopping_criteria:
            seqs = torch.cat([input_ids, out[:, :steps]], 1)
            flagged = torch.zeros(B, dtype=torch.bool, device=device)
            for criterion in stopping_criteria:
                flagged = flagged | torch.as_tensor(criterion(seqs, logits), device=device).to(torch.bool)
            ends = flagged & ~done
            lengths = torch.where(ends, t + 1, lengths)
            done = done | ends
        ended = bool(stopping_criteria) and bool(done.all())  # the criteria sync every token anyway
        if ended or ((eos or stop_strings) and (steps % check_every == 0 or steps == max_new_tokens)):
            if stop_strings:  # a stop string completed before a row's EOS (or criterion) in this window ends it there
                for row, end in _stop_ends(out, lengths, since, steps, stop_strings, tokenizer).items():
                    lengths[row] = end
                    done[row] = True
                since = steps
            if bool(done.all()):
                break
    n = int(lengths.max()) if bool(done.all()) else steps
    new = out[:, :n]
    new = new.masked_fill(torch.arange(n, device=device)[None] >= lengths[:, None], pad)
    lengths = lengths.clamp(max=n)
    score = torch.stack(scores, 1)[:, :n] if scores is not None else None
    return GenerateOutput(torch.cat([input_ids, new], 1), lengths, score)


# generation-config fields read by hf_generate; any other field away from transformers' default goes to HF's loop
_HF_FIELDS = frozenset({
    "max_length", "max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "stop_strings", "use_cache",
    "pad_token_id", "bos_token_id", "eos_token_id", "output_scores", "output_logits", "return_dict_in_generate",
    "max_cache_len", "cache_implementation", "_from_model_config", "transformers_version",
})
_HF_ARGUMENTS = frozenset({"input_ids", "attention_mask", "tokenizer"})


def hf_generate(model: torch.nn.Module, inputs: Tensor | None, generation_config: Any, stopping_criteria: Any,
                kwargs: dict[str, Any], others: dict[str, Any]) -> Any:
    """``model.generate(...)`` through :func:`generate` when the request is one it serves, with transformers'
    semantics (its generation config and defaults, ``max_length`` counting the prompt, ``pad`` after a row's end,
    sequences as long as the longest row): greedy or sampling, EOS, stop strings, stopping criteria, ``max_cache_len``,
    and with greedy decoding ``return_dict_in_generate`` with ``output_scores`` / ``output_logits``. Returns ``None``
    for anything else (beams, logits processors, penalties, streamers, ...), which HF's loop then runs.
    ``others``: the rest of ``generate``'s named arguments (each must be ``None``)."""
    import copy

    from transformers import GenerationConfig
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    if any(v is not None for v in others.values()):
        return None
    kwargs = dict(kwargs)
    ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
    if ids is None:
        return None
    gc = copy.deepcopy(generation_config if generation_config is not None else model.generation_config)
    unused = gc.update(**kwargs)
    if set(unused) - _HF_ARGUMENTS:
        return None
    defaults = GenerationConfig._get_default_generation_params()

    def value(name: str) -> Any:
        v = getattr(gc, name, None)
        return defaults.get(name) if v is None else v

    for name in vars(GenerationConfig()):  # unset, off or at transformers' default
        v = value(name)
        if name not in _HF_FIELDS and not (v is None or v is False or v == defaults.get(name)):
            return None
    do_sample = bool(value("do_sample"))
    if value("return_dict_in_generate") and do_sample:
        return None
    T = ids.shape[1]
    max_new = gc.max_new_tokens if gc.max_new_tokens is not None else value("max_length") - T
    if max_new < 1:
        return None
    eos = value("eos_token_id")
    pad = value("pad_token_id")
    if pad is None and eos is not None:
        pad = eos if isinstance(eos, int) else list(eos)[0]
    want_scores = bool(value("return_dict_in_generate")) and (value("output_scores") or value("output_logits"))
    res = generate(model, ids, max_new, attention_mask=unused.get("attention_mask"), do_sample=do_sample,
                   temperature=float(value("temperature")), top_k=int(value("top_k") or 0),
                   top_p=float(value("top_p")), eos_token_id=eos, pad_token_id=pad,
                   stop_strings=value("stop_strings"), tokenizer=unused.get("tokenizer"),
                   max_cache_len=value("max_cache_len"), output_scores=bool(want_scores),
                   stopping_criteria=stopping_criteria or None)
    if not value("return_dict_in_generate"):
        return res.sequences
    steps = tuple(res.scores.unbind(1)) if res.scores is not None else None
    return GenerateDecoderOnlyOutput(sequences=res.sequences, scores=steps if value("output_scores") else None,
                                     logits=steps if value("output_logits") else None)
