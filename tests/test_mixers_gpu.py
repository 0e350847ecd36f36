"""CUDA-only checks (``pytest -m gpu``): the kernel paths against the PyTorch paths and fla's own layers.

Run on a GPU machine: ``python -m pytest -q -m gpu tests/test_mixers_gpu.py``. Mamba-3 kernel tests
skip unless mamba-ssm's kernels import (see ``models/layers/_mamba_kernels.py``).
"""
from __future__ import annotations

import copy
import functools
import importlib
from collections.abc import Callable

import pytest
import torch

import models
from kdn.layers import RecurrentCache
from models.layers._mamba_kernels import MIMO_KERNEL_MODULES, UNAVAILABLE, ShapeStableJit, mamba3_kernels
from models.layers.delta import DELTA_MIXERS, fla_layer_kwargs, fla_state_dict_map
from models.layers.mamba3 import Mamba3

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def fla_refuses_gated_backward() -> bool:
    """fla's own condition for refusing the gated ``chunk_bwd_dqkwg`` (Gated DeltaNet's backward): a Hopper GPU
    with Triton >= 3.4 and < 3.7.1 (a compiler bug, fla issue #640)."""
    try:
        from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1
    except ImportError:
        return False
    return bool(IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1)


def skip_if_fla_refuses(test: Callable[..., None]) -> Callable[..., None]:
    """Skip (not fail) where fla refuses a kernel on this stack: its own Gated DeltaNet layer's backward on Hopper
    with Triton >= 3.4 and < 3.7.1 (ours falls back to KDA's kernels there, and is tested). Skipped before it runs
    where fla's condition holds (its forward would spend minutes autotuning first), and whenever fla raises that
    refusal."""
    @functools.wraps(test)
    def wrapper(*args: object, **kwargs: object) -> None:
        if "gdn" in (kwargs.get("name"), kwargs.get("mixer")) and fla_refuses_gated_backward():
            pytest.skip("fla refuses Gated DeltaNet's backward on Hopper with Triton < 3.7.1 (fla #640)")
        try:
            test(*args, **kwargs)
        except RuntimeError as e:
            if "< 3.7.1 on Hopper" not in str(e):
                raise
            pytest.skip(f"fla refuses this kernel here: {str(e)[:160]}")
    return wrapper


def _run(layer: torch.nn.Module, x: torch.Tensor, **kw: object) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Output and input/parameter gradients of ``sum(o * w)`` for a fixed random ``w``."""
    layer.zero_grad()
    x = x.clone().requires_grad_(True)
    o = layer(x, **kw)[0]
    w = torch.randn(o.shape, generator=torch.Generator(device=o.device).manual_seed(7), device=o.device)
    (o.float() * w).sum().backward()
    return o.detach(), [x.grad] + [p.grad for p in layer.parameters()]


# Bounds on ||fla - torch|| / ||torch|| in test_delta_fla_kernels_match_torch_path: each 1.5x the largest error of its
# tensors over 20 seeds (seed 0, the test's, among them) on the H200, rounded up on a 1-1.5-2-3-5-7.5 scale (measured
# maximum in brackets): bench/results/gpu_tolerances.json, from `python -m bench.gpu_tolerances --seeds 20`, which
# runs delta_fla_errors.
DELTA_TOL_O = 1.5e-3  # the output (9.0e-4, Gated DeltaNet); FP32 inputs, fla's kernels compute in FP32/TF32
DELTA_TOL_GRAD = 5e-3  # the input's and every weight's gradient (2.1e-3, Gated DeltaNet-2's b_proj)
# the gradient of a parameter with one value per head (A_log; Gated DeltaNet's dt_bias): four values, each a sum over
# every token and channel of its head with terms of both signs, so TF32's rounding is not averaged out (6.1e-3)
DELTA_TOL_PER_HEAD_GRAD = 1e-2
DELTANET_TOL_O = 1e-2  # DeltaNet: fla's kernels take bf16 only, its inputs are rounded (5.3e-3)
DELTANET_TOL_GRAD = 1.5e-2  # (7.3e-3, the output norm's weight)
DELTA_HEADS = 4


def delta_fla_errors(name: str, seed: int) -> dict[str, float]:
    """One layer of rule ``name`` (256 wide, 4 heads of 64; weights, input and padding from ``seed``) through fla's
    kernels and through PyTorch, padded batch of 2 x 200 tokens. Returns ``||fla - torch|| / ||torch||`` of the
    output (``o``), the input's gradient (``dx``) and each parameter's (``d<name>``)."""
    torch.manual_seed(seed)
    layer = DELTA_MIXERS[name](256, DELTA_HEADS, 64, layer_idx=0).to(CUDA)
    if name == "gdn":
        assert layer.runs_as_kda() == fla_refuses_gated_backward()
    x = torch.randn(2, 200, 256, device=CUDA)
    mask = torch.ones(2, 200, dtype=torch.long, device=CUDA)
    mask[1, :int(torch.randint(1, 100, ()))] = 0
    outs = {}
    for backend in ("torch", "fla"):
        layer.backend = backend
        outs[backend] = _run(layer, x, attention_mask=mask)
    names = ["dx"] + ["d" + n for n, _ in layer.named_parameters()]
    errs = {"o": rel_err(outs["fla"][0], outs["torch"][0])}
    return errs | {n: rel_err(g_fla, g_torch) for n, g_fla, g_torch in zip(names, outs["fla"][1], outs["torch"][1])}


def delta_tolerance(name: str, tensor: str) -> tuple[str, float]:
    """The constant that bounds ``tensor``'s error in :func:`delta_fla_errors` for rule ``name``: (its name, value)."""
    if tensor == "o":
        return ("DELTANET_TOL_O", DELTANET_TOL_O) if name == "deltanet" else ("DELTA_TOL_O", DELTA_TOL_O)
    if name == "deltanet":
        return "DELTANET_TOL_GRAD", DELTANET_TOL_GRAD
    param = dict(DELTA_MIXERS[name](256, DELTA_HEADS, 64).named_parameters()).get(tensor.removeprefix("d"))
    if param is not None and param.numel() == DELTA_HEADS:
        return "DELTA_TOL_PER_HEAD_GRAD", DELTA_TOL_PER_HEAD_GRAD
    return "DELTA_TOL_GRAD", DELTA_TOL_GRAD


