"""``-m gpu`` runs import only the test modules that hold GPU tests (tests/conftest.py)."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from conftest import pytest_ignore_collect, timeout_s
from forkserver import command_env, commands

ROOT = Path(__file__).resolve().parents[1]


def config(markexpr: str) -> SimpleNamespace:
    return SimpleNamespace(getoption=lambda name, default=None: markexpr if name == "markexpr" else default)


def test_a_gpu_run_skips_modules_without_gpu_tests(tmp_path: Path) -> None:
    cpu = tmp_path / "test_cpu_only.py"
    cpu.write_text("import not_installed_anywhere\n\ndef test_x():\n    pass\n")
    gpu = tmp_path / "test_has_gpu.py"
    gpu.write_text("import pytest\n\n@pytest.mark.gpu\ndef test_y():\n    pass\n")
    helper = tmp_path / "kdn_inputs.py"
    helper.write_text("X = 1\n")
    assert pytest_ignore_collect(cpu, config("gpu")) is True
    assert pytest_ignore_collect(gpu, config("gpu")) is False
    assert pytest_ignore_collect(helper, config("gpu")) is None
    for expr in ("", "not gpu", "gpu and not slow"):  # any other selection collects as usual
        assert pytest_ignore_collect(cpu, config(expr)) is None


def test_the_gpu_selection_of_this_suite_collects_without_errors() -> None:
    """Every GPU test of the suite is collected under ``-m gpu``, and no module fails to import."""
    proc = commands().run(["-m", "pytest", "-q", "--collect-only", "-m", "gpu", "-p", "no:cacheprovider", "tests"],
                          command_env(), ROOT, timeout_s(120))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "error" not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]
    assert "tests/test_kdn_precision_gpu.py::" in proc.stdout
    assert "tests/test_numbers_eval.py" not in proc.stdout
