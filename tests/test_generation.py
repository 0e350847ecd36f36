"""models.generation on the CPU at toy size: the graph-free static path (packed prefill, static one-token steps) gives
the tokens and logits of HF's cached loop and of the full forward for every mixer and pattern; left-padded batches
equal per-sample runs; the prefill's states equal token-by-token feeding; EOS, stop strings and stopping criteria end
rows independently; sampling options; the HF route; one-line errors for bad input."""
from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
import torch.utils._python_dispatch

from models import MIXERS, build_model, model_config
from models.generation import decoders, generate, prefill, release
from models.layers.attention import sliding_attention

warnings.filterwarnings("ignore", message=".*Triton is not supported.*")

V = 256
CASES = [(m, p) for m in MIXERS for p in ("recurrent", "hybrid_swa")] + [("kdn_diag", "RSA"), ("kda", "RA")]
NEW = 12  # with prompts of up to 9 tokens, past the toy window of 16: the sliding rings wrap


def _model(mixer: str, pattern: str) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = {"num_layers": len(pattern)} if pattern not in ("recurrent", "hybrid_swa") else {}
    return build_model(model_config("toy", mixer, pattern, vocab_size=V, **layers)).float().eval()


def _prompts(lengths: tuple[int, ...], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Left-padded ``ids, mask [B, max(lengths)]`` and the unpadded rows."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(3, V, (n,), generator=g) for n in lengths]
    T = max(lengths)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, T - len(r):], mask[i, T - len(r):] = r, 1
    return ids, mask, rows


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize(("mixer", "pattern"), CASES)
def test_static_path_matches_cached_loop_full_forward_and_single_rows(mixer: str, pattern: str) -> None:
    model = _model(mixer, pattern)
    ids, mask, rows = _prompts((9, 5, 7))  # three rows: bucket 4, one idle row
    res = generate(model, ids, NEW, attention_mask=mask, output_scores=True, cuda_graph=False)
    assert res.sequences.shape == (3, 9 + NEW) and res.lengths.tolist() == [NEW] * 3
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                         eos_token_id=None, output_scores=True, return_dict_in_generate=True, static_decode=False)
    assert torch.equal(res.sequences, ref.sequences)
    assert _rel(res.scores, torch.stack(ref.scores, 1)) < 1e-5
    with torch.no_grad():
        for i, r in enumerate(rows):
            seq = torch.cat([r, res.sequences[i, 9:]])[None]
            full = model(seq).logits[0, len(r) - 1:-1]
            assert _rel(res.scores[i], full) < 1e-5
            if pattern == "recurrent" and i:  # per-sample runs: every pattern with attention, and one row otherwise
                continue
            single = generate(model, r[None], NEW, output_scores=True, cuda_graph=False)
            assert torch.equal(single.sequences[0, len(r):], res.sequences[i, 9:])
            assert _rel(single.scores[0], res.scores[i]) < 1e-5


@pytest.mark.parametrize(("mixer", "pattern"), [("kdn_diag", "hybrid_swa"), ("gdn2", "RA"), ("mamba3_mimo", "RS")])
def test_prefill_state_equals_token_by_token(mixer: str, pattern: str) -> None:
    """The packed prefill's cache (recurrent states, conv windows, the keys and values a step reads) equals the cache
    after feeding each prompt alone, one token at a time."""
    model = _model(mixer, pattern)
    ids, mask, rows = _prompts((21, 4))  # longer than the toy window (16): sliding attention by blocks
    _, packed = prefill(model, ids, mask.bool())
    for i, r in enumerate(rows):
        with torch.no_grad():
            out = model(r[None, :1], use_cache=True)
            for t in range(1, len(r)):
                out = model(r[None, t:t + 1], past_key_values=out.recurrent_cache, use_cache=True)
        for layer, state in out.recurrent_cache.layers.items():
            mine = packed.layers[layer]
            if "k" in state:  # attention: the row's real keys and values (the latest last) and its next position
                n = int(mine["valid"][i].sum())
                assert n == state["k"].shape[2]
                for name in ("k", "v"):
                    assert _rel(mine[name][i, :, -n:], state[name][0]) < 1e-6
                assert int(mine["next_pos"][i]) == len(r)
                continue
            flat_mine = [t[i] for t in _flatten(mine)]
            flat_ref = [t[0] for t in _flatten(state)]
            assert len(flat_mine) == len(flat_ref)
            for a, b in zip(flat_mine, flat_ref):
                assert a.shape == b.shape and _rel(a.float(), b.float()) < 1e-5