@pytest.mark.parametrize("name", sorted(DELTA_MIXERS))
def test_delta_fla_kernels_match_torch_path(name: str) -> None:
    """Every rule's fla path against the PyTorch path, output and every gradient; Gated DeltaNet on a stack where fla
    refuses its backward runs as KDA with the head's decay on every channel (``GatedDeltaNet.runs_as_kda``), checked
    here too."""
    errs = delta_fla_errors(name, seed=0)
    assert len(errs) == 2 + len(list(DELTA_MIXERS[name](256, DELTA_HEADS, 64).parameters()))
    tols = {n: delta_tolerance(name, n) for n in errs}
    bad = {n: (e, tols[n]) for n, e in errs.items() if not e < tols[n][1]}
    assert not bad, f"over tolerance: {bad} (all: {errs})"


@pytest.mark.parametrize("name", sorted(DELTA_MIXERS))
def test_delta_fla_kernels_cache_and_packing(name: str) -> None:
    torch.manual_seed(0)
    layer = DELTA_MIXERS[name](256, 4, 64, layer_idx=0, backend="fla").to(CUDA)
    x = torch.randn(1, 150, 256, device=CUDA)
    with torch.no_grad():
        full = layer(x)[0]
        cache = RecurrentCache()
        parts = [layer(x[:, :100], past_key_values=cache, use_cache=True)[0]]
        for t in range(100, 150):
            parts.append(layer(x[:, t:t + 1], past_key_values=cache, use_cache=True)[0])
        assert rel_err(torch.cat(parts, 1), full) < 5e-3
        cu = torch.tensor([0, 40, 150], device=CUDA)
        packed = layer(x, cu_seqlens=cu)[0]
        separate = torch.cat([layer(x[:, :40])[0], layer(x[:, 40:])[0]], 1)
        assert rel_err(packed, separate) < 5e-3


@pytest.mark.parametrize("name", sorted(DELTA_MIXERS))
@skip_if_fla_refuses
def test_delta_matches_fla_layer(name: str) -> None:
    from fla import layers as fla_layers

    cls = {"deltanet": fla_layers.DeltaNet, "gdn": fla_layers.GatedDeltaNet, "kda": fla_layers.KimiDeltaAttention,
           "gdn2": fla_layers.GatedDeltaNet2}[name]
    # fla's DeltaNet layer refuses FP32 (its chunk kernel takes bf16 only): both layers run in bf16 there
    dtype, tol_o, tol_g = (torch.bfloat16, 1e-2, 2e-2) if name == "deltanet" else (torch.float32, 5e-3, 1e-2)
    torch.manual_seed(0)
    ours = DELTA_MIXERS[name](256, 4, 64, backend="fla").to(CUDA, dtype)
    theirs = cls(**fla_layer_kwargs(name, 256, 4, 64, 1e-5)).to(CUDA, dtype)
    theirs.load_state_dict(fla_state_dict_map(name, ours.state_dict()))
    x = torch.randn(2, 128, 256, device=CUDA, dtype=dtype)  # > 64 tokens: fla's layers use their chunk kernels
    o_ours, g_ours = _run(ours, x)
    o_theirs, g_theirs = _run(theirs, x)
    assert rel_err(o_ours, o_theirs) < tol_o
    assert rel_err(g_ours[0], g_theirs[0]) < tol_g  # input gradients


