"""The decoding cache's batch operations for every mixer and pattern: a reordered, selected or repeated cache equals
the cache of the reordered, selected or repeated batch (every stored tensor, tuples of states included) and decodes
the same next token; beam search and ``num_return_sequences`` equal the per-sequence and the uncached runs; a
permuted batch decodes as the permuted results."""
from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch
from kdn_inputs import rel_err

import models
from models import MIXERS, build_model, model_config

warnings.filterwarnings("ignore", message=".*Triton is not supported.*")

V = 256
PATTERNS = ("recurrent", "hybrid_swa")
PROMPT = 12  # the toy sliding window is 16 tokens: prompt + new tokens run past it


def _model(mixer: str, pattern: str, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(model_config("toy", mixer, pattern, vocab_size=V)).to(dtype).eval()


def _tokens(B: int, T: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, V, (B, T), generator=torch.Generator().manual_seed(seed))


def _leaves(value: object, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor stored in a cache entry, with its path (dicts, tuples and lists walked)."""
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, dict):
        for key in sorted(value, key=str):
            yield from _leaves(value[key], f"{path}.{key}")
    elif isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            yield from _leaves(v, f"{path}[{i}]")


def _assert_same_cache(got: models.KDNCache, want: models.KDNCache) -> None:
    assert got.seen_tokens == want.seen_tokens
    assert sorted(got.layers) == sorted(want.layers)
    for i in want.layers:
        a, b = dict(_leaves(got.layers[i])), dict(_leaves(want.layers[i]))
        assert sorted(a) == sorted(b), f"layer {i}: stored entries differ"
        for path, t in b.items():
            assert a[path].shape == t.shape, f"layer {i} {path}: shape {tuple(a[path].shape)} != {tuple(t.shape)}"
            assert rel_err(a[path], t) <= 1e-12, f"layer {i} {path}"


def _prefill(model: torch.nn.Module, ids: torch.Tensor) -> models.KDNCache:
    with torch.no_grad():
        return model(ids, use_cache=True).recurrent_cache


def _next_logits(model: torch.nn.Module, token: torch.Tensor, cache: models.KDNCache) -> torch.Tensor:
    with torch.no_grad():
        return model(token, cache=cache, use_cache=True).logits[:, -1]


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("mixer", list(MIXERS))
def test_reorder_select_repeat_equal_the_transformed_batch(mixer: str, pattern: str) -> None:
    model = _model(mixer, pattern)
    ids = _tokens(3, PROMPT)
    nxt = _tokens(3, 1, seed=2)
    n_tuples = sum(isinstance(v, tuple) for state in _prefill(model, ids).layers.values() for v in state.values())
    if mixer != "attn":
        assert n_tuples > 0, "the recurrent layers store tuples of states (the case under test)"
    cases = {
        "reorder_cache": (torch.tensor([2, 0, 1]), lambda c, i: c.reorder_cache(i)),
        "batch_select_indices": (torch.tensor([2, 0]), lambda c, i: c.batch_select_indices(i)),
        "batch_repeat_interleave": (torch.tensor([0, 0, 1, 1, 2, 2]), lambda c, i: c.batch_repeat_interleave(2)),
    }
    for name, (rows, op) in cases.items():
        cache = _prefill(model, ids)
        op(cache, rows)
        want = _prefill(model, ids[rows])
        _assert_same_cache(cache, want)
        got_logits = _next_logits(model, nxt[rows], cache)
        assert rel_err(got_logits, _next_logits(model, nxt[rows], want)) <= 1e-12, name


class _RecordReorders:
    """Records the beam indices ``generate`` reorders the cache with."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[torch.Tensor] = []
        original = models.KDNCache.reorder_cache

        def reorder(cache: models.KDNCache, beam_idx: torch.LongTensor) -> None:
            self.calls.append(beam_idx.clone())
            original(cache, beam_idx)

        monkeypatch.setattr(models.KDNCache, "reorder_cache", reorder)

    def moved_a_beam(self) -> bool:
        return any(not torch.equal(i, torch.arange(len(i))) for i in self.calls)


BEAM = {"max_new_tokens": 8, "num_beams": 2, "do_sample": False, "pad_token_id": 0, "eos_token_id": None,
        "early_stopping": True}


@pytest.mark.parametrize("mixer", list(MIXERS))
def test_beam_search_equals_per_sequence_and_uncached_runs(mixer: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(mixer, "hybrid_swa", torch.float32)
    ids = _tokens(2, PROMPT, seed=3)
    record = _RecordReorders(monkeypatch)
    with torch.no_grad():
        batched = model.generate(ids, num_return_sequences=2, **BEAM)
        uncached = model.generate(ids, num_return_sequences=2, use_cache=False, **BEAM)
        single = [model.generate(ids[i:i + 1], num_return_sequences=2, **BEAM) for i in range(2)]
        top = model.generate(ids, **BEAM)
    assert record.moved_a_beam(), "the beams never swapped: the reorder is not exercised"
    assert batched.shape == (4, PROMPT + 8)
    assert torch.equal(batched, uncached)
    assert torch.equal(batched, torch.cat(single))
    assert torch.equal(top, batched[::2])


@pytest.mark.parametrize("mixer", list(MIXERS))
def test_permuted_batch_decodes_as_the_permuted_results(mixer: str) -> None:
    model = _model(mixer, "hybrid_swa", torch.float32)
    ids = _tokens(3, PROMPT, seed=4)
    perm = torch.tensor([1, 2, 0])
    kw = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0, "eos_token_id": None}
    with torch.no_grad():
        out = model.generate(ids, **kw)
        out_perm = model.generate(ids[perm], **kw)
    assert torch.equal(out_perm, out[perm])
    assert not torch.equal(out[0, PROMPT:], out[1, PROMPT:])  # the rows differ: the permutation is visible
