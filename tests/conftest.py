import gc
import os
import random
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

TIMEOUT_FACTOR_ENV = "KDN_TEST_TIMEOUT_FACTOR"
TIMEOUT_FACTOR_DEFAULT = 4.0
_config: list[pytest.Config] = []


def timeout_factor() -> float:
    """The suite's one scale of every subprocess time limit: ``KDN_TEST_TIMEOUT_FACTOR`` (default 4). The limits
    only guard against a hang, so a loaded machine (raise the factor) gives a slow pass, never a failure."""
    raw = os.environ.get(TIMEOUT_FACTOR_ENV, "")
    try:
        factor = float(raw) if raw else TIMEOUT_FACTOR_DEFAULT
    except ValueError:
        factor = float("nan")
    if not factor > 0 or factor == float("inf"):
        raise ValueError(f"{TIMEOUT_FACTOR_ENV}={raw!r} is not a positive number; set it to e.g. 4 (the scale of every "
                         "test's subprocess time limit) or unset it")
    return factor


def timeout_s(seconds: float) -> float:
    """A subprocess's time limit in seconds: ``seconds`` (what an idle 2-core machine needs, with room) times
    :func:`timeout_factor`."""
    return seconds * timeout_factor()


def free_port(low: int = 20000, high: int = 40000) -> int:
    """A TCP port in ``[low, high)`` that nothing on this machine listens on now, drawn at random: tests that start
    a rendezvous take one each, so two copies of the suite at once do not meet on a fixed port."""
    for port in random.sample(range(low, high), 200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port in [{low}, {high}) after 200 tries: free some ports or widen the range")


def pytest_configure(config: pytest.Config) -> None:
    try:  # a bad factor stops the run at once, not at the first subprocess
        timeout_factor()
    except ValueError as err:
        raise pytest.UsageError(str(err)) from None
    if os.environ.get("KDN_INSTAFAIL"):
        _config.append(config)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With ``KDN_INSTAFAIL=1`` (bench/gpu.sh sets it), a failure's report is printed at once, so that a GPU run
    stopped by its time limit still says why the tests before the limit failed."""
    if report.failed and _config:
        terminal = _config[0].pluginmanager.get_plugin("terminalreporter")
        terminal.write_line(f"\nFAILED {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """A run of the GPU tests alone (``-m gpu``, as ``bench/gpu.sh kernels`` runs them) does not import the test
    modules that hold none (no ``mark.gpu`` in their text): their imports (the evaluation stack: ``datasets``,
    ``lm_eval``) need not be installed on a GPU machine for tests that would be deselected anyway."""
    if (config.getoption("markexpr", "").strip() == "gpu" and collection_path.suffix == ".py"
            and collection_path.name.startswith("test_")):
        return "mark.gpu" not in collection_path.read_text(encoding="utf-8")
    return None


# The files that take longest on the 2-core machine (docs/testing.md, "Where the time goes"), longest first. Handed to
# the xdist workers first (scripts/test.sh passes --no-loadscope-reorder, which keeps this order), so that the short
# files fill the end and neither worker idles while the other finishes a long one. Order only: no test is skipped.
LONGEST_FIRST = ("test_slurm.py", "test_bench_tools.py", "test_kdn_triton_interpret.py", "test_train_loop.py",
                 "test_mqar.py", "test_kdn_varlen_interpret.py", "test_kdn_fla_interpret.py", "test_slurm_unknown.py",
                 "test_kdn_precision_interpret.py", "test_models.py", "test_config.py", "test_run_identity.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its own order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def shards(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """``train.py`` overrides pointing at a 30k-token slice of the embedded corpus, prepared by the first run that
    uses them and shared by every later one in this process (no test writes to the shards)."""
    out = tmp_path_factory.mktemp("shards") / "embedded"
    return [f"data.prepare.out_dir={out}", "data.prepare.max_tokens=30000", "data.prepare.num_workers=1"]


@pytest.fixture(autouse=True)
def _release_cuda_memory(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a GPU test, the CUDA blocks its tensors left in torch's caching allocator go back to the device: the GPU
    suite runs in several processes at once (pytest-xdist), and blocks cached by one are memory the others lack."""
    yield
    if "gpu" in request.keywords and torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