def _need(kernel_index: int) -> None:
    if mamba3_kernels()[kernel_index] is None:
        pytest.skip(f"mamba-ssm Mamba-3 kernel not importable: {UNAVAILABLE}")


# (256, 32): the MQAR benchmark's width 256, where SISO's kernels refuse the shape (SISO_KERNEL_RULE)
@pytest.mark.parametrize("mimo,hidden,state", [(False, 512, 64), (True, 512, 64), (True, 256, 32)])
def test_mamba3_kernels_match_reference(mimo: bool, hidden: int, state: int) -> None:
    _need(1 if mimo else 0)
    torch.manual_seed(0)
    layer = Mamba3(hidden, state_size=state, head_dim=64, is_mimo=mimo, mimo_rank=4, layer_idx=0).to(CUDA)
    x = torch.randn(2, 256, hidden, device=CUDA)
    mask = torch.ones(2, 256, dtype=torch.long, device=CUDA)
    mask[1, :50] = 0
    outs = {}
    for backend in ("torch", "kernels"):
        layer.backend = backend
        with torch.autocast("cuda", dtype=torch.bfloat16):
            outs[backend] = _run(layer, x, attention_mask=mask)
    assert rel_err(outs["kernels"][0], outs["torch"][0]) < 3e-2
    for g_kernel, g_torch in zip(outs["kernels"][1], outs["torch"][1]):
        assert rel_err(g_kernel, g_torch) < 5e-2


def test_mamba3_mimo_kernel_lookups_are_kept() -> None:
    """Another batch size and length build no TileLang kernel: mamba-ssm's lookups with new symbolic dimensions
    find the kernels :class:`ShapeStableJit` keeps, and those kernels take any size of them."""
    _need(1)
    factories = [f for name in MIMO_KERNEL_MODULES[:2] for f in vars(importlib.import_module(name)).values()
                 if isinstance(f, ShapeStableJit)]
    assert len(factories) == 3  # forward, and the backward's two kernels
    torch.manual_seed(0)
    layer = Mamba3(256, state_size=32, head_dim=64, is_mimo=True, mimo_rank=4, layer_idx=0, backend="kernels").to(CUDA)

    def step(batch: int, length: int) -> None:
        x = torch.randn(batch, length, 256, device=CUDA, requires_grad=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)[0]
        y.float().square().mean().backward()
        assert torch.isfinite(x.grad).all()

    step(2, 128)
    built = [len(f.kernels) for f in factories]
    step(3, 192)
    assert all(built) and [len(f.kernels) for f in factories] == built


def test_mamba3_mimo_kernels_run_a_bf16_layer() -> None:
    """A MIMO layer cast to BF16 (as bench.mixer_throughput does) runs TileLang's kernels, which take its biases,
    ``D`` and MIMO projections in FP32 only, and matches the FP32 layer under autocast."""
    _need(1)
    torch.manual_seed(0)
    layer = Mamba3(256, state_size=32, head_dim=64, is_mimo=True, mimo_rank=4, layer_idx=0, backend="kernels").to(CUDA)
    x = torch.randn(2, 256, 256, device=CUDA)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref = layer(x)[0].float()
    low = copy.deepcopy(layer).to(torch.bfloat16)
    xb = x.bfloat16().requires_grad_()
    y = low(xb)[0]
    y.float().square().mean().backward()
    assert rel_err(y.float(), ref) < 3e-2
    assert torch.isfinite(xb.grad).all() and low.C_bias.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("mimo", [False, True])
def test_mamba3_kernel_prefill_then_decode(mimo: bool) -> None:
    _need(1 if mimo else 0)
    torch.manual_seed(0)
    layer = Mamba3(512, state_size=64, head_dim=64, is_mimo=mimo, mimo_rank=4, layer_idx=0).to(CUDA)
    x = torch.randn(2, 96, 512, device=CUDA)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        layer.backend = "torch"
        full = layer(x)[0]
        layer.backend = None  # kernels where they apply, PyTorch for MIMO steps from a cached state
        cache = RecurrentCache()
        parts = [layer(x[:, :64], past_key_values=cache, use_cache=True)[0]]
        for t in range(64, 96):
            parts.append(layer(x[:, t:t + 1], past_key_values=cache, use_cache=True)[0])
    assert rel_err(torch.cat(parts, 1), full) < 3e-2


