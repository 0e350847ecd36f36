"""The suite's fork server (``tests/forkserver.py``) runs a script as ``python -c`` would, each in a fork of its own."""
from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from forkserver import ForkServer


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    s = ForkServer(("json",), dict(os.environ), Path.cwd())
    yield s
    s.close()


SCRIPT = r"""
import json, os, sys
print("noise")
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "probe": os.environ.get("KDN_PROBE"), "pid": os.getpid(),
                  "seen": "earlier" in globals()}))
earlier = 1
"""


def test_each_script_gets_its_arguments_environment_and_working_directory_in_a_fork_of_its_own(
        server: ForkServer, tmp_path: Path) -> None:
    import json

    runs = [server.run(SCRIPT, ("a", str(i)), {**os.environ, "KDN_PROBE": f"v{i}"}, tmp_path, 60) for i in (1, 2)]
    outs = [json.loads(r.stdout.splitlines()[-1]) for r in runs]
    assert [r.returncode for r in runs] == [0, 0] and runs[0].stdout.startswith("noise\n")
    assert [o["argv"] for o in outs] == [["-c", "a", "1"], ["-c", "a", "2"]]
    assert [o["probe"] for o in outs] == ["v1", "v2"] and {o["cwd"] for o in outs} == {str(tmp_path)}
    assert outs[0]["pid"] != outs[1]["pid"] != os.getpid() and not any(o["seen"] for o in outs)


@pytest.mark.parametrize("script,code,message", [("raise ValueError('bad input')", 1, "ValueError: bad input"),
                                                 ("import sys; sys.exit(3)", 3, ""),
                                                 ("import sys; sys.exit('refused')", 1, "refused")])
def test_a_failing_script_gives_its_exit_code_and_stderr(server: ForkServer, script: str, code: int,
                                                         message: str) -> None:
    proc = server.run(script, (), dict(os.environ), Path.cwd(), 60)
    assert proc.returncode == code and message in proc.stderr
    assert server.run("print(1)", (), dict(os.environ), Path.cwd(), 60).stdout == "1\n"  # the server lives on


def test_a_script_past_its_limit_is_killed_and_the_server_serves_the_next(server: ForkServer) -> None:
    with pytest.raises(subprocess.TimeoutExpired):
        server.run("import time; time.sleep(600)", (), dict(os.environ), Path.cwd(), 0.5)
    assert server.run("print(2)", (), dict(os.environ), Path.cwd(), 60).stdout == "2\n"
