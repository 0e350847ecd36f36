"""Where a generation ends, checked token by token against the free-running continuation: ``max_length`` counts the
prompt on the static path as in Hugging Face's loop; a stop string completed after the last multiple of
``check_every`` still ends its row, and so does one completed before an EOS or a stopping criterion that ends the
row later in the same ``check_every`` window (the row ends at the earlier of the two, whatever ``check_every``)."""
from __future__ import annotations

import pytest
import torch
from test_generation_eos import NEW, T, _Chars, _check_rows, _model, _prompts

from models.generation import generate


@pytest.fixture(scope="module")
def case() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A toy model, two left-padded prompts and each row's ``NEW`` free-running greedy tokens."""
    model = _model("kdn_diag")
    ids, mask = _prompts()
    free = generate(model, ids, NEW, attention_mask=mask, cuda_graph=False).sequences[:, T:]
    return model, ids, mask, free


def test_max_length_counts_the_prompt_on_the_static_path(case: tuple) -> None:
    """``max_length=T + 5``: five new tokens, the same sequences as Hugging Face's loop."""
    model, ids, mask, free = case
    kw = {"attention_mask": mask, "max_length": T + 5, "do_sample": False, "pad_token_id": 0, "eos_token_id": None}
    static = model.generate(ids, static_decode=True, **kw)
    assert static.shape == (2, T + 5)
    assert torch.equal(static[:, T:], free[:, :5])
    assert torch.equal(static, model.generate(ids, static_decode=False, **kw))


def _first_end(tokens: list[int], stop: str) -> int:
    """New tokens up to the one whose text first holds ``stop`` (all of them when none does)."""
    return next((t + 1 for t in range(len(tokens)) if stop in _Chars.decode(tokens[:t + 1])), len(tokens))


def test_a_stop_string_in_the_last_partial_check_window_ends_its_row(case: tuple) -> None:
    """With ``check_every=4`` and ``max_new_tokens=6``, tokens 5-6 are looked at only at the length limit: a stop
    string first completed there still ends the row (its length and padding), the other row runs to the limit."""
    model, ids, mask, free = case
    n = 6
    row0, row1 = free[0, :n].tolist(), free[1, :n].tolist()
    stop = next(s for s in (_Chars.decode(row0[a:b]) for b in (5, 6) for a in range(b - 3, b - 1))
                if 4 < _first_end(row0, s) < n and s not in _Chars.decode(row1))
    res = generate(model, ids, n, attention_mask=mask, pad_token_id=0, stop_strings=stop, tokenizer=_Chars(),
                   cuda_graph=False, check_every=4)
    ends = [_first_end(row0, stop), n]
    assert res.lengths.tolist() == ends
    _check_rows(res.sequences, free, ends, 0)


def _stop_then_eos(row: list[int]) -> tuple[str, int, int]:
    """A two-token stop string that first completes at new token ``k`` of ``row`` and an EOS (``row[k]``) that would
    end the row one token later: ``(stop, eos, k)``."""
    for k in range(3, len(row) - 2):
        stop, eos = _Chars.decode(row[k - 2:k]), row[k]
        if _first_end(row, stop) == k and eos not in row[:k]:
            return stop, eos, k
    raise AssertionError(f"no stop string followed by a new EOS in {row}")


@pytest.mark.parametrize("check_every", [1, 16])
def test_a_stop_string_before_a_later_eos_in_one_window_ends_the_row(case: tuple, check_every: int) -> None:
    model, ids, mask, free = case
    rows = free.tolist()
    stop, eos, k = _stop_then_eos(rows[0])
    ends = [min(_first_end(r, stop), next((t + 1 for t, x in enumerate(r) if x == eos), NEW)) for r in rows]
    assert ends[0] == k
    res = generate(model, ids, NEW, attention_mask=mask, eos_token_id=eos, pad_token_id=0, stop_strings=stop,
                   tokenizer=_Chars(), cuda_graph=False, check_every=check_every)
    assert res.lengths.tolist() == ends
    _check_rows(res.sequences, free, ends, 0)


def test_a_stop_string_before_a_stopping_criterion_ends_the_row(case: tuple) -> None:
    """A criterion that ends every row one token after the stop string completes in row 0: row 0 keeps the stop
    string's end although the loop stops before the next multiple of ``check_every``."""
    model, ids, mask, free = case
    rows = free.tolist()
    stop, _, k = _stop_then_eos(rows[0])

    def at_k_plus_1(seqs: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return torch.full((seqs.shape[0],), seqs.shape[1] - T >= k + 1)

    ends = [min(_first_end(r, stop), k + 1) for r in rows]
    res = generate(model, ids, NEW, attention_mask=mask, pad_token_id=0, stop_strings=stop, tokenizer=_Chars(),
                   cuda_graph=False, check_every=16, stopping_criteria=[at_k_plus_1])
    assert res.lengths.tolist() == ends and ends[0] == k
    _check_rows(res.sequences, free, ends, 0)
