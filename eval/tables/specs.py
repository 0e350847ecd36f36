"""The paper's Tables 1-5 (docs/protocol.md §9): their columns, groups and rows.

A row names the experiment presets (``conf/experiment/<preset>.yaml``) whose runs fill it; a column names the
results suite and key it reads. Table 3 puts the recurrent and hybrid models of one mixer side by side: its columns
carry a backbone pattern and a row's preset of that pattern fills them.
"""
from __future__ import annotations

from dataclasses import dataclass

RULER_CELLS = tuple(f"{task}@{n}" for task, lengths in (
    ("niah_single_1", (1024, 2048, 4096, 8192)), ("niah_single_2", (1024, 2048, 4096, 8192)),
    ("niah_single_3", (1024, 2048, 4096)), ("niah_multikey_1", (1024, 2048, 4096))) for n in lengths)
RETRIEVAL_TASKS = ("swde", "fda", "squad", "triviaqa", "nq", "drop")
LM_ACCURACIES = ("lambada_openai", "piqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge")
MEAN = "mean"  # the key of a suite's equal-weight mean over its own columns


@dataclass(frozen=True)
class Column:
    """``key`` names the value in ``suite``'s results (see :func:`eval.tables.model.value_of`); ``pattern``, when
    set, picks the row's preset of that backbone pattern."""

    key: str
    header: str
    suite: str
    lower_is_better: bool = False
    pattern: str | None = None

    @property
    def metric(self) -> str:
        return self.key.split("/")[0]


@dataclass(frozen=True)
class RowSpec:
    """A model row: its label and the presets that train it (one per backbone pattern in Table 3)."""

    label: str
    presets: tuple[str, ...]

    @property
    def key(self) -> str:
        return self.presets[0]


@dataclass(frozen=True)
class GroupSpec:
    """Rows compared with each other (bold best per column); ``reference``: the key of the row paired
    differences are taken against."""

    label: str
    rows: tuple[RowSpec, ...]
    reference: str | None = None


@dataclass(frozen=True)
class TableSpec:
    id: str
    title: str
    columns: tuple[Column, ...]
    groups: tuple[GroupSpec, ...]
    note: str = ""


LM_COLUMNS = (
    Column("wiki_ppl", "Wiki. ppl", "lm", lower_is_better=True),
    Column("lmb_ppl", "LMB. ppl", "lm", lower_is_better=True),
    Column("lambada_openai", "LMB. acc", "lm"), Column("piqa", "PIQA acc", "lm"),
    Column("hellaswag", "Hella. acc_n", "lm"), Column("winogrande", "Wino. acc", "lm"),
    Column("arc_easy", "ARC-e acc", "lm"), Column("arc_challenge", "ARC-c acc_n", "lm"),
    Column("avg", "Avg.", "lm"),
)
RULER_HEADERS = {"niah_single_1": "S1", "niah_single_2": "S2", "niah_single_3": "S3", "niah_multikey_1": "MK1"}
RULER_COLUMNS = tuple(
    Column(c, f"{RULER_HEADERS[c.split('@')[0]]} {int(c.split('@')[1]) // 1024}K", "ruler") for c in RULER_CELLS
) + (Column(MEAN, "Mean", "ruler"),)
RETRIEVAL_HEADERS = {"swde": "SWDE", "fda": "FDA", "squad": "SQuAD", "triviaqa": "TQA", "nq": "NQ", "drop": "DROP",
                     MEAN: "Mean"}
RETRIEVAL_COLUMNS = tuple(
    Column(f"{t}/{p}", f"{RETRIEVAL_HEADERS[t]} {tag}", "retrieval", pattern=p)
    for t in (*RETRIEVAL_TASKS, MEAN) for p, tag in (("recurrent", "(rec.)"), ("hybrid_swa", "(+SWA)"))
)


def _rows(scale: str, names: tuple[tuple[str, str], ...]) -> tuple[RowSpec, ...]:
    return tuple(RowSpec(label, (preset.format(s=scale),)) for label, preset in names)


_KDN = (("Isotropic KDN", "table1_{s}_kdn_iso"), ("Diagonal KDN", "table1_{s}_kdn_diag"))
_T1_PURE = (("KDA", "table1_{s}_kda"), ("Mamba-3 MIMO", "table1_{s}_mamba3_mimo"), *_KDN)
_HYBRID = (("KDA + SWA", "hybrid_1.3b_kda"), ("Isotropic KDN + SWA", "hybrid_1.3b_kdn_iso"),
           ("Diagonal KDN + SWA", "hybrid_1.3b_kdn_diag"))
