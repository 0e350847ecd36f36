"""The parts of train.py's loop: config schema, optimiser and schedule, checkpoints, preemption, metrics, and the
run directory's identity and lock (``trainer.rundir``)."""
