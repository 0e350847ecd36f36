"""Ends of generation when the pad token is the EOS token (the usual setting: many tokenizers have no pad token), on
the CPU's eager static path, batched and single, and through ``model.generate``: a row ends at its first EOS and
stays ended while the pad tokens that fill it read as EOS; stop strings and the length limit end rows as before."""
from __future__ import annotations

import warnings

import pytest
import torch

from models import build_model, model_config
from models.generation import generate

warnings.filterwarnings("ignore", message=".*Triton is not supported.*")

V, NEW, T = 256, 12, 9


def _model(mixer: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(model_config("toy", mixer, "hybrid_swa", vocab_size=V)).float().eval()


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Two left-padded prompts of 9 and 6 tokens."""
    g = torch.Generator().manual_seed(3)
    ids, mask = torch.zeros(2, T, dtype=torch.long), torch.zeros(2, T, dtype=torch.long)
    for row, n in enumerate((9, 6)):
        ids[row, T - n:], mask[row, T - n:] = torch.randint(3, V, (n,), generator=g), 1
    return ids, mask


def _end(tokens: torch.Tensor, eos: int) -> int:
    """New tokens up to and including the first ``eos`` (all of them when there is none)."""
    return next((t + 1 for t in range(len(tokens)) if tokens[t] == eos), len(tokens))


class _Chars:
    """A tokenizer stand-in: token ``t`` is the letter ``t mod 26``."""

    @staticmethod
    def decode(tokens: list[int]) -> str:
        return "".join(chr(97 + t % 26) for t in tokens)


def _check_rows(sequences: torch.Tensor, free: torch.Tensor, ends: list[int], pad: int) -> None:
    new = sequences[:, T:]
    assert new.shape[1] == max(ends)
    for row, end in enumerate(ends):
        assert torch.equal(new[row, :end], free[row, :end]) and (new[row, end:] == pad).all(), row


@pytest.fixture(scope="module", params=["kdn_diag", "kda"])
def case(request: pytest.FixtureRequest) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The model, prompts, each row's free-running new tokens, and an EOS that ends row 0 early while row 1 goes on."""
    model = _model(request.param)
    ids, mask = _prompts()
    free = generate(model, ids, NEW, attention_mask=mask, cuda_graph=False).sequences[:, T:]
    # the first token of row 0 that it has not made before and that row 1 does not make until later
    eos = next(int(free[0, t]) for t in range(1, NEW - 2)
               if free[0, t] not in free[0, :t] and free[0, t] not in free[1, :t + 2])
    assert _end(free[0], eos) < _end(free[1], eos), "the case needs row 0 to end before row 1"
    return model, ids, mask, free, eos


def test_eos_as_pad_ends_each_row_once_batched(case) -> None:
    model, ids, mask, free, eos = case
    ends = [_end(free[0], eos), _end(free[1], eos)]
    for pad in (eos, None):  # None: the pad defaults to the EOS token
        res = generate(model, ids, NEW, attention_mask=mask, eos_token_id=eos, pad_token_id=pad, cuda_graph=False,
                       check_every=5)
        assert res.lengths.tolist() == ends
        _check_rows(res.sequences, free, ends, eos)


def test_eos_as_pad_ends_a_single_row(case) -> None:
    model, ids, mask, free, eos = case
    end = _end(free[0], eos)
    res = generate(model, ids[:1], NEW, eos_token_id=eos, pad_token_id=eos, cuda_graph=False, check_every=1)
    assert res.lengths.tolist() == [end] and torch.equal(res.sequences[0, T:], free[0, :end])


def test_eos_as_pad_through_model_generate_matches_hf_loop(case) -> None:
    model, ids, mask, free, eos = case
    kw = {"attention_mask": mask, "max_new_tokens": NEW, "do_sample": False, "eos_token_id": eos, "pad_token_id": eos}
    static = model.generate(ids, static_decode=True, **kw)
    loop = model.generate(ids, static_decode=False, **kw)
    assert torch.equal(static, loop)
    _check_rows(static, free, [_end(free[0], eos), _end(free[1], eos)], eos)


def test_stop_strings_and_max_length_with_eos_as_pad(case) -> None:
    model, ids, mask, free, eos = case
    # a stop string from row 1's last new tokens ends it, or its EOS first; each row ends at the earlier of the two
    stop = _Chars.decode(free[1].tolist())[-3:-1]

    def stop_end(row: int) -> int:
        return next((t + 1 for t in range(NEW) if stop in _Chars.decode(free[row, :t + 1].tolist())), NEW)

    ends = [min(_end(free[r], eos), stop_end(r)) for r in (0, 1)]
    res = generate(model, ids, NEW, attention_mask=mask, eos_token_id=eos, pad_token_id=eos, stop_strings=stop,
                   tokenizer=_Chars(), cuda_graph=False, check_every=2)
    assert res.lengths.tolist() == ends
    _check_rows(res.sequences, free, ends, eos)
    # an EOS no row makes: both rows run to the length limit
    absent = next(t for t in range(3, V) if not (free == t).any())
    res = generate(model, ids, NEW, attention_mask=mask, eos_token_id=absent, pad_token_id=absent, cuda_graph=False)
    assert res.lengths.tolist() == [NEW, NEW] and torch.equal(res.sequences[:, T:], free)
    short = _end(free[0], eos)  # a limit at row 0's end: row 1 runs to it
    res = generate(model, ids, short, attention_mask=mask, eos_token_id=eos, pad_token_id=eos, cuda_graph=False)
    assert res.lengths.tolist() == [short, short] and torch.equal(res.sequences[:, T:], free[:, :short])
