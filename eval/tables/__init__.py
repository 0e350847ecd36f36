"""The paper's Tables 1-5, Fig. 4 and the loss curves of a sweep, regenerated from a directory of finished runs.

``python -m eval.tables RUNS_DIR [--paper] [--out DIR] [--throughput FILE] [--mqar FILE ...]``; the MQAR recall
table (mixers x setting/width, test accuracy %, paired Δ vs KDA) is built from the ``python -m eval.mqar`` results
under RUNS_DIR or named by ``--mqar``, and rendered like Tables 1-5. Public surface:
- ``find_runs(root, skipped=) -> list[Run]``, ``Run``, ``Experiment`` (identity of a run, from its ``config.yaml``;
  files a run is still writing are left out, one line each)
- ``TABLES`` (the table definitions), ``build_table(spec, runs, paper=, diffs=) -> Table``, ``SettingsMismatch``;
  rows evaluated off the paper's protocol (``paper_protocol_gap``) are marked and the paper's rows kept apart
- ``build_runs_table(runs, root) -> RunsTable``, ``write_runs_table`` (every evaluated run, paper preset or not)
- ``markdown``, ``latex``, ``csv_text``, ``as_json``, ``write_table`` (renderings of one table model)
- ``read_mqar(paths) -> list[MQARFile]``, ``find_mqar(root)``, ``build_mqar_table(files, reference=, diffs=) ->
  Table`` (the MQAR table; mixed budgets raise ``SettingsMismatch``)
- ``throughput_figure``, ``loss_curves`` (figures), ``PAPER`` (published numbers)
"""
from eval.tables.figures import loss_curves, throughput_figure
from eval.tables.model import Cell, SettingsMismatch, Table, build_table
from eval.tables.mqar import MQARFile, build_mqar_table, find_mqar, read_mqar
from eval.tables.paper import BETA_EFF_MEANS, MU_INTERVENTION, PAPER, paper_protocol_gap
from eval.tables.render import as_json, csv_text, latex, markdown, write_table
from eval.tables.runs import Experiment, Run, find_runs, preset_identity
from eval.tables.specs import TABLES
from eval.tables.yours import RunsTable, build_runs_table, write_runs_table

__all__ = [
    "find_runs", "Run", "Experiment", "preset_identity", "TABLES", "build_table", "Table", "Cell",
    "SettingsMismatch", "markdown", "latex", "csv_text", "as_json", "write_table", "throughput_figure",
    "loss_curves", "PAPER", "BETA_EFF_MEANS", "MU_INTERVENTION", "MQARFile", "build_mqar_table", "find_mqar",
    "read_mqar", "paper_protocol_gap", "RunsTable", "build_runs_table", "write_runs_table",
]