def _flatten(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for k in sorted(value) for t in _flatten(value[k])]
    return [t for v in value for t in _flatten(v)]


class _Chars:
    """A tokenizer stand-in: token ``t`` reads as one letter."""

    @staticmethod
    def decode(tokens: list[int]) -> str:
        return "".join(chr(97 + t % 26) for t in tokens)


def test_eos_stop_strings_and_criteria_end_rows_independently() -> None:
    model = _model("kdn_diag", "hybrid_swa")
    ids, mask, _ = _prompts((9, 6), seed=3)
    free = generate(model, ids, NEW, attention_mask=mask, cuda_graph=False).sequences[:, 9:]
    # EOS: the token row 0 makes at step 3, absent from row 1's new tokens before that
    eos = int(free[0, 3])
    end1 = next((t + 1 for t in range(NEW) if free[1, t] == eos), NEW)
    res = generate(model, ids, NEW, attention_mask=mask, eos_token_id=eos, pad_token_id=1, cuda_graph=False,
                   check_every=5)
    end0 = next(t + 1 for t in range(NEW) if free[0, t] == eos)
    assert res.lengths.tolist() == [end0, end1]
    new = res.sequences[:, 9:]
    assert new.shape[1] == max(end0, end1)
    for row, end in enumerate((end0, end1)):
        assert torch.equal(new[row, :end], free[row, :end]) and (new[row, end:] == 1).all()
    # a stop string: the text of row 1's new tokens 4..5
    text = _Chars.decode(free[1].tolist())
    stop = text[4:6]
    res = generate(model, ids, NEW, attention_mask=mask, stop_strings=stop, tokenizer=_Chars(), pad_token_id=1,
                   cuda_graph=False, check_every=3)
    ends = [next((t + 1 for t in range(NEW) if stop in _Chars.decode(free[r, :t + 1].tolist())), NEW) for r in (0, 1)]
    assert ends[1] <= 6 and res.lengths.tolist() == ends
    for row, end in enumerate(ends):
        assert torch.equal(res.sequences[row, 9:9 + end], free[row, :end])
        assert (res.sequences[row, 9 + end:] == 1).all()
    # a stopping criterion flags row 0 once it has 5 new tokens
    def criterion(seqs: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return torch.tensor([seqs.shape[1] - 9 >= 5, False])

    res = generate(model, ids, NEW, attention_mask=mask, stopping_criteria=[criterion], pad_token_id=1,
                   cuda_graph=False)
    assert res.lengths.tolist() == [5, NEW]
    assert torch.equal(res.sequences[1, 9:], free[1]) and (res.sequences[0, 14:] == 1).all()


def test_sampling_options() -> None:
    model = _model("gdn", "recurrent")
    ids, mask, _ = _prompts((6, 4), seed=5)
    greedy = generate(model, ids, 8, attention_mask=mask, output_scores=True, cuda_graph=False)
    for kw in ({"top_k": 1}, {"top_p": 1e-6}, {"temperature": 1e-4}):
        res = generate(model, ids, 8, attention_mask=mask, do_sample=True, cuda_graph=False,
                       generator=torch.Generator().manual_seed(0), **kw)
        assert torch.equal(res.sequences, greedy.sequences), kw

    def draw(seed: int) -> torch.Tensor:
        return generate(model, ids, 8, attention_mask=mask, do_sample=True, top_k=3, temperature=2.0,
                        output_scores=True, cuda_graph=False, generator=torch.Generator().manual_seed(seed))

    a, b, c = draw(0), draw(0), draw(1)
    assert torch.equal(a.sequences, b.sequences) and not torch.equal(a.sequences, c.sequences)
    top3 = a.scores.topk(3, -1).indices
    assert (top3 == a.sequences[:, 6:, None]).any(-1).all()


def test_hf_generate_routes_with_static_decode_and_reuses_decoders() -> None:
    model = _model("kdn_iso", "hybrid_swa")
    ids, mask, _ = _prompts((7, 3), seed=7)
    kw = {"attention_mask": mask, "max_new_tokens": 9, "do_sample": False, "pad_token_id": 0, "eos_token_id": None}
    hf = model.generate(ids, **kw)
    assert "_static_decoders" not in model.__dict__  # on the CPU, HF's loop unless asked
    ours = model.generate(ids, static_decode=True, **kw)
    assert torch.equal(ours, hf)
    pool = decoders(model)
    assert len(pool.decoders) == 1
    model.generate(ids, static_decode=True, **kw)
    model.generate(ids[:1], static_decode=True, **{**kw, "attention_mask": mask[:1]})  # bucket 1
    assert len(pool.decoders) == 2 and pool.captures == 0
    # what the static path does not serve (beams) goes to HF's loop
    beams = model.generate(ids, static_decode=True, num_beams=2, **kw)
    assert torch.equal(beams, model.generate(ids, num_beams=2, **kw))


def test_bad_input_gets_one_line_errors() -> None:
    model = _model("kdn_diag", "RA")
    ids, mask, _ = _prompts((9, 5))
    cases = [
        ({"max_cache_len": 16}, "max_cache_len"),  # 9 + 12 positions > 16: the full-attention limit
        ({"batch_buckets": (1,)}, "largest batch bucket"),
        ({"attention_mask": mask[:, 1:]}, "attention_mask has shape"),
        ({"attention_mask": mask.flip(1)}, "left-padded"),
        ({"stop_strings": "x"}, "tokenizer"),
        ({"top_p": 0.0}, "top_p"),
    ]
    for kw, words in cases:
        kw = {"attention_mask": mask, **kw}
        with pytest.raises(ValueError, match=words) as err:
            generate(model, ids, NEW, cuda_graph=False, **kw)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="CUDA"):
        generate(model, ids, NEW, attention_mask=mask, cuda_graph=True)


