"""The LM head's chunked linear cross-entropy against ``F.cross_entropy(F.linear(...))`` and autograd."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kdn_inputs import rel_err

from models import build_model, model_config
from models.layers.lm_head import LMHead, linear_cross_entropy


def _case(N: int, d: int, V: int, ignored: int, dtype: torch.dtype = torch.float64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, d, generator=g, dtype=dtype).requires_grad_(True)
    w = (torch.randn(V, d, generator=g, dtype=dtype) / d ** 0.5).requires_grad_(True)
    target = torch.randint(0, V, (N,), generator=g)
    target[torch.randperm(N, generator=g)[:ignored]] = -100
    return x, w, target


@pytest.mark.parametrize(("N", "chunks", "ignored"), [(37, 1, 0), (37, 3, 5), (37, 8, 11), (5, 8, 1), (64, 4, 0)])
def test_matches_plain_cross_entropy_in_float64(N: int, chunks: int, ignored: int) -> None:
    x, w, target = _case(N, 24, 53, ignored)
    loss = linear_cross_entropy(x, target, w, num_chunks=chunks)
    dx, dw = torch.autograd.grad(3.0 * loss, (x, w))
    ref = F.cross_entropy(F.linear(x, w), target, ignore_index=-100)
    rdx, rdw = torch.autograd.grad(3.0 * ref, (x, w))
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=0)
    torch.testing.assert_close(dx, rdx, rtol=1e-11, atol=1e-14)
    torch.testing.assert_close(dw, rdw, rtol=1e-11, atol=1e-14)


def test_float32_inputs_and_a_batch_dimension() -> None:
    x, w, target = _case(2 * 19, 16, 40, 3, torch.float32, seed=1)
    xb, tb = x.detach().view(2, 19, 16).requires_grad_(True), target.view(2, 19)
    loss = linear_cross_entropy(xb, tb, w)
    loss.backward()
    ref = F.cross_entropy(F.linear(xb.double(), w.double()).flatten(0, 1), tb.flatten())
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=0)
    assert xb.grad.shape == (2, 19, 16) and xb.grad.dtype == torch.float32 and w.grad.dtype == torch.float32


def test_every_target_ignored_gives_zero_loss_and_gradients() -> None:
    x, w, target = _case(9, 8, 11, 9)
    loss = linear_cross_entropy(x, target, w, num_chunks=2)
    loss.backward()
    assert loss.item() == 0.0 and not x.grad.any() and not w.grad.any()


def test_shape_mismatch_names_the_shapes() -> None:
    x, w, target = _case(9, 8, 11, 0)
    with pytest.raises(ValueError, match=r"x \[9, 8\], target \[8\]"):
        linear_cross_entropy(x, target[:8], w)
    with pytest.raises(ValueError, match=r"weight \[11, 7\]"):
        linear_cross_entropy(x, target, w[:, :7])


def test_lm_head_gives_logits_or_the_loss() -> None:
    head = LMHead(8, 11).double()
    x, _, target = _case(9, 8, 11, 2)
    torch.testing.assert_close(head(x), x @ head.weight.t())
    torch.testing.assert_close(head(x, target), F.cross_entropy(head(x), target), rtol=1e-12, atol=0)


def test_model_loss_and_gradients_equal_the_unfused_path() -> None:
    torch.manual_seed(0)
    model = build_model(model_config("toy", "kdn_diag", "recurrent", vocab_size=97)).double().train()
    ids = torch.randint(0, 97, (2, 24))
    grads = {}
    for fused in (True, False):
        model.config.fuse_cross_entropy = fused
        model.zero_grad()
        out = model(ids, labels=ids)
        out.loss.backward()
        assert (out.logits is None) == fused
        grads[fused] = (out.loss.detach(), [p.grad.clone() for p in model.parameters()])
    torch.testing.assert_close(grads[True][0], grads[False][0], rtol=1e-12, atol=0)
    for a, b in zip(grads[True][1], grads[False][1]):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-13)


@pytest.mark.gpu
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16], ids=["autocast", "bf16-params"])
def test_cuda_bf16_matches_float64_and_fla(weight_dtype: torch.dtype) -> None:
    """On CUDA: bf16 activations with FP32 (autocast) or bf16 (FSDP2) weights, against the float64 loss and
    gradients and against fla's fused linear cross-entropy (whose weight gradient sums in FP32 on TF32)."""
    from fla.modules import FusedLinearCrossEntropyLoss

    torch.backends.cuda.matmul.allow_tf32 = True
    x64, w64, target = _case(8192, 512, 8000, 700, seed=3)
    target = target.cuda()
    ref = F.cross_entropy(F.linear(x64.cuda(), w64.cuda()), target)
    rdx, rdw = torch.autograd.grad(ref, (x64, w64))
    results = {}
    for name in ("ours", "fla"):
        x = x64.detach().cuda().bfloat16().requires_grad_(True)
        w = w64.detach().cuda().to(weight_dtype).requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = (linear_cross_entropy(x, target, w) if name == "ours"
                    else FusedLinearCrossEntropyLoss()(x, target, w))
        loss.backward()
        assert loss.dtype == torch.float32 and x.grad.dtype == torch.bfloat16 and w.grad.dtype == weight_dtype
        results[name] = (loss.detach(), x.grad, w.grad)
    loss, dx, dw = results["ours"]
    assert rel_err(loss, ref) < 1e-3 and rel_err(dx, rdx.cuda()) < 1e-2 and rel_err(dw, rdw.cuda()) < 1e-2
    floss, fdx, fdw = results["fla"]
    assert rel_err(loss, floss) < 1e-5 and rel_err(dx, fdx) < 1e-3 and rel_err(dw, fdw) < 1e-3
