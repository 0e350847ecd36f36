import os

import pytest
import torch

_config: list[pytest.Config] = []


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("KDN_INSTAFAIL"):
        _config.append(config)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With ``KDN_INSTAFAIL=1`` (bench/gpu.sh sets it), a failure's report is printed at once, so that a GPU run
    stopped by its time limit still says why the tests before the limit failed."""
    if report.failed and _config:
        terminal = _config[0].pluginmanager.get_plugin("terminalreporter")
        terminal.write_line(f"\nFAILED {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
