"""``kdn.modules.linear`` (stacked weights; FP32 weight gradients under autocast) and the joint SwiGLU
(``kdn.modules.swiglu.swiglu_joint``: the CPU through Triton's interpreter, and CUDA), against float64."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from kdn_inputs import rel_err

from kdn.modules import Linear, linear
from models.modeling import SwiGLU

triton_interpret = pytest.importorskip("triton_interpret")  # tests/triton_interpret.py


def _operands(device: str, bias: bool, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    x = torch.randn(3, 37, 24, generator=gen).to(device)
    ws = [torch.randn(n, 24, generator=gen).to(device) / 5 for n in (16, 8, 40)]
    b = torch.randn(64, generator=gen).to(device) if bias else None
    return x, ws, b


def _check_autocast_linear(device: str, bias: bool) -> None:
    """Output, input and weight gradients of a stacked ``linear`` under bf16 autocast against float64 computed from
    the same bf16-rounded operands. Its FP32 weight gradients must beat autocast's ``F.linear`` (rounded to bf16)."""
    gen = torch.Generator().manual_seed(3)
    x, ws, b = _operands(device, bias, gen)
    dy = torch.randn(3, 37, 64, generator=gen).to(device)
    leaves = [t.clone().requires_grad_() for t in [x, *ws] + ([b] if bias else [])]
    with torch.autocast(device, dtype=torch.bfloat16):
        y = linear(leaves[0], leaves[1:4], leaves[4] if bias else None)
    assert y.dtype == torch.bfloat16
    y.backward(dy.to(torch.bfloat16))
    assert all(t.grad.dtype == torch.float32 for t in leaves)  # the input's gradient is cast back to its dtype

    ref = [t.to(torch.bfloat16).double().requires_grad_() for t in [x, *ws]]
    y64 = ref[0] @ torch.cat(ref[1:]).T + (b.to(torch.bfloat16).double() if bias else 0)
    y64.backward(dy.to(torch.bfloat16).double())
    assert rel_err(y, y64) < 1e-2
    assert rel_err(leaves[0].grad, ref[0].grad) < 1e-2
    for ours, r in zip(leaves[1:4], ref[1:]):
        assert rel_err(ours.grad, r.grad) < 1e-5  # FP32 out of the GEMM: no bf16 rounding
    if bias:
        assert rel_err(leaves[4].grad, dy.to(torch.bfloat16).double().sum((0, 1))) < 1e-5

    plain = [t.clone().requires_grad_() for t in [x, *ws]]
    with torch.autocast(device, dtype=torch.bfloat16):
        F.linear(plain[0], torch.cat(plain[1:])).backward(dy.to(torch.bfloat16))
    assert rel_err(plain[1].grad, ref[1].grad) > 1e-4  # control: autocast's bf16 weight gradient is rounded


@pytest.mark.parametrize("bias", [False, True])
def test_linear_under_autocast_has_fp32_weight_gradients(bias: bool) -> None:
    _check_autocast_linear("cpu", bias)


