"""Block-sparse attention on CUDA (compiled flex_attention) against float64, beside the dense-mask path it replaces.

Each path of the attention layer (training windows and documents, padded rows, a prefill continued across the
window's edge, packed prefill) runs in bf16 on both backends; the block-sparse path must be as close to the float64
dense reference as the dense path is (within 1.5x its error on the same draw, as bench.attention_window measures over
20 draws), outputs and gradients. Compilation: none for new documents of a training shape, none for new prompt
lengths once dynamic shapes are compiled.
"""
from __future__ import annotations

import pytest
import torch

from kdn.layers import RecurrentCache
from models.layers.attention import Attention

pytestmark = pytest.mark.gpu

D, H, K = 256, 4, 64


@pytest.fixture(autouse=True)
def fresh_compiler() -> None:
    """Each test compiles its own shapes, far from Dynamo's recompile limit (past it, flex_attention runs unfused)."""
    torch._dynamo.reset()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def layers(window: int | None, seed: int) -> dict[str, Attention]:
    torch.manual_seed(seed)
    ref = Attention(D, H, K, window=window, layer_idx=0, backend="sdpa").cuda().double()
    out = {"ref": ref}
    for name, backend in (("flex", "auto"), ("dense", "sdpa")):
        layer = Attention(D, H, K, window=window, layer_idx=0, backend=backend).cuda().to(torch.bfloat16)
        layer.load_state_dict(ref.state_dict())
        out[name] = layer
    return out


def fwd_bwd(layer: Attention, x: torch.Tensor, dy: torch.Tensor, **kw: object) -> tuple[torch.Tensor, ...]:
    x = x.detach().to(next(layer.parameters()).dtype).requires_grad_()
    o = layer(x, **kw)[0]
    dx, dwq = torch.autograd.grad(o, (x, layer.q_proj.weight), dy.to(o.dtype))
    return o, dx, dwq


CASES = {
    "window_shorter": dict(B=2, T=1000, window=256),
    "window_equal": dict(B=2, T=640, window=640),
    "window_longer": dict(B=2, T=500, window=2048),
    "documents": dict(B=1, T=1500, window=300, cu=[0, 90, 700, 701, 1500]),
    "documents_full": dict(B=1, T=1100, window=None, cu=[0, 400, 1100]),
    "left_padding": dict(B=3, T=900, window=200, pad=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_training_paths_match_float64(case: str) -> None:
    c = CASES[case]
    for seed in range(3):
        ls = layers(c["window"], seed)
        x = torch.randn(c["B"], c["T"], D, device="cuda", dtype=torch.float64)
        dy = torch.randn_like(x)
        kw: dict = {}
        if "cu" in c:
            kw["cu_seqlens"] = torch.tensor(c["cu"], device="cuda")
        if c.get("pad"):
            mask = torch.ones(c["B"], c["T"], dtype=torch.long, device="cuda")
            mask[1, :333] = 0
            mask[2, :700] = 0
            kw["attention_mask"] = mask
        ref = fwd_bwd(ls["ref"], x, dy, **kw)
        flex, dense = fwd_bwd(ls["flex"], x, dy, **kw), fwd_bwd(ls["dense"], x, dy, **kw)
        for name, f, d, r in zip(("o", "dx", "dWq"), flex, dense, ref):
            err, base = rel(f, r), rel(d, r)
            assert err <= 1.5 * base + 1e-4, f"{case} seed {seed} {name}: block-sparse {err:.2e}, dense {base:.2e}"


@torch.no_grad()
def test_prefill_continued_across_the_window_edge() -> None:
    ls = layers(300, 0)
    x = torch.randn(2, 1200, D, device="cuda", dtype=torch.float64)
    mask = torch.ones(2, 1200, dtype=torch.long, device="cuda")
    mask[1, :250] = 0
    outs = {}
    for name, layer in ls.items():
        xs = x.to(next(layer.parameters()).dtype)
        cache = RecurrentCache()
        o1 = layer(xs[:, :500], attention_mask=mask[:, :500], past_key_values=cache, use_cache=True)[0]
        o2 = layer(xs[:, 500:], attention_mask=mask, past_key_values=cache, use_cache=True)[0]
        outs[name] = torch.cat([o1, o2], 1)
    real = mask.bool()
    err, base = rel(outs["flex"][real], outs["ref"][real]), rel(outs["dense"][real], outs["ref"][real])
    assert err <= 1.5 * base + 1e-4, (err, base)


@torch.no_grad()
def test_packed_prefill() -> None:
    ls = layers(256, 1)
    x = torch.randn(1, 1300, D, device="cuda", dtype=torch.float64)
    cu = torch.tensor([0, 100, 900, 1300], device="cuda")
    outs = {name: layer(x.to(next(layer.parameters()).dtype), cu_seqlens=cu, use_cache=True)
            for name, layer in ls.items()}
    err, base = rel(outs["flex"][0], outs["ref"][0]), rel(outs["dense"][0], outs["ref"][0])
    assert err <= 1.5 * base + 1e-4, (err, base)
    for key in ("pos", "valid", "next_pos"):
        assert torch.equal(outs["flex"][2].get(0)[key], outs["dense"][2].get(0)[key]), key


def test_no_compilation_per_batch_or_per_prompt_length() -> None:
    from torch._dynamo.utils import counters

    def graphs() -> int:
        return counters["stats"]["unique_graphs"]

    torch._dynamo.reset()
    counters.clear()
    layer = Attention(D, H, K, window=256, layer_idx=0).cuda().to(torch.bfloat16)
    x = torch.randn(1, 2048, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for step, cu in enumerate(([0, 2048], [0, 100, 2048], [0, 1000, 1500, 2048])):  # new documents each step
        layer(x, cu_seqlens=torch.tensor(cu, device="cuda"))[0].sum().backward()
        if step == 0:
            trained = graphs()
    assert graphs() == trained, f"{graphs() - trained} graphs compiled for new documents of one training shape"
    with torch.no_grad():
        for i, n in enumerate((700, 1500, 2600, 4097, 5000)):
            mask = torch.ones(2, n, dtype=torch.long, device="cuda")
            mask[0, : n // 4] = 0
            layer(torch.randn(2, n, D, device="cuda", dtype=torch.bfloat16), attention_mask=mask)
            if i == 1:
                prompts = graphs()
    assert graphs() == prompts, f"{graphs() - prompts} graphs compiled for three more prompt lengths"


@torch.no_grad()
def test_hybrid_model_backends_agree() -> None:
    import models

    cfg = models.model_config("toy", "kdn_diag", "hybrid_swa", 512, window=64)
    torch.manual_seed(0)
    model = models.build_model(cfg).cuda().float().eval()
    ids = torch.randint(0, 512, (2, 300), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :77] = 0
    logits = {}
    for backend in ("auto", "sdpa"):
        for layer in model.model.layers:
            if isinstance(layer.mixer, Attention):
                layer.mixer.backend = backend
        logits[backend] = model(ids, attention_mask=mask).logits[mask.bool()]
    assert rel(logits["auto"], logits["sdpa"]) < 1e-4