F32, BF16 = torch.float32, torch.bfloat16
ADD_NORM_CASES = {  # (sublayer output x, stream, weight): where each combination occurs
    "one_gpu_first": (F32, None, F32),  # autocast: FP32 embeddings, FP32 weights
    "one_gpu_later": (BF16, F32, F32),  # autocast: bf16 sublayer output on the FP32 stream
    "fsdp_first": (BF16, None, BF16),  # FSDP2: bf16 parameters, so bf16 embeddings
    "fsdp_later": (BF16, F32, BF16),
    "fp32_everything_bf16_weight": (F32, F32, BF16),  # FSDP2 with FP32 block outputs (accelerate-cast policies)
}


@pytest.mark.parametrize("case", list(ADD_NORM_CASES))
def test_fused_add_norm_matches_pytorch(case: str) -> None:
    """``RMSNorm.add_norm`` through its fused Triton kernels (``kdn.modules.norm``) against the PyTorch path, for
    each dtype combination that training meets (``ADD_NORM_CASES``): the normed output, the new stream, and the
    gradients of the sublayer output, the stream and the weight."""
    from kdn import modules

    x_dtype, s_dtype, w_dtype = ADD_NORM_CASES[case]
    torch.manual_seed(0)
    norm = modules.RMSNorm(1536).to(CUDA)
    norm.weight.data.uniform_(0.5, 1.5)
    norm.to(w_dtype)
    plain = modules.RMSNorm(1536, fused=False).to(CUDA).to(w_dtype)  # the PyTorch path, the same weight
    plain.load_state_dict(norm.state_dict())
    norms = {True: norm, False: plain}
    x0 = torch.randn(4, 300, 1536, device=CUDA, dtype=x_dtype)
    s0 = None if s_dtype is None else torch.randn(4, 300, 1536, device=CUDA, dtype=s_dtype)
    gen = torch.Generator(device=CUDA).manual_seed(3)
    wy, wr = (torch.randn(x0.shape, generator=gen, device=CUDA) for _ in range(2))
    res = {}
    for fused, norm in norms.items():
        x = x0.clone().requires_grad_()
        s = s0.clone().requires_grad_() if s0 is not None else None
        y, r = norm.add_norm(x, s)
        torch.cuda.synchronize()
        assert y.dtype == x_dtype and r.dtype == torch.float32, (y.dtype, r.dtype)
        ((y.float() * wy).sum() + (r * wr).sum()).backward()
        torch.cuda.synchronize()
        res[fused] = {"y": y.detach(), "stream": r.detach(), "dx": x.grad, "dw": norm.weight.grad}
        if s is not None:
            res[fused]["dstream"] = s.grad
    errs = {n: rel_err(res[True][n], res[False][n]) for n in res[False]}
    tol = 1e-5 if BF16 not in (x_dtype, w_dtype) else 1e-2  # FP32 end to end; bf16 rounding
    assert all(e < tol for e in errs.values()), errs


@pytest.mark.parametrize("mixer", list(models.MIXERS))
def test_model_trains_and_generates_on_cuda(mixer: str) -> None:
    torch.manual_seed(0)
    # one FFN width for every mixer: fla's SwiGLU kernels autotune once per width, not per parameter-matched width
    model = models.build_model(models.model_config("small", mixer, "hybrid_swa", vocab_size=512,
                                                   intermediate_size=512)).to(CUDA)
    x = torch.randint(3, 512, (2, 128), device=CUDA)
    model.train()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        fused = model(x, labels=x)
        assert fused.logits is None
        fused.loss.backward()
        model.config.fuse_cross_entropy = False
        plain = model(x, labels=x).loss
    assert abs(fused.loss.item() - plain.item()) < 1e-2 * plain.item()
    model.eval()
    ids = torch.zeros(2, 16, dtype=torch.long, device=CUDA)
    mask = torch.zeros(2, 16, dtype=torch.long, device=CUDA)
    ids[0], mask[0] = x[0, :16], 1
    ids[1, 6:], mask[1, 6:] = x[1, :10], 1
    kw = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0, "eos_token_id": None}
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        out = model.generate(ids, attention_mask=mask, **kw)
        full = model(out[:1]).logits[0, 15:-1].argmax(-1)
    assert out.shape == (2, 24)
    assert (full == out[0, 16:]).float().mean() >= 0.75  # greedy tokens re-derived by one full forward (bf16)
