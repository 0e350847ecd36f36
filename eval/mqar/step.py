"""One optimiser step of an MQAR model, run eagerly or replayed from a CUDA graph.

A two-layer model at width 64-256 spends less time in its kernels than the host spends launching them, so eager
training leaves the GPU idle. On CUDA, :class:`TrainStep` captures the whole step, forward, backward, clipping and
the fused AdamW update, once per batch shape and replays it: one launch a step (on an H200 at width 256, 2.3-3.9
times faster than the eager step; docs/results/mqar.md, "MQAR on the GPU"). What makes one graph serve every step:

- the gradients are zeroed in place, never set to ``None``, so they keep their addresses;
- each parameter group's learning rate is a device tensor, which the scheduler fills in place;
- the batch is copied into static input buffers before each replay;
- the graphs of one model share one memory pool: they run one at a time, on one stream, and only their outputs
  (loss and gradient norm) outlive a replay. Each model captures on its own stream, so the graphs of models
  replayed side by side do not share a cuBLAS workspace (a graph keeps its capture stream's);
- the first :data:`WARMUP` steps of each shape run eagerly: they autotune the kernels and create the optimiser's
  state before anything is captured;
- the safe-gate check of the KDA-family kernels, which reads a device value on the host, answers "the exact token
  loop" without reading (``kdn.ops.triton.exact_only``) in every step, eager or captured, so the warm-up tunes
  the kernels the graph records and both compute alike.

A step that cannot be captured (a kernel that reads a device value on the host) falls back to eager steps for the
rest of the job, and :attr:`TrainStep.fallback` says why.
"""
from __future__ import annotations

import contextlib
from collections import Counter

import torch
import torch.nn.functional as F
from torch import Tensor

WARMUP = 2
"""Eager steps of each batch shape before its graph is captured."""


def autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA (as in training), FP32 elsewhere. The cast cache is off: a graph must not keep casts
    made during its capture (torch.cuda.graph's documented constraint), and eager steps lose nothing by it."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False)
    return contextlib.nullcontext()


def answer_logits(model: torch.nn.Module, inputs: Tensor, positions: Tensor) -> Tensor:
    """Logits at the answer positions only. ``inputs [B, T]``, ``positions [B, P]`` -> ``logits [B * P, V]``."""
    hidden, _, _ = model.model(inputs)
    picked = hidden.gather(1, positions[..., None].expand(-1, -1, hidden.shape[-1]))
    return model.lm_head(picked.flatten(0, 1))


class TrainStep:
    """Forward, backward, gradient clipping and one optimiser step on a batch: eager, or (``graphs`` on CUDA)
    replayed from a graph captured per batch shape.

    Args:
        model: a ``models.build_model`` language model. optimizer: its fused AdamW (``trainer.optim``).
        grad_clip: the gradient-norm clip. device: where the model is. graphs: capture CUDA graphs (ignored off
            CUDA).

    Example::

        step = TrainStep(model, optimizer, 1.0, device, graphs=True)
        loss, grad_norm = step(inputs, positions, values)  # 0-d device tensors, not synchronised
        scheduler.step()
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float,
                 device: torch.device, graphs: bool) -> None:
        self.model, self.optimizer, self.grad_clip, self.device = model, optimizer, grad_clip, device
        self.graphs = graphs and device.type == "cuda"
        self.fallback: str | None = None
        """Why graphs were given up (the capture's error), or ``None``."""
        self._seen: Counter[tuple] = Counter()
        self._captured: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple[Tensor, ...], tuple[Tensor, Tensor]]] = {}
        if self.graphs:
            # one memory pool for all of this model's graphs (they replay one at a time, on one stream), and its own
            # capture stream: a graph keeps the cuBLAS workspace of the stream it was captured on, and graphs of
            # jobs that replay side by side must not share one
            self._pool = torch.cuda.graph_pool_handle()
            self._capture_stream = torch.cuda.Stream(device)
            for group in optimizer.param_groups:
                group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)
                group["capturable"] = True

    @property
    def captured(self) -> list[tuple]:
        """The batch shapes ``((B, T), (B, P))`` captured in a graph so far."""
        return list(self._captured)

    def __call__(self, inputs: Tensor, positions: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """One step on ``inputs [B, T]``, ``positions [B, P]``, ``values [B, P]``. Returns ``(loss, grad_norm)``
        before clipping, 0-d tensors on the device."""
        key = (tuple(inputs.shape), tuple(positions.shape))
        if not self.graphs or self._seen[key] < WARMUP:
            self._seen[key] += 1
            return self._step(inputs, positions, values)
        entry = self._captured.get(key) or self._capture(key, inputs, positions, values)
        if entry is None:
            return self._step(inputs, positions, values)
        graph, static, (loss, norm) = entry
        for buf, x in zip(static, (inputs, positions, values)):
            buf.copy_(x)
        graph.replay()
        return loss.clone(), norm.clone()

    def _step(self, inputs: Tensor, positions: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        if not self.graphs:
            return self._eager(inputs, positions, values)
        from kdn.ops.triton import exact_only

        with exact_only():
            return self._eager(inputs, positions, values)

    def _eager(self, inputs: Tensor, positions: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        self.optimizer.zero_grad(set_to_none=False)
        with autocast(self.device):
            logits = answer_logits(self.model, inputs, positions)
        loss = F.cross_entropy(logits.float(), values.flatten())
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        return loss.detach(), norm

    def _capture(self, key: tuple, inputs: Tensor, positions: Tensor, values: Tensor
                 ) -> tuple[torch.cuda.CUDAGraph, tuple[Tensor, ...], tuple[Tensor, Tensor]] | None:
        static = tuple(x.clone() for x in (inputs, positions, values))
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool, stream=self._capture_stream):
                outputs = self._step(*static)
        except Exception as err:  # noqa: BLE001 - any uncapturable kernel: keep training eagerly
            torch.cuda.current_stream().synchronize()
            self.graphs, self.fallback = False, f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
            return None
        self._captured[key] = (graph, static, outputs)
        return self._captured[key]
