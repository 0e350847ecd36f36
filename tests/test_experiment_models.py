"""Every ``conf/experiment/*`` preset composes to the model and run recorded in ``tests/data/experiment_models.json``
(``python tests/experiment_models.py`` rewrites it): the same fields, parameters, shapes and mixers as built, and a
run config that a run directory recorded from it resumes without differences."""
from __future__ import annotations

import json

import pytest
from experiment_models import EXPERIMENTS, FIXTURE, record

from trainer.rundir import differences

EXPECTED = json.loads(FIXTURE.read_text())


def test_the_fixture_covers_every_preset() -> None:
    assert sorted(EXPECTED) == EXPERIMENTS


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_preset_builds_the_recorded_model(name: str) -> None:
    got, want = record(name), EXPECTED[name]
    for key in ("model", "parameters", "shapes_sha256", "mixers", "layers"):
        assert got[key] == want[key], f"{name}: {key}"
    for section in ("data", "optim", "trainer"):
        assert got["run_config"][section] == want["run_config"][section], f"{name}: {section}"
    assert differences(want["run_config"], got["run_config"]) == {}, name
