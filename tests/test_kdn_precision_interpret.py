"""The memory's precision option (``precision="bf16"|"fp32"``) on the CPU.

Through Triton's interpreter (whose dots are exact FP32, so this proves the plumbing and the FP32 gain; the TF32x3
accuracy is measured on a GPU by ``tests/test_kdn_precision_gpu.py``): bf16 ``q, k, v`` beside FP32 gates, as the
layers pass them, Diagonal and Isotropic, fixed-length and packed, against float64. In-process: the one-line errors,
the option's way from the model config to the layers, and the TF32x3 kernel copies' scoping of Triton's knob.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
triton_interpret = pytest.importorskip("triton_interpret")  # tests/triton_interpret.py

SCRIPT = r"""
import itertools, json, sys
import torch
sys.path.insert(0, "tests")
import triton_interpret
triton_interpret.enable("fla.ops.kda", "fla.ops.precond_kda.chunk")
import kdn
from kdn.ops import chunk as kc
from kdn.ops import triton as kt
from kdn_inputs import make_inputs, rel_err

NAMES = ("q", "k", "v", "g", "omega", "r")
H, K = 2, 16


def run(iso, lens):
    T = sum(lens)
    cu = None if len(lens) == 1 else torch.tensor([0, *itertools.accumulate(lens)])
    N = len(lens)
    x = make_inputs(1, T, H, K, K, isotropic=iso, dtype=torch.float64, g_min=-0.3, seed=T)
    for n in ("q", "k", "v"):  # the values the layers' bf16 projections can hold
        x[n] = x[n].to(torch.bfloat16).double()
    gen = torch.Generator().manual_seed(1)
    S0 = torch.randn(N, H, K, K, generator=gen, dtype=torch.float64)
    u0 = torch.rand(*((N, H) if iso else (N, H, K)), generator=gen, dtype=torch.float64) + 0.5
    mu = torch.full((H,), float(K), dtype=torch.float64)
    fn = kc.chunk_isotropic_kdn if iso else kc.chunk_diagonal_kdn
    outs = {}
    for route in ("ref", "default", "bf16", "fp32"):
        # bf16 q, k, v for the fp32 route; FP32 for the default and bf16 ones, whose bf16 memory kernels the
        # interpreter does not emulate
        low = torch.bfloat16 if route == "fp32" else torch.float32
        dt = {n: torch.float64 if route == "ref" else low if n in "qkv" else torch.float32 for n in NAMES}
        leaves = [x[n].to(dt[n]).detach().requires_grad_() for n in NAMES]
        wide = torch.float64 if route == "ref" else torch.float32
        rest = [t.to(wide).detach().requires_grad_() for t in (mu, S0, u0)]
        if route == "ref":
            o, (S, u) = (kdn.isotropic_kdn if iso else kdn.diagonal_kdn)(
                *leaves, mu=rest[0], initial_state=tuple(rest[1:]), output_final_state=True, cu_seqlens=cu,
                backend="torch", scale=K ** -0.5)
        else:
            kw = {} if route == "default" else {"precision": route}
            o, (S, u) = fn(*leaves, rest[0], tuple(rest[1:]), scale=K ** -0.5, output_final_state=True,
                           cu_seqlens=cu, **kw)
        gen = torch.Generator().manual_seed(2)
        ws = [torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in (o, S, u)]
        sum((w * t.double()).sum() for w, t in zip(ws, (o, S, u))).backward()
        grads = {"d" + n: t.grad for n, t in zip((*NAMES, "mu", "S0", "u0"), leaves + rest)}
        outs[route] = {"o": o, "S_T": S, "u_T": u, **grads}
    err = {n: rel_err(outs["fp32"][n], ref) for n, ref in outs["ref"].items()}
    same = all(torch.equal(outs["default"][n], outs["bf16"][n]) for n in outs["ref"])
    return {"errors": err, "default_is_bf16": same, "o_dtype": str(outs["fp32"]["o"].dtype)}


print(json.dumps({f"{'iso' if iso else 'diag'}_{'packed' if len(lens) > 1 else 'fixed'}": run(iso, lens)
                  for iso in (False, True) for lens in ((130,), (13, 1, 66))}))