INPLACE_SCRIPT = r"""
import json, sys, torch
sys.path.insert(0, "tests")
import triton_interpret
triton_interpret.lean_device_calls()
from kdn.ops import fused_recurrent
from kdn_inputs import make_inputs, make_state, rel_err

out = {}
for iso in (False, True):
    x = make_inputs(2, 1, 3, 12, 40, isotropic=iso, seed=3)
    S0, u0 = make_state(2, 3, 12, 40, isotropic=iso)
    args = [x[n].float() for n in ("q", "k", "v", "g", "omega", "r")]
    mu = torch.tensor([0.5, 3.0, 12.0])
    step = fused_recurrent.fused_recurrent_isotropic_kdn if iso else fused_recurrent.fused_recurrent_diagonal_kdn
    o, (S, u) = step(*args, mu, (S0.float(), u0.float()))
    S_buf = S0.float().clone()
    o2, (S2, u2) = step(*args, mu, (S_buf, u0.float()), inplace=True)
    out["iso" if iso else "diag"] = {"same_buffer": S2.data_ptr() == S_buf.data_ptr(), "o": rel_err(o2, o),
                                     "S": rel_err(S2, S), "u": rel_err(u2, u)}
print(json.dumps(out))
"""


def test_inplace_fused_step_equals_the_copying_step_interpreted() -> None:
    """The fused KDN step (Triton's interpreter) updating a static memory in place gives the copying step's values."""
    triton_interpret = pytest.importorskip("triton_interpret")  # tests/triton_interpret.py
    res = triton_interpret.run_interpreted(INPLACE_SCRIPT, timeout=300)
    for name, r in res.items():
        assert r.pop("same_buffer"), name
        assert all(e == 0.0 for e in r.values()), (name, r)


def test_full_attention_rings_grow_and_are_reused() -> None:
    """One decoder per batch bucket: a longer context replaces it by one with a longer full-attention ring, which
    shorter contexts then reuse; the tokens do not depend on the ring's length."""
    model = _model("kdn_diag", "RA")
    ids, mask, _ = _prompts((9, 5))
    pool = decoders(model)
    short = generate(model, ids, 4, attention_mask=mask, cuda_graph=False, max_cache_len=16)
    assert [d.cache.ring_lengths for d in pool.decoders.values()] == [{1: 16}]
    generate(model, ids, NEW, attention_mask=mask, cuda_graph=False)  # 9 + 12 positions: a ring of 256
    assert [d.cache.ring_lengths for d in pool.decoders.values()] == [{1: 256}]
    again = generate(model, ids, 4, attention_mask=mask, cuda_graph=False, max_cache_len=16)
    assert len(pool.decoders) == 1 and torch.equal(again.sequences, short.sequences)
    release(model)
    assert "_static_decoders" not in model.__dict__


