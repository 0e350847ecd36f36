"""The parts of train.py's loop: config schema, optimiser and schedule, checkpoints, preemption, metrics."""
