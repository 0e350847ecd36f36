"""The KDN mixers as modules: training path, causality, caching, padding, packing, options."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import timeout_s
from forkserver import ROOT, commands
from kdn_inputs import rel_err

import kdn

D, H, K = 32, 2, 16
LAYERS = [kdn.DiagonalKDN, kdn.IsotropicKDN]


def _layer(cls: type, **kw: object) -> torch.nn.Module:
    torch.manual_seed(0)
    return cls(D, H, K, layer_idx=0, **kw).double()


@pytest.mark.parametrize("cls", LAYERS)
def test_forward_backward_reaches_every_parameter(cls: type) -> None:
    layer = _layer(cls, mu="learned")
    if cls is kdn.DiagonalKDN:  # the zero-initialised last omega layer blocks the first one's gradient at init
        torch.nn.init.normal_(layer.omega_proj[-1].weight)
    x = torch.randn(2, 40, D, dtype=torch.float64)
    y, beta_eff, _ = layer(x, output_beta_eff=True)
    assert y.shape == x.shape and beta_eff.shape == (2, 40, H)
    assert beta_eff.min() >= 0 and beta_eff.max() < 1
    y.pow(2).mean().backward()
    missing = [n for n, p in layer.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, f"parameters without gradient: {missing}"


@pytest.mark.parametrize("cls", LAYERS)
def test_causality(cls: type) -> None:
    layer = _layer(cls)
    x = torch.randn(1, 30, D, dtype=torch.float64, requires_grad=True)
    y, _, _ = layer(x)
    y[0, 12].sum().backward()
    assert x.grad[0, 13:].abs().max() == 0
    assert x.grad[0, :13].abs().sum() > 0


@pytest.mark.parametrize("cls", LAYERS)
def test_prefill_then_cached_steps_equal_full_forward(cls: type) -> None:
    layer = _layer(cls).eval()
    x = torch.randn(2, 25, D, dtype=torch.float64)
    with torch.no_grad():
        full, _, _ = layer(x)
        out, _, cache = layer(x[:, :17], use_cache=True)
        outs = [out]
        for t in range(17, 25):
            o, _, cache = layer(x[:, t:t + 1], past_key_values=cache, use_cache=True)
            outs.append(o)
    assert rel_err(torch.cat(outs, 1), full) < 1e-12


@pytest.mark.parametrize("cls", LAYERS)
def test_left_padded_batch_equals_per_sample_runs(cls: type) -> None:
    layer = _layer(cls).eval()
    lengths = [20, 13, 7]
    T = max(lengths)
    xs = [torch.randn(1, n, D, dtype=torch.float64) for n in lengths]
    batch = torch.randn(len(xs), T, D, dtype=torch.float64)  # garbage in the padding on purpose
    mask = torch.zeros(len(xs), T, dtype=torch.long)
    for i, x in enumerate(xs):
        batch[i, T - x.shape[1]:] = x[0]
        mask[i, T - x.shape[1]:] = 1
    with torch.no_grad():
        y, _, cache = layer(batch, attention_mask=mask, use_cache=True)
        step = torch.randn(len(xs), 1, D, dtype=torch.float64)
        mask2 = torch.cat([mask, torch.ones(len(xs), 1, dtype=torch.long)], 1)
        y2, _, _ = layer(step, attention_mask=mask2, past_key_values=cache, use_cache=True)
        for i, x in enumerate(xs):
            ref, _, c = layer(x, use_cache=True)
            assert rel_err(y[i:i + 1, T - x.shape[1]:], ref) < 1e-12
            ref2, _, _ = layer(step[i:i + 1], past_key_values=c, use_cache=True)
            assert rel_err(y2[i:i + 1], ref2) < 1e-12


@pytest.mark.parametrize("cls", LAYERS)
def test_packed_sequences_equal_separate_runs(cls: type) -> None:
    layer = _layer(cls).eval()
    lengths = [9, 30, 3]
    xs = [torch.randn(1, n, D, dtype=torch.float64) for n in lengths]
    cu = torch.tensor([0, 9, 39, 42])
    with torch.no_grad():
        y, _, _ = layer(torch.cat(xs, 1), cu_seqlens=cu)
        for i, x in enumerate(xs):
            ref, _, _ = layer(x)
            assert rel_err(y[:, cu[i]:cu[i + 1]], ref) < 1e-12


@pytest.mark.parametrize("cls", LAYERS)
@pytest.mark.parametrize("options", [
    {"mu": "1"}, {"mu": "sqrt"}, {"mu": "4dk"}, {"mu": 7.5}, {"alpha_param": "sigmoid"},
    {"noise": "fixed_r"}, {"noise": "fixed_r_omega"},
])
def test_options_build_and_run(cls: type, options: dict) -> None:
    layer = _layer(cls, **options)
    y, beta_eff, _ = layer(torch.randn(2, 10, D, dtype=torch.float64), output_beta_eff=True)
    assert torch.isfinite(y).all() and (beta_eff < 1).all()
    if options.get("noise") == "fixed_r_omega":
        assert not hasattr(layer, "r_proj") and not hasattr(layer, "omega_proj")


def test_mu_options_change_the_model() -> None:
    x = torch.randn(1, 30, D, dtype=torch.float64)
    outs = [_layer(kdn.DiagonalKDN, mu=mu)(x)[0] for mu in ("1", "dk")]
    assert rel_err(outs[0], outs[1]) > 1e-4


@pytest.mark.parametrize("bad,match", [
    ({"mu": "huge"}, "mu must be one of"), ({"mu": -1.0}, "mu must be > 0"),
    ({"noise": "none"}, "noise must be one of"), ({"alpha_param": "tanh"}, "alpha_param must be"),
])
def test_bad_options(bad: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        kdn.DiagonalKDN(D, H, K, **bad)


def test_bad_attention_mask() -> None:
    layer = _layer(kdn.DiagonalKDN)
    with pytest.raises(ValueError, match="attention_mask must be"):
        layer(torch.randn(2, 5, D, dtype=torch.float64), attention_mask=torch.ones(2, 3))


@pytest.mark.parametrize("cls", LAYERS)
def test_reference_path_runs_inside_cpu_autocast(cls: type) -> None:
    """Under bf16 autocast the layer's projections run in bf16, but the recurrence keeps FP32 (the reference
    path's triangular solves have no bf16 kernel, and the math is meant to be exact): it equals the recurrence
    run on the same bf16-rounded inputs outside autocast, and gradients flow."""
    torch.manual_seed(0)
    layer = cls(D, H, K, layer_idx=0)
    x = torch.randn(2, 40, D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)[0]
    assert y.dtype == torch.bfloat16 and torch.isfinite(y.float()).all()
    y.float().pow(2).mean().backward()
    assert all(p.grad is not None for p in layer.parameters() if p.requires_grad)
    q, k, v = (torch.randn(2, 40, H, K).bfloat16() for _ in range(3))
    g = -torch.rand(2, 40, H, K)
    omega = torch.rand(2, 40, H, K) if cls is kdn.DiagonalKDN else torch.rand(2, 40, H)
    r = torch.rand(2, 40, H) + 0.1
    fn = kdn.diagonal_kdn if cls is kdn.DiagonalKDN else kdn.isotropic_kdn
    plain = fn(q, k, v, g, omega, r)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = fn(q, k, v, g, omega, r)[0]
    assert torch.equal(inside, plain)


def test_joint_linear_equals_separate_layers() -> None:
    """One matmul over stacked weights, split per layer with each one's bias, gives each layer's output and every
    gradient; a single layer is left as it is."""
    from kdn.modules import linear, low_rank, split_outputs

    def fused_linear(x: torch.Tensor, layers: dict[str, torch.nn.Linear], multiple: int = 1
                     ) -> dict[str, torch.Tensor]:
        return split_outputs(linear(x, [m.weight for m in layers.values()], multiple=multiple), layers)

    torch.manual_seed(0)
    layers = {"a": torch.nn.Linear(12, 7, bias=False), "b": torch.nn.Linear(12, 3, bias=True),
              "c": low_rank(12, 4, 9, bias=True)[0]}
    layers = {n: m.double() for n, m in layers.items()}
    x = torch.randn(2, 5, 12, dtype=torch.float64, requires_grad=True)
    w = {n: torch.randn(2, 5, m.out_features, dtype=torch.float64) for n, m in layers.items()}
    grads = []
    for multiple in (1, 8, None):  # 14 columns as they are, padded to 16, and the separate layers
        outs = fused_linear(x, layers, multiple) if multiple else {n: m(x) for n, m in layers.items()}
        loss = sum((outs[n] * w[n]).sum() for n in layers)
        params = [x, *(p for m in layers.values() for p in m.parameters())]
        grads.append((outs, torch.autograd.grad(loss, params)))
    for fused in grads[:2]:
        for n in layers:
            torch.testing.assert_close(fused[0][n], grads[-1][0][n], rtol=1e-13, atol=1e-13)
        for a, b in zip(fused[1], grads[-1][1]):
            torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)
    padded = linear(x, [m.weight for m in layers.values()], multiple=8)
    assert padded.shape[-1] == 16 and torch.equal(padded[..., 14:], torch.zeros_like(padded[..., 14:]))
    with pytest.raises(ValueError, match="multiple must be a positive number of columns, got 0"):
        linear(x, [m.weight for m in layers.values()], multiple=0)
    only = fused_linear(x, {"b": layers["b"]})["b"]
    torch.testing.assert_close(only, layers["b"](x), rtol=0, atol=0)


def test_padded_joint_linear_under_autocast_equals_the_unpadded_one() -> None:
    """Under autocast (FP32 weights, bf16 GEMMs) the joint projection padded to a multiple of 8 columns gives the
    unpadded one's outputs in its first columns, zeros after them, and the same FP32 gradients, bias included."""
    from kdn.modules import linear

    torch.manual_seed(0)
    ws = [torch.randn(n, 16, requires_grad=True) for n in (7, 3, 9)]
    bias = torch.randn(19, requires_grad=True)
    x = torch.randn(2, 5, 16, requires_grad=True)
    w = torch.randn(2, 5, 19)
    runs = []
    for multiple in (1, 8):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = linear(x, ws, bias, multiple=multiple)
        assert y.shape[-1] == (19 if multiple == 1 else 24) and y.dtype == torch.bfloat16
        assert torch.equal(y[..., 19:], torch.zeros_like(y[..., 19:]))
        loss = (y[..., :19].float() * w).sum()
        runs.append((y[..., :19], torch.autograd.grad(loss, [x, bias, *ws])))
    assert torch.equal(runs[0][0], runs[1][0])
    for a, b in zip(runs[0][1], runs[1][1]):
        assert a.dtype == b.dtype and torch.equal(a, b)