"""


def test_fp32_precision_through_the_interpreter() -> None:
    """bf16 ``q, k, v``: ``precision="fp32"`` runs the memory and its gain in FP32: o, the final states and every
    gradient within 2e-5 of float64 where the interpreter's dots are exact (``"bf16"`` rounds the gain and the
    memory's operands to bf16: ~1e-3), those of the bf16 ``q, k, v`` within their own rounding (2^-8).
    ``"bf16"`` is the default, bit for bit (FP32 inputs here). T: three chunks of 64 (the last of 2 tokens), and two
    packed sequences (one of a partial chunk, one of two chunks) around one of a single token."""
    pytest.importorskip("fla")
    report = triton_interpret.run_interpreted(SCRIPT)
    assert report.keys() == {"diag_fixed", "diag_packed", "iso_fixed", "iso_packed"}
    for case, r in report.items():
        err = r["errors"]
        assert len(err) == 12, (case, err)
        assert all(e < (4e-3 if n in ("dq", "dk", "dv") else 2e-5) for n, e in err.items()), (case, err)
        assert r["default_is_bf16"], case
        assert r["o_dtype"] == "torch.float32", case


def _inputs(iso: bool = False) -> dict[str, torch.Tensor]:
    from kdn_inputs import make_inputs

    return make_inputs(1, 8, 2, 4, 4, isotropic=iso, dtype=torch.float32)


@pytest.mark.parametrize("iso", [False, True], ids=["diagonal", "isotropic"])
def test_bad_precision_is_one_line_naming_the_choices(iso: bool) -> None:
    import kdn

    fn = kdn.isotropic_kdn if iso else kdn.diagonal_kdn
    with pytest.raises(ValueError, match=r"^precision must be one of \('bf16', 'fp32'\), got 'fp16'$"):
        fn(*_inputs(iso).values(), precision="fp16")
    layer = kdn.IsotropicKDN if iso else kdn.DiagonalKDN
    with pytest.raises(ValueError, match=r"^precision must be one of"):
        layer(32, 2, 16, precision="tf32")


def test_fp32_precision_needs_the_asymmetric_memory() -> None:
    import kdn

    with pytest.raises(ValueError, match=r"^precision='fp32' runs the asymmetric memory; pass memory='asym'"):
        kdn.diagonal_kdn(*_inputs().values(), memory="dplr", precision="fp32")
    out, _ = kdn.diagonal_kdn(*_inputs().values(), precision="fp32")  # the PyTorch path: FP32 either way
    ref, _ = kdn.diagonal_kdn(*_inputs().values())
    assert torch.equal(out, ref)


def test_precision_reaches_the_layers_from_the_model_config() -> None:
    """``mixer_kwargs["precision"]`` builds every KDN layer at that precision (default ``"bf16"``); mixers without
    the option refuse it, naming their options."""
    import models

    for mixer in ("kdn_diag", "kdn_iso"):
        for kwargs, want in (({}, "bf16"), ({"precision": "fp32"}, "fp32")):
            cfg = models.model_config("toy", mixer, vocab_size=64, num_layers=2, mixer_kwargs=kwargs)
            with torch.device("meta"):
                model = models.build_model(cfg)
            got = {m.precision for m in model.modules() if hasattr(m, "noise_terms")}
            assert got == {want}, (mixer, kwargs, got)
    with pytest.raises(ValueError, match="mixer 'kda' does not take 'precision'; the mixers taking it: kdn_diag, "
                                         "kdn_iso"):
        models.model_config("toy", "kda", vocab_size=64, num_layers=2, mixer_kwargs={"precision": "fp32"})


def test_precise_kernels_scope_the_dot_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    """A launcher's TF32x3 copy resolves its kernels to copies (fla's module keeps its own); a copy's launch passes
    the compile option (its cache key) and traces with Triton's ``fp32_default`` knob at ``tf32x3``, restored
    afterwards, after a failed launch too."""
    import triton
    from fla.ops.gla import chunk as gla
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    from kdn.ops.triton import precision as prec

    launcher = prec.precise_launcher(gla.chunk_gla_fwd_o_gk)
    copy = launcher.__wrapped__.__globals__["chunk_gla_fwd_kernel_o"]
    original = gla.chunk_gla_fwd_kernel_o
    assert copy is not original and gla.chunk_gla_fwd_kernel_o is original
    assert prec.precise_launcher(gla.chunk_gla_fwd_o_gk) is launcher and prec.precise_kernel(original) is copy
    inner = copy
    while not isinstance(inner, JITFunction):
        inner = inner.fn
    assert type(inner) is prec._PreciseJIT
    base = original
    while not isinstance(base, JITFunction):
        base = base.fn
    assert inner.cache_key == f"{base.cache_key}-tf32x3"  # the copy's tuned configs are stored apart
    tuner = copy
    while not isinstance(tuner, Autotuner):  # under fla's @triton.heuristics
        tuner = tuner.fn
    assert tuner.cache_results and tuner.cache == {}

    seen = []

    def record(self: JITFunction, *args: object, grid: object, warmup: bool, **kwargs: object) -> None:
        seen.append((triton.knobs.language.fp32_default, kwargs.get("default_dot_input_precision")))
        if kwargs.get("fail"):
            raise RuntimeError("launch failed")

    monkeypatch.setattr(JITFunction, "run", record)
    before = triton.knobs.language.fp32_default
    inner.run(grid=(1,), warmup=False)
    with pytest.raises(RuntimeError):
        inner.run(grid=(1,), warmup=False, fail=True)
    assert seen == [("tf32x3", "tf32x3")] * 2
    assert triton.knobs.language.fp32_default == before
