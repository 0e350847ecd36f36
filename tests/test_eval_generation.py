"""Batched greedy decoding over the decoding cache: left-padded batches (fixed, or grown by a batch search) equal
batch size 1 and the uncached reference, and the prefix runs once."""
from __future__ import annotations

import pytest
import torch

import models
from eval.generation import BatchSearch, greedy_generate, left_pad


@pytest.mark.parametrize("mixer,pattern", [("kdn_diag", "recurrent"), ("attn", "recurrent"),
                                           ("kdn_diag", "hybrid_swa")])
def test_batched_generation_equals_batch_size_1_and_the_uncached_reference(mixer: str, pattern: str) -> None:
    torch.manual_seed(0)
    model = models.build_model(models.model_config("toy", mixer, pattern, vocab_size=300)).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 33, 17, 2)]
    batched = greedy_generate(model, prompts, max_new_tokens=4, stop_ids={2}, pad_id=0, batch_size=4)
    single = greedy_generate(model, prompts, max_new_tokens=4, stop_ids={2}, pad_id=0, batch_size=1)
    assert batched == single
    with torch.no_grad():
        for p, got in list(zip(prompts, single))[:2]:
            ids = torch.tensor([p])
            for _ in range(4):
                nxt = int(model(input_ids=ids).logits[0, -1].argmax())
                ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
            assert got == ids[0, len(p):].tolist()
    # the last-token logits of a padded row match the unpadded row's
    ids, mask = left_pad([prompts[3], prompts[1]], 0, torch.device("cpu"))
    with torch.no_grad():
        padded = model(input_ids=ids, attention_mask=mask).logits[0, -1]
        alone = model(input_ids=torch.tensor([prompts[3]])).logits[0, -1]
    assert float((padded - alone).norm() / alone.norm()) < 1e-4


def test_the_prefix_runs_once_and_rows_stop_at_their_stop_token() -> None:
    torch.manual_seed(0)
    model = models.build_model(models.model_config("toy", "kdn_diag", vocab_size=300)).eval()
    steps: list[int] = []  # models.generate: one packed prefill of the backbone, then one-token steps of the LM
    backbone_calls: list[int] = []
    model.register_forward_pre_hook(lambda mod, args, kw: steps.append(kw["input_ids"].shape[1]), with_kwargs=True)
    model.model.register_forward_pre_hook(lambda mod, args, kw: backbone_calls.append(1), with_kwargs=True)
    prompts = [[5, 6, 7, 8], [9, 10]]
    free = greedy_generate(model, prompts, max_new_tokens=5, stop_ids={299}, pad_id=0, batch_size=2)
    assert steps == [1, 1, 1, 1] and len(backbone_calls) == 5 and all(len(x) == 5 for x in free)
    stop = free[0][2]  # stop the first row at its third token
    cut = greedy_generate(model, prompts, max_new_tokens=5, stop_ids={stop}, pad_id=0, batch_size=2)
    assert cut[0] == free[0][:free[0].index(stop)]
    assert cut[1] == (free[1][:free[1].index(stop)] if stop in free[1] else free[1])


def test_bad_batches_are_refused() -> None:
    model = models.build_model(models.model_config("toy", "kdn_diag", vocab_size=300)).eval()
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        greedy_generate(model, [[1, 2], []], max_new_tokens=2, stop_ids={2}, pad_id=0)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        greedy_generate(model, [[1, 2]], max_new_tokens=2, stop_ids={2}, pad_id=0, batch_size=0)


@pytest.mark.gpu
@pytest.mark.parametrize("pattern", ["recurrent", "hybrid_swa"])
def test_batched_generation_equals_batch_size_1_on_cuda(pattern: str) -> None:
    """The CUDA kernels (chunked prefill with a padding mask, the one-token step) decode left-padded batches as
    they decode each prompt alone (FP32 weights, so that greedy ties do not depend on rounding)."""
    torch.manual_seed(0)
    cfg = models.model_config("toy", "kdn_diag", pattern, vocab_size=300)
    model = models.build_model(cfg).cuda().eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (7, 130, 64, 1, 257)]
    batched = greedy_generate(model, prompts, max_new_tokens=16, stop_ids={2}, pad_id=0, batch_size=5)
    single = greedy_generate(model, prompts, max_new_tokens=16, stop_ids={2}, pad_id=0, batch_size=1)
    assert batched == single


@pytest.mark.gpu
def test_a_batch_search_on_cuda_decodes_as_a_fixed_batch() -> None:
    """batch_size=auto's in-place search (growing batches, each in a CUDA graph of its own bucket) gives every prompt
    the tokens that batches of one give it (FP32 weights)."""
    torch.manual_seed(0)
    model = models.build_model(models.model_config("toy", "kdn_diag", "recurrent", vocab_size=300)).cuda().eval()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist()
               for n in torch.randint(1, 300, (21,), generator=g).tolist()]
    search, ran = BatchSearch(start=1, cap=8), []
    auto = greedy_generate(model, prompts, max_new_tokens=8, stop_ids={2}, pad_id=0, batch_size=search,
                           on_batch=ran.append)
    assert auto == greedy_generate(model, prompts, max_new_tokens=8, stop_ids={2}, pad_id=0, batch_size=1)
    assert sum(ran) == 21 and ran[:2] == [1, 1] and max(ran) > 1