IMPORT_ALL = r"""
import importlib, json, os, pkgutil, sys
before = dict(os.environ)
import kdn
after_kdn = dict(os.environ)
names = sorted(m.name for m in pkgutil.walk_packages(kdn.__path__, "kdn."))
failed = {}
for name in names:  # each module first, from a clean slate of kdn modules: a cycle would leave one half-initialised
    for loaded in [m for m in sys.modules if m == "kdn" or m.startswith("kdn.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception as e:
        failed[name] = f"{type(e).__name__}: {e}"
print(json.dumps({"env_changed": sorted(k for k in set(before) | set(after_kdn) if before.get(k) != after_kdn.get(k)),
                  "modules": names, "failed": failed}))
"""


def test_every_kdn_module_imports_alone_and_import_kdn_leaves_the_environment() -> None:
    """``import kdn`` neither sets nor changes an environment variable, and every module of the package imports first,
    with no other ``kdn`` module loaded (an import cycle would leave one of them half-initialised)."""
    # a minimal environment: this process imported kdn already, so a variable it set would be in os.environ here
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "OMP_NUM_THREADS")}
    env["PYTHONPATH"] = str(ROOT)
    proc = commands().run(["-c", IMPORT_ALL], env, ROOT, timeout_s(300))  # the server imports no kdn module
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    res = json.loads(out.strip().splitlines()[-1])
    assert res["env_changed"] == [] and res["failed"] == {}, res
    assert {"kdn.ops.api", "kdn.ops.chunk", "kdn.ops.torch_chunk", "kdn.modules.front_end",
            "kdn.layers.kdn"} <= set(res["modules"])