@pytest.mark.parametrize("window", [1, 5, 16, 40])
def test_sliding_attention_by_blocks_equals_the_banded_mask(window: int) -> None:
    q, k, v = (torch.randn(2, 3, 37, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
               for i in range(3))
    i = torch.arange(37)
    band = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=band)
    assert _rel(sliding_attention(q, k, v, window), ref) < 1e-12


class _HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the ops that read a tensor's value on the host (a sync on CUDA) or make a data-dependent shape."""

    SYNCING = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "item"}

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func.overloadpacket.__name__ in self.SYNCING:
            self.seen.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("mixer", "pattern"), [(m, "hybrid_swa") for m in MIXERS] + [("kdn_diag", "RSA")])
def test_static_step_reads_nothing_on_the_host(mixer: str, pattern: str) -> None:
    """The one-token step over the static cache (what a CUDA graph captures) has no host read of a tensor value."""
    model = _model(mixer, pattern)
    ids, mask, _ = _prompts((9, 5))
    generate(model, ids, 2, attention_mask=mask, cuda_graph=False)
    (decoder,) = decoders(model).decoders.values()
    with torch.no_grad(), _HostReads() as reads:
        decoder.step()
    assert reads.seen == []


def test_decoding_sees_in_place_weight_updates() -> None:
    """The stacked input projections kept between decoding steps are rebuilt after an optimiser step, and the static
    decoders with them: the next tokens' logits equal those of the full forward of the updated model."""
    model = _model("kdn_diag", "hybrid_swa")
    ids, mask, _ = _prompts((7, 5))
    generate(model, ids, 4, attention_mask=mask, cuda_graph=False)
    pool = decoders(model)
    owners = (model.model.layers[0].mixer.front, model.model.layers[0].mlp)  # input projections, SwiGLU
    stacks = [o.__dict__["_stacked_weights"][1] for o in owners]
    generate(model, ids, 4, attention_mask=mask, cuda_graph=False)
    assert decoders(model) is pool  # unchanged weights: the decoders and the stacks are reused
    assert all(o.__dict__["_stacked_weights"][1] is t for o, t in zip(owners, stacks))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(ids).logits.square().mean().backward()
    opt.step()
    res = generate(model, ids, 4, attention_mask=mask, output_scores=True, cuda_graph=False)
    assert decoders(model) is not pool
    assert not any(o.__dict__["_stacked_weights"][1] is t for o, t in zip(owners, stacks))
    with torch.no_grad():
        full = model(res.sequences[:1]).logits[0, 6:-1]
    assert _rel(res.scores[0], full) < 1e-5


def _windowed_model() -> torch.nn.Module:
    """Recurrent, sliding (window 300) and full attention: short contexts read a 256-slot view of the 300-slot ring."""
    torch.manual_seed(0)
    cfg = model_config("toy", "kdn_diag", "RSA", vocab_size=V, num_layers=3, window=300)
    return build_model(cfg).float().eval()


def _views_seen(model: torch.nn.Module) -> dict[int, list[int]]:
    """Record the ring slots each attention layer's one-token step reads (``k.shape[2]``)."""
    seen: dict[int, list[int]] = {1: [], 2: []}
    for i, slots in seen.items():
        mixer = model.model.layers[i].mixer

        def step(x: torch.Tensor, state: dict, slots: list[int] = slots, inner: Callable = mixer.static_step
                 ) -> torch.Tensor:
            slots.append(state["k"].shape[2])
            return inner(x, state)

        mixer.static_step = step
    return seen


def _check_full_forward(model: torch.nn.Module, res: object, rows: list[torch.Tensor], T: int) -> None:
    with torch.no_grad():
        for i, r in enumerate(rows):
            full = model(torch.cat([r, res.sequences[i, T:]])[None]).logits[0, len(r) - 1:-1]
            assert torch.equal(res.scores[i].argmax(-1), res.sequences[i, T:])
            assert _rel(res.scores[i], full) < 1e-5


