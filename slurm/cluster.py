"""SLURM cluster settings: ``conf/slurm/cluster.yaml``, then ``conf/slurm/local.yaml`` (git-ignored), then
``cluster.KEY=VALUE`` overrides on the command line."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from common.options import OptionError, parse_options
from slurm.sweeps import ROOT, SweepError

CONF = ROOT / "conf" / "slurm"


@dataclass
class ClusterConfig:
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    exclusive: bool = True
    nodes: int = 1
    gpus_per_node: int = 8
    cpus_per_task: int = 96
    mem: str = "0"
    timeout_min: int = 1440
    signal_delay_s: int = 180
    max_requeues: int = 100
    eval_gpus: int = 1
    eval_timeout_min: int = 240
    assumed_mfu: float = 0.25
    peak_tflops_per_gpu: float = 989.0
    runs_root: str = "runs/sweeps"

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


def load_cluster(overrides: list[str], conf_dir: Path = CONF) -> ClusterConfig:
    """Settings from the YAML files and ``KEY=VALUE`` overrides (without the ``cluster.`` prefix, read by
    ``common.options.parse_options``), validated; a one-line ``SweepError`` otherwise."""
    merged = OmegaConf.structured(ClusterConfig)
    for path in (conf_dir / "cluster.yaml", conf_dir / "local.yaml"):
        if path.is_file():
            try:
                merged = OmegaConf.merge(merged, OmegaConf.load(path))
            except Exception as e:  # omegaconf's errors name the key but span lines
                raise SweepError(f"{path}: {str(e).splitlines()[0]}") from e
    try:
        values, _ = parse_options(ClusterConfig, overrides, example="partition=gpu")
    except OptionError as e:  # the keys come without their cluster. prefix
        raise SweepError(f"cluster.{e}") from None
    cfg: ClusterConfig = dataclasses.replace(OmegaConf.to_object(merged), **values)
    check(cfg)
    return cfg


def check(c: ClusterConfig) -> None:
    """One-line ``SweepError`` for settings no job can run with."""
    for key in ("nodes", "gpus_per_node", "cpus_per_task", "timeout_min", "eval_gpus", "eval_timeout_min"):
        if getattr(c, key) < 1:
            raise SweepError(f"cluster.{key}={getattr(c, key)}: must be at least 1 (a training job needs a node "
                             "and a GPU on it)")
    if c.signal_delay_s < 0 or c.max_requeues < 0:
        raise SweepError("cluster.signal_delay_s and cluster.max_requeues must be >= 0")
    if c.signal_delay_s >= c.timeout_min * 60:
        raise SweepError(f"cluster.signal_delay_s={c.signal_delay_s} leaves no time before the "
                         f"{c.timeout_min}-minute limit; lower it or raise cluster.timeout_min")
    if not 0 < c.assumed_mfu <= 1 or c.peak_tflops_per_gpu <= 0:
        raise SweepError("cluster.assumed_mfu must be in (0, 1] and cluster.peak_tflops_per_gpu > 0")
