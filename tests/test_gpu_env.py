"""bench/gpu_env.sh's ``gpu_prepare`` on fake layouts: carried wheels alone, site archives alone, both, neither, and a
machine a parent script prepared already. ``python3`` is a stub on PATH that records its calls (pip installs and
archive extractions) instead of running them."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from conftest import timeout_s

ROOT = Path(__file__).resolve().parents[1]


def prepare(tmp: Path, wheels: int, sites: int, **env: str) -> tuple[str, list[str]]:
    """Run ``gpu_prepare`` in ``tmp`` holding ``wheels`` dummy wheels in ``.whl/`` and ``sites`` archives in
    ``.site/``; returns ``(its PYTHONPATH, the stub's calls)``."""
    for i in range(wheels):
        (tmp / ".whl").mkdir(exist_ok=True)
        (tmp / ".whl" / f"pkg{i}-0.1-py3-none-any.whl").write_bytes(b"PK\x05\x06" + bytes(18))
    for i in range(sites):
        (tmp / ".site").mkdir(exist_ok=True)
        (tmp / ".site" / f"site{i}.tar.xz").write_bytes(b"\xfd7zXZ\x00")
    stub = tmp / "bin"
    stub.mkdir()
    (stub / "python3").write_text(f'#!/bin/bash\necho "$*" >> {tmp}/python3.log\n')
    (stub / "python3").chmod(0o755)
    script = f'. {ROOT}/bench/gpu_env.sh && gpu_prepare && echo "PYTHONPATH=${{PYTHONPATH:-}}"'
    proc = subprocess.run(["bash", "-c", script], cwd=tmp, capture_output=True, text=True, timeout=timeout_s(60),
                          env={**os.environ, "PATH": f"{stub}:{os.environ['PATH']}", "PYTHONPATH": "",
                               "TRITON_CACHE_DIR": str(tmp / "triton"), "TILELANG_CACHE_DIR": str(tmp / "tl"), **env})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = tmp / "python3.log"
    return proc.stdout.strip().splitlines()[-1].removeprefix("PYTHONPATH="), (
        log.read_text().splitlines() if log.is_file() else [])


def test_wheels_alone_are_installed_and_put_on_the_path(tmp_path: Path) -> None:
    path, calls = prepare(tmp_path, wheels=2, sites=0)
    assert path == f"/tmp/site:{tmp_path}"
    assert calls == ["-m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "
                     ".whl/pkg0-0.1-py3-none-any.whl .whl/pkg1-0.1-py3-none-any.whl"]


def test_site_archives_alone_are_unpacked(tmp_path: Path) -> None:
    path, calls = prepare(tmp_path, wheels=0, sites=1)
    assert path == f"/tmp/site:{tmp_path}"
    assert len(calls) == 1 and "tarfile" in calls[0] and calls[0].endswith(".site/site0.tar.xz")


def test_wheels_and_archives_are_both_used(tmp_path: Path) -> None:
    path, calls = prepare(tmp_path, wheels=1, sites=1)
    assert path == f"/tmp/site:{tmp_path}"
    assert [c.split()[:2] for c in calls] == [["-m", "pip"], ["-c", "import"]]


@pytest.mark.parametrize(("wheels", "env", "want"), [(0, {}, ""), (1, {"GPU_PREPARED": "1"}, "/tmp/site:")])
def test_nothing_carried_or_already_prepared_installs_nothing(tmp_path: Path, wheels: int, env: dict[str, str],
                                                              want: str) -> None:
    path, calls = prepare(tmp_path, wheels=wheels, sites=0, **env)
    assert calls == [] and path == (f"{want}{tmp_path}" if want else "")
