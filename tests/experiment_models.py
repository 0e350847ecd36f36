"""The model and run config every ``conf/experiment/*`` preset composes to, as a JSON-able record.

``python tests/experiment_models.py`` rewrites ``tests/data/experiment_models.json``; ``test_config`` compares each
preset against it, so a change of how configs are declared is shown to give the same models, and runs recorded before it
resume as the same experiments.
"""
from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
FIXTURE = ROOT / "tests" / "data" / "experiment_models.json"
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
VOCAB = 32_000  # the paper's vocabulary; the presets' tokenizer is not downloaded by a test
MODEL_KEYS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim", "mixer", "pattern",
              "intermediate_size", "norm_eps", "initializer_range", "tie_word_embeddings", "conv_size", "rope_theta",
              "fuse_cross_entropy", "use_cache", "fused", "recompute_states", "attention_backend", "init",
              "pad_token_id", "bos_token_id", "eos_token_id")
"""The ``KDNConfig`` fields compared as they are; the mixer's options and the window are compared as the layers
receive them (``mixers``), so where a default is declared does not matter, only what is built."""


def _layer(module: Any) -> str:
    """A mixer as built: its class and the settings it keeps (window, KDN's options)."""
    keep = ("window", "rope_theta", "backend", "mu_choice", "noise", "precision", "memory", "chunk_size",
            "recompute_states", "fused", "output_gate", "num_heads", "head_dim", "state_size",
            "is_mimo", "mimo_rank", "n_groups", "intermediate_size")
    attrs = {k: getattr(module, k) for k in keep if hasattr(module, k)}
    front = getattr(module, "front", None)
    if front is not None and hasattr(front, "alpha_param"):
        attrs["alpha_param"] = front.alpha_param
    return f"{type(module).__name__}({', '.join(f'{k}={v!r}' for k, v in sorted(attrs.items()))})"


def record(name: str) -> dict[str, Any]:
    """The preset ``name``'s model (fields, parameter count, parameter shapes, mixers as built) and its run's
    validated config as a run directory records it."""
    from models import parameter_counts
    from models.sizes import build_on_meta
    from trainer.config import build_model_config, load_config

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = load_config(compose("config", overrides=[f"experiment={name}"]))
    model_cfg = build_model_config(cfg, VOCAB)
    model = build_on_meta(model_cfg)
    shapes = json.dumps([(n, list(p.shape)) for n, p in model.named_parameters()])
    dumped = model_cfg.to_dict()
    layers = [_layer(block.mixer) for block in model.model.layers]
    kinds = sorted(set(layers))
    return {
        "model": {k: dumped[k] for k in MODEL_KEYS},
        "parameters": list(parameter_counts(model_cfg)),
        "shapes_sha256": hashlib.sha256(shapes.encode()).hexdigest(),
        "mixers": kinds,
        "layers": "".join(str(kinds.index(x)) for x in layers),  # each layer's entry of "mixers"
        "run_config": asdict(cfg),  # what a run directory's fingerprint.json records
    }


def main() -> None:
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    out = {name: record(name) for name in EXPERIMENTS}
    tmp = FIXTURE.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    tmp.replace(FIXTURE)
    print(f"{FIXTURE}: {len(out)} presets", file=sys.stderr)


if __name__ == "__main__":
    main()
