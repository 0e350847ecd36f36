"""Evaluation: lm-eval, RULER, cloze retrieval, throughput, overwrite diagnostics."""