_T2_750 = (("DeltaNet", "table2_{s}_deltanet"), ("Gated DeltaNet", "table2_{s}_gdn"), ("KDA", "table1_{s}_kda"),
           ("Mamba-3 SISO", "table2_{s}_mamba3_siso"), ("Mamba-3 MIMO", "table1_{s}_mamba3_mimo"),
           ("GDN-2", "table2_{s}_gdn2"), *_KDN)
_T2_13 = tuple(r for r in _T2_750 if r[0] not in ("DeltaNet", "Gated DeltaNet"))
_T3_MIXERS = (("KDA", "kda", "table1"), ("Mamba-3 SISO", "mamba3_siso", "table2"),
              ("Mamba-3 MIMO", "mamba3_mimo", "table1"), ("GDN-2", "gdn2", "table2"),
              ("Isotropic KDN", "kdn_iso", "table1"), ("Diagonal KDN", "kdn_diag", "table1"))

TABLES: dict[str, TableSpec] = {t.id: t for t in (
    TableSpec("table1", "Table 1: language modelling and zero-shot commonsense reasoning", LM_COLUMNS, (
        GroupSpec("750M / 50B tokens, pure recurrent", _rows("750m", _T1_PURE), "table1_750m_kda"),
        GroupSpec("1.3B / 100B tokens, pure recurrent", _rows("1.3b", _T1_PURE), "table1_1.3b_kda"),
        GroupSpec("1.3B / 100B tokens, hybrid (2K SWA)", _rows("1.3b", _HYBRID), "hybrid_1.3b_kda"),
        GroupSpec("1.3B / 100B tokens, attention", (RowSpec("Transformer (2K SWA)",
                                                             ("table1_1.3b_transformer_swa",)),)),
    ), "Perplexity lower is better; accuracies in %; Avg. is the six-accuracy mean."),
    TableSpec("table2", "Table 2: modified RULER needle-in-a-haystack (accuracy %)", RULER_COLUMNS, (
        GroupSpec("750M / 50B tokens, pure recurrent", _rows("750m", _T2_750), "table1_750m_kda"),
        GroupSpec("1.3B / 100B tokens, pure recurrent", _rows("1.3b", _T2_13), "table1_1.3b_kda"),
        GroupSpec("1.3B / 100B tokens, hybrid (2K SWA)", tuple(
            RowSpec(f"{label} + SWA", (f"hybrid_1.3b_{mixer}",)) for label, mixer, _ in _T3_MIXERS),
            "hybrid_1.3b_kda"),
    ), "Mean: equal-weight mean of the 14 cells (the paper prints none; its rows' means are recomputed from "
       "its cells)."),
    TableSpec("table3", "Table 3: real-world retrieval, cloze format, inputs truncated to 2K tokens (accuracy %)",
              RETRIEVAL_COLUMNS, (
                  GroupSpec("1.3B / 100B tokens", tuple(
                      RowSpec(label, (f"{table}_1.3b_{mixer}", f"hybrid_1.3b_{mixer}"))
                      for label, mixer, table in _T3_MIXERS), "table1_1.3b_kda"),
              ), "rec.: pure recurrent; +SWA: hybrid with 2K sliding-window attention."),
    TableSpec("table4", "Table 4: information scale mu (750M / 50B tokens, Diagonal KDN)", LM_COLUMNS, (
        GroupSpec("Diagonal KDN", tuple(RowSpec(label, (f"table4_mu_{m}",)) for label, m in (
            ("mu = 1", "1"), ("mu = sqrt(d_k)", "sqrt"), ("mu = d_k", "dk"), ("mu = 4 d_k", "4dk"),
            ("mu learned (init d_k)", "learned"))), "table4_mu_dk"),
    )),
    TableSpec("table5", "Table 5: noise ablation at mu = 1 (750M / 50B tokens, Diagonal KDN)", LM_COLUMNS, (
        GroupSpec("Diagonal KDN, mu = 1", (
            RowSpec("learned r, omega", ("table5_learned",)), RowSpec("fixed r = 1", ("table5_fixed_r",)),
            RowSpec("fixed r = omega = 1", ("table5_fixed_r_omega",))), "table5_learned"),
    )),
)}
