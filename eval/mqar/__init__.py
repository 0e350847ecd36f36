"""Multi-query associative recall (MQAR, Zoology): a seeded on-the-fly task, two-layer backbones of every mixer at
matched recurrent state trained on a mixture of settings, a learning-rate sweep per model, and a results JSON,
table and plot.
``python -m eval.mqar`` runs the grid (docs/mqar.md)."""
from eval.mqar.config import ALL_MIXERS, LONG_SETTINGS, PRESETS, ZOOLOGY_SETTINGS, MQARConfig, parse_overrides
from eval.mqar.data import GEN_BLOCK, IGNORE, MQARSetting, MQARSplit, generate
from eval.mqar.report import load_results, plot, table, write_report
from eval.mqar.run import Job, build_jobs, flatten, run_grid, summarize
from eval.mqar.step import TrainStep, answer_logits
from eval.mqar.train import (
    ExampleBudget,
    JobRun,
    MixerChoice,
    accuracy,
    model_config,
    state_elements,
    train_job,
    train_together,
)

__all__ = [
    "ALL_MIXERS", "GEN_BLOCK", "IGNORE", "LONG_SETTINGS", "PRESETS", "ZOOLOGY_SETTINGS", "ExampleBudget", "Job",
    "JobRun",
    "MQARConfig", "MQARSetting", "MQARSplit", "MixerChoice", "TrainStep", "accuracy", "answer_logits",
    "build_jobs", "flatten", "generate", "load_results", "model_config", "parse_overrides", "plot", "run_grid",
    "state_elements", "summarize", "table", "train_job", "train_together", "write_report",
]
