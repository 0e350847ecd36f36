"""Evaluation of trained models (``python evaluate.py``, conf/eval/).

Modules: ``config`` (evaluate.py's typed schema), ``suites`` (lm, retrieval, ppl, beta_eff suites, their options
and the resumable cell runner), ``ruler_suite`` (Table 2's runner and its options), ``ruler`` (the RULER sample
generator and scorer), ``tasks`` (the cloze retrieval lm-eval tasks), ``harness`` (lm-eval over our model objects),
``generation`` (batched greedy decoding over the model cache), ``results`` (the results-file schema, shared by
concurrent evaluations), ``model_dir`` (run, export and checkpoint directories), ``perplexity``, ``overwrite`` (the
beta_eff probe).
"""