def test_kdn_modules_have_no_import_cycle() -> None:
    """The static import graph of ``kdn`` (every ``import``/``from`` of a ``kdn`` module, at any depth of the file)
    has no cycle, and no file exceeds 600 lines."""
    import ast

    root = Path(__file__).resolve().parents[1] / "kdn"
    graph: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root.parent).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        text = path.read_text()
        assert len(text.splitlines()) <= 600, (name, len(text.splitlines()))
        deps = set()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kdn"):
                # ``from pkg import submodule`` depends on the submodule; ``from mod import name`` on the module
                subs = {f"{node.module}.{a.name}" for a in node.names}
                found = {m for m in subs if (root.parent / m.replace(".", "/")).with_suffix(".py").exists()
                         or (root.parent / m.replace(".", "/") / "__init__.py").exists()}
                deps |= found if found == subs else found | {node.module}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("kdn")}
        graph[name] = deps
    graph = {n: {d for d in deps if d in graph and d != n} for n, deps in graph.items()}
    state: dict[str, int] = {}

    def visit(n: str, stack: list[str]) -> None:
        state[n] = 1
        for d in graph[n]:
            if state.get(d) == 1:
                raise AssertionError(f"import cycle: {' -> '.join(stack[stack.index(d):] + [d])}")
            if d not in state:
                visit(d, stack + [d])
        state[n] = 2

    for n in graph:
        if n not in state:
            visit(n, [n])
    assert len(graph) >= 25, sorted(graph)
