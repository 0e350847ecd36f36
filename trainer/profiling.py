"""Where a training step's time goes: a torch profile summarised into kernel groups, the device's busy share and
the top kernels and operators.

``train.py`` profiles optimiser steps ``start + 1 .. start + steps`` of a real run when ``logging.profile.steps``
is set (:class:`StepProfiler`, writing ``<run_dir>/profile/summary.json`` and a Chrome/Perfetto trace);
``bench/profile_step.py`` summarises a synthetic step the same way (:func:`summarize`).
"""
from __future__ import annotations

import contextlib
import gzip
import os
import re
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from common import write_json_atomic

# Kernel groups, matched in order by substrings of the kernel's name; unmatched Triton kernels (plain names) are the
# mixers' recurrence and gate kernels, unmatched CUDA C++ kernels ("void ...") are "other". Attention comes first:
# memory-efficient SDPA's kernels are CUTLASS's ("fmha_cutlass..."), flex_attention's are Inductor's Triton kernels.
# Inductor's other generated kernels ("triton_poi_"/"triton_red_"/"triton_per_": RoPE, or a compiled model's fusions)
# are its own group, not the recurrence's.
KERNEL_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("flex_attention", "flash", "fmha", "sdpa")),
    ("matmul", ("gemm", "nvjet", "cutlass", "cublas", "xmma")),
    ("optimiser", ("multi_tensor_apply", "adam")),
    ("pytorch elementwise/copy/reduce", ("at::native", "void at::")),
    ("norms", ("norm",)),
    ("swiglu", ("swiglu",)),
    ("short conv", ("conv1d",)),
    ("cross-entropy", ("cross_entropy", "logsumexp", "elementwise_mul_kernel")),
    ("inductor element-wise", ("triton_poi_", "triton_red_", "triton_per_")),
)
RECURRENCE = "recurrence and gates (Triton)"


_ALIGN = re.compile(r"_align(\d+)")


def misaligned_gemm(name: str) -> bool:
    """Whether a CUTLASS GEMM kernel's name says its operands are aligned to fewer than 16 bytes (``_alignN``: N
    elements; 8 of bf16/fp16, 4 of fp32). cuBLAS falls back to such kernels when a matrix's rows are not 16-byte
    aligned (a width that is not a multiple of 8 in bf16), and they run several times slower than Hopper's."""
    m = _ALIGN.search(name)
    if m is None:
        return False
    return int(m.group(1)) < (8 if any(t in name for t in ("f16", "s16816", "h16816")) else 4)


def kernel_group(name: str) -> str:
    """The group of a CUDA kernel's name (see ``KERNEL_GROUPS``)."""
    for group, keys in KERNEL_GROUPS:
        if any(k in name for k in keys):
            return group
    return "other" if name.startswith("void ") else RECURRENCE


def summarize(prof: profile, wall_ms: float, steps: int, rows: int) -> dict[str, Any]:
    """Per-step figures of a profile that covered ``steps`` steps in ``wall_ms`` (synchronised at both ends).

    On CUDA: ``device_busy_ms`` (kernel time summed; its shortfall from the wall time is the device idling on the
    host or a synchronisation), ``device_busy_frac``, ``groups_ms`` (:func:`kernel_group`), ``misaligned_gemm_ms``
    (:func:`misaligned_gemm`), ``top`` kernels and
    ``top_ops`` (the PyTorch operators whose own kernels take the most device time). On the CPU: ``top``
    operators by their own CPU time. Every time is in ms per step."""
    events = prof.key_averages()
    out: dict[str, Any] = {"wall_ms": wall_ms / steps}
    # A user annotation (the optimiser's "Optimizer.step#AdamW.step") is a CUDA event spanning kernels that are
    # counted on their own: summing it would count the optimiser twice.
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
               and not getattr(e, "is_user_annotation", False)]
    if kernels:
        busy = sum(e.self_device_time_total for e in kernels) / 1e3 / steps
        groups: dict[str, float] = {}
        for e in kernels:
            group = kernel_group(e.key)
            groups[group] = groups.get(group, 0.0) + e.self_device_time_total / 1e3 / steps
        ops = [e for e in events if e.key.startswith("aten::") and e.self_device_time_total > 0]
        misaligned = sum(e.self_device_time_total for e in kernels if misaligned_gemm(e.key)) / 1e3 / steps
        out |= {"device_busy_ms": busy, "device_busy_frac": busy / out["wall_ms"],
                "groups_ms": dict(sorted(groups.items(), key=lambda kv: -kv[1])), "misaligned_gemm_ms": misaligned,
                "top_ops": [{"name": e.key, "calls": e.count / steps, "ms": e.self_device_time_total / 1e3 / steps}
                            for e in sorted(ops, key=lambda e: -e.self_device_time_total)[:rows]]}
        key = "self_device_time_total"
    else:
        kernels = [e for e in events if e.key.startswith("aten::")]
        key = "self_cpu_time_total"
    top = sorted(kernels, key=lambda e: -getattr(e, key))[:rows]
    out["top"] = [{"name": e.key[:120], "calls": e.count / steps, "ms": getattr(e, key) / 1e3 / steps} for e in top]
    return out


