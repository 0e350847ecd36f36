"""Device, precision and process group: one ``Accelerator`` for CPU, one GPU, DDP or FSDP2."""
from __future__ import annotations

import os

import torch
from accelerate import Accelerator, FullyShardedDataParallelPlugin, PartialState

from common.device import resolve_device
from common.options import OptionError
from trainer.config import ConfigError, TrainerConfig


def export_slurm_env() -> None:
    """Under ``srun`` with several tasks (sbatch template, Hydra submitit launcher) and no launcher
    variables set, export ``RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT`` from SLURM's."""
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "RANK" not in os.environ:
        from submitit.helpers import TorchDistributedEnvironment

        TorchDistributedEnvironment().export(set_cuda_visible_devices=False)


def device_and_precision(t: TrainerConfig) -> tuple[bool, str]:
    """``(use_cpu, precision)`` with ``precision`` in ``{"bf16", "fp32"}`` (auto: bf16 on GPU, fp32 on CPU); the
    device as every tool resolves it (:func:`common.resolve_device`)."""
    try:
        cpu = resolve_device(t.device, "trainer.device").type == "cpu"
    except OptionError as err:
        raise ConfigError(str(err)) from None
    precision = ("fp32" if cpu else "bf16") if t.precision == "auto" else t.precision
    if t.distributed == "fsdp" and cpu:
        raise ConfigError("trainer.distributed: fsdp needs CUDA devices; use ddp on the CPU")
    return cpu, precision


def world_size(t: TrainerConfig) -> int:
    """Number of data-parallel processes (initialises the process group when launched distributed)."""
    export_slurm_env()
    cpu, _ = device_and_precision(t)
    return PartialState(cpu=cpu).num_processes


def cuda_matmul_defaults() -> None:
    """TF32 for FP32 matmuls: those of FP32 training (``trainer.precision=fp32``) and any that autocast leaves in
    FP32. Training and its benchmarks share this setting."""
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


def fsdp_plugin(precision: str) -> FullyShardedDataParallelPlugin:
    """FSDP2 over each block listed in the model's ``_no_split_modules``, with sharded checkpoints. In bf16 the
    blocks compute with bf16 parameters, as under DDP with autocast, while the rest stays as on one GPU: gradients
    are reduced in FP32, and the blocks' inputs and outputs keep their dtypes (the FP32 residual stream and loss
    are not rounded to bf16 at each block, as accelerate's default policy does)."""
    policy = None
    if precision == "bf16":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=None,
                                      cast_forward_inputs=False)
    return FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", reshard_after_forward=True,
        state_dict_type="SHARDED_STATE_DICT", mixed_precision_policy=policy)


def build_accelerator(t: TrainerConfig, grad_accum: int) -> tuple[Accelerator, str]:
    """The run's ``Accelerator`` (DDP or FSDP2, bf16 autocast or FP32, optional ``torch.compile``)
    and the resolved precision."""
    cpu, precision = device_and_precision(t)
    fsdp = fsdp_plugin(precision) if t.distributed == "fsdp" else None
    if not cpu:
        cuda_matmul_defaults()
    accelerator = Accelerator(
        cpu=cpu, mixed_precision="bf16" if precision == "bf16" else "no", gradient_accumulation_steps=grad_accum,
        fsdp_plugin=fsdp, dynamo_backend="inductor" if t.compile else "no")
    return accelerator, precision
