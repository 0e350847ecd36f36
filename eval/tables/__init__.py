"""The paper's Tables 1-5, Fig. 4 and the loss curves of a sweep, regenerated from a directory of finished runs.

``python -m eval.tables RUNS_DIR [--paper] [--out DIR] [--throughput FILE]``. Public surface:
- ``find_runs(root) -> list[Run]``, ``Run``, ``Experiment`` (identity of a run, from its ``config.yaml``)
- ``TABLES`` (the table definitions), ``build_table(spec, runs, paper=, diffs=) -> Table``, ``SettingsMismatch``
- ``markdown``, ``latex``, ``csv_text``, ``as_json``, ``write_table`` (renderings of one table model)
- ``throughput_figure``, ``loss_curves`` (figures), ``PAPER`` (published numbers)
"""
from eval.tables.figures import loss_curves, throughput_figure
from eval.tables.model import Cell, SettingsMismatch, Table, build_table
from eval.tables.paper import BETA_EFF_MEANS, MU_INTERVENTION, PAPER
from eval.tables.render import as_json, csv_text, latex, markdown, write_table
from eval.tables.runs import Experiment, Run, find_runs, preset_identity, read_jsonl
from eval.tables.specs import TABLES

__all__ = [
    "find_runs", "Run", "Experiment", "preset_identity", "read_jsonl", "TABLES", "build_table", "Table", "Cell",
    "SettingsMismatch", "markdown", "latex", "csv_text", "as_json", "write_table", "throughput_figure",
    "loss_curves", "PAPER", "BETA_EFF_MEANS", "MU_INTERVENTION",
]