class StepProfiler:
    """Profiles the optimiser steps ``start + 1 .. start + steps`` of a run on the main process, then writes
    ``out_dir/summary.json`` (:func:`summarize` plus the safe-gate reads of those steps: how many mixer calls took
    fla's tensor-core diagonal blocks and how many the exact token loop, ``kdn.ops.triton.safe_gate``) and
    ``out_dir/trace.json.gz`` (open it in Perfetto or chrome://tracing). ``steps = 0`` or a resumed run already
    past ``start`` profiles nothing."""

    def __init__(self, out_dir: Path, start: int, steps: int, enabled: bool, device: torch.device,
                 rows: int = 30) -> None:
        self.out_dir, self.start, self.steps, self.rows, self.device = out_dir, start, steps, rows, device
        self.enabled = enabled and steps > 0
        self._prof: profile | None = None
        self._t0 = 0.0
        self._gates: Counter[bool] = Counter()
        self._scope = contextlib.ExitStack()  # the safe-gate reads of the profiled steps are counted inside

    @property
    def active(self) -> bool:
        """Whether the current step runs under the profiler."""
        return self._prof is not None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step_begins(self, step: int) -> None:
        """Call before running optimiser step ``step + 1`` (``step`` = the steps done so far)."""
        if not self.enabled or step != self.start:
            return
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self._sync()
        self._gates = self._scope.enter_context(_count_safe_gate_reads())
        self._prof = profile(activities=acts)
        self._prof.__enter__()
        self._t0 = time.perf_counter()

    def step_ends(self, step: int) -> Path | None:
        """Call after optimiser step ``step`` is applied; at the window's end, writes the files and returns the
        summary's path."""
        if self._prof is None or step != self.start + self.steps:
            return None
        self._sync()
        wall_ms = (time.perf_counter() - self._t0) * 1e3
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self._scope.close()
        reads = self._gates
        summary = {"steps": [self.start + 1, self.start + self.steps],
                   "safe_gate_reads": {"tensor_core": reads[True], "token_loop": reads[False]}}
        summary |= summarize(prof, wall_ms, self.steps, self.rows)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        raw, packed = self.out_dir / ".trace.json", self.out_dir / ".trace.json.gz.tmp"
        prof.export_chrome_trace(str(raw))
        with raw.open("rb") as src, gzip.open(packed, "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.replace(packed, self.out_dir / "trace.json.gz")
        raw.unlink()
        path = self.out_dir / "summary.json"
        write_json_atomic(path, summary)
        return path


def _count_safe_gate_reads() -> contextlib.AbstractContextManager[Counter[bool]]:
    """``kdn.ops.triton.count_safe_gate_reads()`` when the CUDA backend is importable, else a scope that counts
    nothing (no check is made without it)."""
    try:
        from kdn.ops.triton import count_safe_gate_reads
    except ImportError:
        return contextlib.nullcontext(Counter())
    return count_safe_gate_reads()
