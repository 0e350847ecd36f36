"""Start this node's training processes of a (multi-node) SLURM job, with the rendezvous from SLURM's variables.

    srun --ntasks-per-node=1 python -m slurm.launch train.py experiment=table1_750m_kdn_diag
    python -m slurm.launch --nproc-per-node 2 train.py model=toy        # outside SLURM: one node, two processes

One task per node runs this module. It derives the node count, this node's rank, the master address (the first
host of ``SLURM_JOB_NODELIST``) and a port from the job id, and starts ``--nproc-per-node`` processes (default: the
visible GPUs, else 1) with the ``torch.distributed`` variables that ``torchrun`` would set (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), which
accelerate reads. Unlike ``torchrun``'s agent, it forwards SIGUSR1, SIGUSR2 and SIGTERM to every process and waits
for them however long the checkpoint takes: train.py saves at the next step boundary and exits 75, and so does this
launcher, so the batch script requeues the job (``slurm/requeue.sh``).
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass

REQUEUE_EXIT_CODE = 75  # trainer.preemption.REQUEUE_EXIT_CODE (not imported: this module starts before torch)
FORWARDED = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list, e.g. ``"gpu[01-03,7],login"`` -> ``["gpu01", "gpu02", "gpu03", "gpu7",
    "login"]`` (zero padding kept)."""
    hosts: list[str] = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", nodelist):
        if plain:
            hosts.append(plain)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            hosts += [f"{prefix}{i:0{len(lo)}d}" for i in range(int(lo), int(hi or lo) + 1)]
    if not hosts:
        raise ValueError(f"SLURM_JOB_NODELIST={nodelist!r} names no host")
    return hosts


@dataclass(frozen=True)
class Rendezvous:
    """Where this node's processes sit in the job's world."""

    nnodes: int
    node_rank: int
    nproc_per_node: int
    master_addr: str
    master_port: int

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def env(self, local_rank: int) -> dict[str, str]:
        """The variables of process ``local_rank`` on this node."""
        return {"RANK": str(self.node_rank * self.nproc_per_node + local_rank), "LOCAL_RANK": str(local_rank),
                "WORLD_SIZE": str(self.world_size), "LOCAL_WORLD_SIZE": str(self.nproc_per_node),
                "GROUP_RANK": str(self.node_rank), "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(self.master_port)}


def rendezvous(environ: dict[str, str], nproc_per_node: int) -> Rendezvous:
    """The rendezvous of this node from SLURM's variables (one node on localhost outside SLURM)."""
    if "SLURM_JOB_ID" not in environ:
        return Rendezvous(1, 0, nproc_per_node, "127.0.0.1", int(environ.get("MASTER_PORT", "29500")))
    hosts = expand_nodelist(environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST", ""))
    nnodes = int(environ.get("SLURM_NNODES", len(hosts)))
    node_rank = int(environ.get("SLURM_NODEID", "0"))
    if not 0 <= node_rank < nnodes or nnodes > len(hosts):
        raise ValueError(f"SLURM_NODEID={node_rank} with SLURM_NNODES={nnodes} over hosts {hosts}: run one task "
                         "per node (srun --ntasks-per-node=1)")
    port = int(environ.get("MASTER_PORT", 20000 + int(environ["SLURM_JOB_ID"]) % 20000))
    return Rendezvous(nnodes, node_rank, nproc_per_node, hosts[0], port)


def default_nproc() -> int:
    """GPUs on this node as SLURM or CUDA_VISIBLE_DEVICES report them, else one (CPU) process."""
    for key in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        value = os.environ.get(key, "")
        if value.split(":")[-1].isdigit():
            return int(value.split(":")[-1])
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return len([d for d in visible.split(",") if d]) if visible else 1


def run(script: list[str], rdzv: Rendezvous) -> int:
    """Start ``python SCRIPT ...`` once per local rank, forward signals, return the job's exit code: 0 when every
    process succeeded, 75 when they stopped for a requeue, else the first failure's code (128 + N for a process
    killed by signal N)."""
    procs: list[subprocess.Popen] = []

    def forward(signum: int, _frame: object) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    for sig in FORWARDED:  # before the first start, so that no signal is lost
        signal.signal(sig, forward)
    for r in range(rdzv.nproc_per_node):
        procs.append(subprocess.Popen([sys.executable, *script], env={**os.environ, **rdzv.env(r)}))
    codes = [c if (c := p.wait()) >= 0 else 128 - c for p in procs]  # a signal death as the shell reports it
    if all(c == 0 for c in codes):
        return 0
    if all(c in (0, REQUEUE_EXIT_CODE) for c in codes):
        return REQUEUE_EXIT_CODE
    return next(c for c in codes if c not in (0, REQUEUE_EXIT_CODE))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc-per-node", type=int, default=None, help="processes on this node (default: its GPUs)")
    ap.add_argument("script", nargs=argparse.REMAINDER, help="the training script and its overrides")
    args = ap.parse_args(argv)
    if not args.script:
        ap.error("name the script to start, e.g. python -m slurm.launch train.py experiment=...")
    nproc = args.nproc_per_node or default_nproc()
    if nproc < 1:
        ap.error(f"--nproc-per-node {nproc}: start at least one process")
    try:
        rdzv = rendezvous(dict(os.environ), nproc)
    except ValueError as e:
        ap.error(str(e))
    print(f"slurm.launch: node {rdzv.node_rank}/{rdzv.nnodes}, {nproc} process(es), world {rdzv.world_size}, "
          f"master {rdzv.master_addr}:{rdzv.master_port}", flush=True)
    return run(args.script, rdzv)


if __name__ == "__main__":
    sys.exit(main())
