"""SLURM: named sweeps (conf/sweep/) expanded into batch jobs, multi-node launch, requeue-safe run directories.

``python -m slurm.sweep NAME [--dry-run]`` submits, ``python -m slurm.status NAME`` reports, and
``python -m slurm.launch train.py ...`` starts one node's processes of a job.
"""
from slurm.cluster import ClusterConfig, load_cluster
from slurm.launch import Rendezvous, expand_nodelist, rendezvous
from slurm.submit import Plan, plan, render, submit
from slurm.sweeps import Job, SweepError, available, expand

__all__ = ["ClusterConfig", "Job", "Plan", "Rendezvous", "SweepError", "available", "expand", "expand_nodelist",
           "load_cluster", "plan", "render", "rendezvous", "submit"]
