"""The delta-rule baselines' fla kernel paths on the CPU, through Triton's interpreter (``tests/triton_interpret.py``).

FP32, one fresh interpreter per mixer: for Gated DeltaNet, KDA (through ``kdn.ops.chunk.chunk_kda``) and GDN-2, the
``backend="fla"`` path with the fused front end (``kdn.modules.conv``, fla's KDA gate and norms) against the PyTorch
path with the PyTorch front end (``fused=False``, the same weights), output and every gradient, on a padded batch of
two chunks; and that PyTorch layer against fla's own layer with the mapped weights. The two comparisons together
check the fused front end, the fla memory path and the weights' mapping. DeltaNet is left to the GPU test
(``tests/test_mixers_gpu.py``): fla's ``chunk_delta_rule`` refuses FP32 and the interpreter's bf16 emulation
overflows.
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
from fla.ops.gdn2.chunk_intra_token_parallel import chunk_gdn2_fwd_kernel_intra_token_parallel
from fla.ops.kda.chunk_intra_token_parallel import chunk_kda_fwd_kernel_intra_token_parallel
import kdn.modules.front_end as front_end
import kdn.ops.gate as ops_gate
from kdn_inputs import rel_err
from models.layers.delta import DELTA_MIXERS, _DeltaRule, fla_layer_kwargs, fla_state_dict_map
_DeltaRule.resolve_backend = lambda self, device: self.backend or "torch"  # fla's kernels on CPU tensors
front_end.fla_fused = ops_gate.fla_fused = lambda t, fused=True: fused  # the fused kernels on CPU tensors
# the interpreter runs each autotuner's first config: the token-parallel kernels take both heads (BH = 2) in one
# program, half the programs of BH = 1, the same values
for kernel in (chunk_gdn2_fwd_kernel_intra_token_parallel, chunk_kda_fwd_kernel_intra_token_parallel):
    kernel.fn.configs.sort(key=lambda c: c.kwargs["BH"] != 2)  # kernel: heuristics over the autotuner
fla_cls = {"gdn": fla_layers.GatedDeltaNet, "kda": fla_layers.KimiDeltaAttention, "gdn2": fla_layers.GatedDeltaNet2}
name = sys.argv[1]
torch.manual_seed(0)
layer = DELTA_MIXERS[name](64, 2, 16, layer_idx=0)  # fused front end, backend="fla"
ref = DELTA_MIXERS[name](64, 2, 16, layer_idx=0, fused=False, backend="torch")
ref.load_state_dict(layer.state_dict())
layer.backend = "fla"
x = torch.randn(2, 70, 64)
mask = torch.ones(2, 70, dtype=torch.long)
mask[1, :9] = 0
res = {}
for key, mixer in (("fla", layer), ("torch", ref)):
    xi = x.clone().requires_grad_()
    o = mixer(xi, attention_mask=mask)[0]
    (o * torch.randn(o.shape, generator=torch.Generator().manual_seed(3))).sum().backward()
    res[key] = [o.detach(), xi.grad] + [p.grad for p in mixer.parameters()]
names = ["o", "dx"] + [n for n, _ in layer.named_parameters()]
errs = {n: rel_err(a, b) for n, a, b in zip(names, res["fla"], res["torch"]) if b is not None}
theirs = fla_cls[name](**fla_layer_kwargs(name, 64, 2, 16, 1e-5))
theirs.load_state_dict(fla_state_dict_map(name, ref.state_dict()))
with torch.no_grad():  # the weights' mapping: one sequence of two chunks (> 64 tokens: fla's chunk kernels)
    errs["vs_fla_layer"] = rel_err(theirs(x[:1])[0], ref(x[:1])[0])
print(json.dumps(errs))
"""


@pytest.mark.parametrize("name", ["gdn", "kda", "gdn2"])
def test_delta_mixer_fla_path_in_interpreter(name: str) -> None:
    errs = triton_interpret.run_interpreted(SCRIPT, name, timeout=120)
    assert {"o", "dx", "vs_fla_layer"} <= set(errs), errs
    assert max(errs.values()) < 1e-4, (name, errs)
