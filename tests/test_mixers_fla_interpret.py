"""The delta-rule baselines' fla kernel paths on the CPU, through Triton's interpreter (``tests/triton_interpret.py``).

FP32, one fresh interpreter: for Gated DeltaNet, KDA (through ``kdn.ops.chunk.chunk_kda``) and GDN-2, the
``backend="fla"`` path (with the fused front end: ``kdn.modules.conv``, fla's KDA gate and norms) against the PyTorch
path, output and every gradient, on a padded batch; and our layer against fla's own layer with the mapped weights.
DeltaNet is left to the GPU test (``tests/test_mixers_gpu.py``): fla's ``chunk_delta_rule`` refuses FP32 and the
interpreter's bf16 emulation overflows.
"""
from __future__ import annotations

import pytest

pytest.importorskip("triton")
pytest.importorskip("fla")
triton_interpret = pytest.importorskip("triton_interpret")  # tests/triton_interpret.py

SCRIPT = r"""
import json, sys, torch
sys.path.insert(0, "tests")
import triton_interpret
triton_interpret.enable("fla.layers", "fla.ops.gated_delta_rule", "fla.ops.kda", "fla.ops.gdn2",
                        "fla.ops.precond_kda.chunk")
from fla import layers as fla_layers
import kdn.modules.front_end as front_end
import kdn.ops.gate as ops_gate
from kdn_inputs import rel_err
from models.layers.delta import DELTA_MIXERS, _DeltaRule, fla_layer_kwargs, fla_state_dict_map
_DeltaRule.resolve_backend = lambda self, device: self.backend or "torch"  # fla's kernels on CPU tensors
front_end.fla_fused = ops_gate.fla_fused = lambda t, fused=True: fused  # the fused kernels on CPU tensors
fla_cls = {"gdn": fla_layers.GatedDeltaNet, "kda": fla_layers.KimiDeltaAttention, "gdn2": fla_layers.GatedDeltaNet2}
out = {}
for name, cls in fla_cls.items():
    torch.manual_seed(0)
    layer = DELTA_MIXERS[name](64, 2, 16, layer_idx=0)
    x = torch.randn(2, 70, 64)
    mask = torch.ones(2, 70, dtype=torch.long)
    mask[1, :9] = 0
    res = {}
    for backend in ("torch", "fla"):
        layer.backend = backend
        layer.zero_grad()
        xi = x.clone().requires_grad_()
        o = layer(xi, attention_mask=mask)[0]
        (o * torch.randn(o.shape, generator=torch.Generator().manual_seed(3))).sum().backward()
        res[backend] = [o.detach(), xi.grad] + [p.grad for p in layer.parameters()]
    names = ["o", "dx"] + [n for n, _ in layer.named_parameters()]
    errs = {n: rel_err(a, b) for n, a, b in zip(names, res["fla"], res["torch"]) if b is not None}
    theirs = cls(**fla_layer_kwargs(name, 64, 2, 16, 1e-5))
    theirs.load_state_dict(fla_state_dict_map(name, layer.state_dict()))
    layer.backend = "torch"
    with torch.no_grad():  # the weights' mapping: one sequence of two chunks (> 64 tokens: fla's chunk kernels)
        errs["vs_fla_layer"] = rel_err(theirs(x[:1])[0], layer(x[:1])[0])
    out[name] = errs
print(json.dumps(out))
"""


def test_delta_mixers_fla_paths_in_interpreter() -> None:
    errs = triton_interpret.run_interpreted(SCRIPT)
    assert set(errs) == {"gdn", "kda", "gdn2"}
    for name, e in errs.items():
        assert max(e.values()) < 1e-4, (name, e)