def test_cached_weight_casts_reuse_one_cast_and_keep_the_gradients() -> None:
    """Inside ``cached_weight_casts`` two micro-batches share one cast of the stacked weights (the same tensor is saved
    for both backwards) and accumulate the same gradients as without it; outside, every call casts afresh."""
    from kdn.modules import front_end

    gen = torch.Generator().manual_seed(6)
    x, ws, b = _operands("cpu", True, gen)
    dys = [torch.randn(3, 37, 64, generator=gen).to(torch.bfloat16) for _ in range(2)]

    def grads(cached: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        leaves = [t.clone().requires_grad_() for t in [*ws, b]]
        saved = []
        with front_end.cached_weight_casts() if cached else contextlib.nullcontext():
            for dy in dys:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    y = linear(x, leaves[:3], leaves[3])
                saved.append(y.grad_fn.saved_tensors[1])  # the stacked bf16 weights
                y.backward(dy)
        return [t.grad for t in leaves], saved

    (g_plain, s_plain), (g_cached, s_cached) = grads(False), grads(True)
    assert s_cached[0] is s_cached[1] and s_plain[0] is not s_plain[1]
    assert front_end._CAST_CACHE.get() is None  # dropped on leaving
    for a, c in zip(g_plain, g_cached):
        assert torch.equal(a, c)


def test_cached_weight_casts_are_scoped_to_their_context() -> None:
    """A nested scope casts afresh and, on leaving, gives the outer scope its casts back; another thread (a context
    of its own) never reads a scope it is not in."""
    import threading

    from kdn.modules import front_end

    gen = torch.Generator().manual_seed(7)
    x, ws, b = _operands("cpu", True, gen)
    ws, b = [w.clone().requires_grad_() for w in ws], b.clone().requires_grad_()

    def stacked() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return linear(x, ws, b).grad_fn.saved_tensors[1]

    with front_end.cached_weight_casts():
        outer = stacked()
        with front_end.cached_weight_casts():
            inner = stacked()
            assert inner is not outer and stacked() is inner
        assert stacked() is outer
        seen: list[torch.Tensor] = []
        worker = threading.Thread(target=lambda: seen.extend([stacked(), stacked()]))
        worker.start()
        worker.join()
        assert seen[0] is not outer and seen[1] is not seen[0]  # outside any scope there: a cast per call
        assert stacked() is outer


def test_linear_without_autocast_is_f_linear() -> None:
    gen = torch.Generator().manual_seed(4)
    x, ws, b = _operands("cpu", True, gen)
    assert torch.equal(linear(x, ws, b), F.linear(x, torch.cat(ws), b))
    layer = Linear(24, 16)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


def test_swiglu_module_matches_separate_projections() -> None:
    torch.manual_seed(5)
    mlp = SwiGLU(24, 40)
    x = torch.randn(2, 9, 24, dtype=torch.float64)
    mlp.double()
    ref = mlp.down_proj(F.silu(x @ mlp.gate_proj.weight.T) * (x @ mlp.up_proj.weight.T))
    assert rel_err(mlp(x), ref) < 1e-12


SCRIPT = r"""
import json, sys, torch
import torch.nn.functional as F
sys.path.insert(0, "tests")
import triton_interpret
triton_interpret.lean_device_calls()
from kdn.modules.swiglu import swiglu_joint
from kdn_inputs import rel_err

out = {}
gen = torch.Generator().manual_seed(0)
for name, shape, dt in (("fp32", (3, 11, 2 * 600), torch.float32), ("bf16", (13, 2 * 70), torch.bfloat16)):
    y = (torch.randn(*shape, generator=gen) * 2).to(dt).requires_grad_()
    dz = torch.randn(*shape[:-1], shape[-1] // 2, generator=gen)
    z = swiglu_joint(y)
    z.backward(dz.to(dt))
    y64 = y.detach().double().requires_grad_()
    g, u = y64.chunk(2, -1)
    z64 = F.silu(g) * u
    z64.backward(dz.double())
    out[name] = {"z": rel_err(z, z64), "dy": rel_err(y.grad, y64.grad), "dtype": str(z.dtype)}
    # control: the gate's and the up projection's gradients swapped are far off
    out[name]["swapped"] = rel_err(torch.cat(y.grad.chunk(2, -1)[::-1], -1), y64.grad)
print(json.dumps(out))
"""


def test_swiglu_joint_in_interpreter_matches_float64() -> None:
    errs = triton_interpret.run_interpreted(SCRIPT)
    assert errs["fp32"]["dtype"] == "torch.float32" and errs["bf16"]["dtype"] == "torch.bfloat16"
    for case, tol in (("fp32", 1e-6), ("bf16", 1e-2)):
        assert errs[case]["z"] < tol and errs[case]["dy"] < tol, (case, errs[case])
        assert errs[case]["swapped"] > 0.3, (case, errs[case])


def test_swiglu_joint_rejects_odd_width() -> None:
    from kdn.modules.swiglu import swiglu_joint

    with pytest.raises(ValueError, match="even last dimension"):
        swiglu_joint(torch.randn(2, 5))


@pytest.mark.gpu
@pytest.mark.parametrize("bias", [False, True])
def test_linear_under_cuda_autocast(bias: bool) -> None:
    _check_autocast_linear("cuda", bias)


@pytest.mark.gpu
def test_swiglu_joint_cuda_matches_float64() -> None:
    from kdn.modules.swiglu import swiglu_joint

    gen = torch.Generator().manual_seed(1)
    for M, I in ((8 * 4096, 5504), (77, 300)):
        y = (torch.randn(M, 2 * I, generator=gen) * 2).cuda().to(torch.bfloat16).requires_grad_()
        dz = torch.randn(M, I, generator=gen).cuda()
        z = swiglu_joint(y)
        z.backward(dz.to(torch.bfloat16))
        y64 = y.detach().double().requires_grad_()
        g, u = y64.chunk(2, -1)
        (F.silu(g) * u).backward(dz.double())
        assert rel_err(z, F.silu(g) * u) < 1e-2 and rel_err(y.grad, y64.grad) < 1e-2
