"""Ends of generation when the pad token is the EOS token, on CUDA with the step replayed from a CUDA graph, batched
and single: the graph path ends each row at its first EOS, as the eager path does (tests/test_generation_eos.py)."""
from __future__ import annotations

import pytest
import torch

from models import build_model, model_config
from models.generation import generate

pytestmark = pytest.mark.gpu

V, NEW, T = 256, 12, 9


@pytest.mark.parametrize("mixer", ["kdn_diag", "kda"])
def test_graph_path_ends_rows_at_eos_equal_to_pad(mixer: str) -> None:
    torch.manual_seed(0)
    model = build_model(model_config("toy", mixer, "hybrid_swa", vocab_size=V)).cuda().eval()
    g = torch.Generator().manual_seed(3)
    ids, mask = torch.zeros(2, T, dtype=torch.long), torch.zeros(2, T, dtype=torch.long)
    for row, n in enumerate((9, 6)):
        ids[row, T - n:], mask[row, T - n:] = torch.randint(3, V, (n,), generator=g), 1
    ids, mask = ids.cuda(), mask.cuda()
    free = generate(model, ids, NEW, attention_mask=mask, cuda_graph=True).sequences[:, T:]
    eager = generate(model, ids, NEW, attention_mask=mask, cuda_graph=False).sequences[:, T:]
    assert torch.equal(free, eager)
    eos = next(int(free[0, t]) for t in range(1, NEW - 2)
               if free[0, t] not in free[0, :t] and free[0, t] not in free[1, :t + 2])
    ends = [next((t + 1 for t in range(NEW) if free[r, t] == eos), NEW) for r in (0, 1)]
    assert ends[0] < ends[1]
    res = generate(model, ids, NEW, attention_mask=mask, eos_token_id=eos, pad_token_id=eos, cuda_graph=True,
                   check_every=5)
    assert res.lengths.tolist() == ends and res.sequences.shape[1] == T + ends[1]
    for row, end in enumerate(ends):
        assert torch.equal(res.sequences[row, T:T + end], free[row, :end])
        assert (res.sequences[row, T + end:] == eos).all()
    single = generate(model, ids[:1], NEW, eos_token_id=eos, pad_token_id=eos, cuda_graph=True, check_every=1)
    assert single.lengths.tolist() == [ends[0]] and torch.equal(single.sequences[0, T:], free[0, :ends[0]])