def test_short_contexts_read_a_prefix_view_of_the_rings() -> None:
    """9 + 12 positions read the first 256 slots of the sliding ring (300) and the same logits as the full forward;
    a view is checked and a prefill longer than it is refused."""
    model = _windowed_model()
    seen = _views_seen(model)
    ids, mask, rows = _prompts((9, 5))
    res = generate(model, ids, NEW, attention_mask=mask, output_scores=True, cuda_graph=False)
    _check_full_forward(model, res, rows, 9)
    (decoder,) = decoders(model).decoders.values()
    cache = decoder.cache
    assert cache.ring_lengths == {1: 300, 2: 256} and cache.views == {1: 256, 2: 256}
    assert seen == {1: [256] * (NEW - 1), 2: [256] * (NEW - 1)}
    assert cache.get(1)["k"].shape[2] == 256 and cache.get(1)["k"].data_ptr() == cache.layers[1]["k"].data_ptr()
    for views in ({1: 301}, {1: 0}, {0: 8}):
        with pytest.raises(ValueError, match="cannot read a view") as err:
            cache.set_views(views)
        assert "\n" not in str(err.value)
    cache.set_views({1: 8})
    with pytest.raises(ValueError, match="at least 9 slots"):
        cache.load(prefill(model, ids, mask.bool())[1], 2)


def test_long_contexts_wrap_the_sliding_ring_at_the_window() -> None:
    """290 + 20 positions pass the window (300): the sliding layer reads and wraps its whole ring, the full-attention
    layer a ring of 512; the logits are the full forward's."""
    model = _windowed_model()
    seen = _views_seen(model)
    ids, mask, rows = _prompts((290, 250), seed=2)
    res = generate(model, ids, 20, attention_mask=mask, output_scores=True, cuda_graph=False)
    _check_full_forward(model, res, rows, 290)
    (decoder,) = decoders(model).decoders.values()
    assert decoder.cache.views == {1: 300, 2: 512} and seen == {1: [300] * 19, 2: [512] * 19}
    assert int(decoder.cache.layers[1]["cursor"]) == 290 + 19  # past the ring: slots 0..8 were written again


def test_views_hold_the_prompt_and_the_new_tokens() -> None:
    """250 + 20 positions cross 256: a view sized for the prompt alone (256) would wrap the new tokens inside it.
    Both layers read 512 slots or their whole ring (the sliding one: 300), and the logits are the full forward's."""
    model = _windowed_model()
    seen = _views_seen(model)
    ids, mask, rows = _prompts((250, 245), seed=3)
    res = generate(model, ids, 20, attention_mask=mask, output_scores=True, cuda_graph=False)
    _check_full_forward(model, res, rows, 250)
    (decoder,) = decoders(model).decoders.values()
    assert decoder.cache.views == {1: 300, 2: 512} and seen == {1: [300] * 19, 2: [512] * 19}


def test_one_decoder_switches_views_as_fresh_decoders_decode() -> None:
    """Long, short, then long contexts on one decoder (its rings kept, its views switched) give the tokens and logits
    of fresh decoders."""
    model = _windowed_model()
    long_ids, long_mask, _ = _prompts((290, 250), seed=2)
    short_ids, short_mask, _ = _prompts((9, 5))

    def run(ids: torch.Tensor, mask: torch.Tensor, new: int) -> object:
        return generate(model, ids, new, attention_mask=mask, output_scores=True, cuda_graph=False)

    fresh = []
    for ids, mask, new in ((long_ids, long_mask, 20), (short_ids, short_mask, NEW)):
        release(model)
        fresh.append(run(ids, mask, new))
    release(model)
    pool = decoders(model)
    used = []
    for (ids, mask, new), ref, views in zip(
            ((long_ids, long_mask, 20), (short_ids, short_mask, NEW), (long_ids, long_mask, 20)),
            (fresh[0], fresh[1], fresh[0]), ({1: 300, 2: 512}, {1: 256, 2: 256}, {1: 300, 2: 512})):
        res = run(ids, mask, new)
        (decoder,) = pool.decoders.values()
        used.append(decoder)
        assert decoder.cache.ring_lengths == {1: 300, 2: 512} and decoder.cache.views == views
        assert torch.equal(res.sequences, ref.sequences) and _rel(res.scores, ref.scores) < 1e-6
    assert used[0] is used[1] is used[2]
