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
    s = ForkServer(("json",), {**os.environ, "KDN_SERVER_ONLY": "1"}, Path.cwd())
    yield s
    s.close()


SCRIPT = r"""
import json, os, signal, sys
print("noise")
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "probe": os.environ.get("KDN_PROBE"), "pid": os.getpid(),
                  "server_only": os.environ.get("KDN_SERVER_ONLY"),
                  "seen": "earlier" in globals(), "sigchld": signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL}))
earlier = 1
"""


def test_each_script_gets_its_arguments_environment_and_working_directory_in_a_fork_of_its_own(
        server: ForkServer, tmp_path: Path) -> None:
    import json

    runs = [server.run(["-c", SCRIPT, "a", str(i)], {**os.environ, "KDN_PROBE": f"v{i}"}, tmp_path, 60)
            for i in (1, 2)]
    outs = [json.loads(r.stdout.splitlines()[-1]) for r in runs]
    assert [r.returncode for r in runs] == [0, 0] and runs[0].stdout.startswith("noise\n")
    assert [o["argv"] for o in outs] == [["-c", "a", "1"], ["-c", "a", "2"]]
    assert [o["probe"] for o in outs] == ["v1", "v2"] and {o["cwd"] for o in outs} == {str(tmp_path)}
    assert [o["server_only"] for o in outs] == [None, None]  # the caller's environment, not the server's
    assert outs[0]["pid"] != outs[1]["pid"] != os.getpid() and not any(o["seen"] for o in outs)
    assert all(o["sigchld"] for o in outs)  # the server's own SIGCHLD handler is not inherited


@pytest.mark.parametrize("script,code,message", [("raise ValueError('bad input')", 1, "ValueError: bad input"),
                                                 ("import sys; sys.exit(3)", 3, ""),
                                                 ("import sys; sys.exit('refused')", 1, "refused")])
def test_a_failing_script_gives_its_exit_code_and_stderr(server: ForkServer, script: str, code: int,
                                                         message: str) -> None:
    proc = server.run(["-c", script], dict(os.environ), Path.cwd(), 60)
    assert proc.returncode == code and message in proc.stderr
    assert server.run(["-c", "print(1)"], dict(os.environ), Path.cwd(), 60).stdout == "1\n"  # the server lives on


def test_a_script_past_its_limit_is_killed_and_the_server_serves_the_next(server: ForkServer,
                                                                          tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    script = f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(600)"
    with pytest.raises(subprocess.TimeoutExpired):
        server.run(["-c", script], dict(os.environ), Path.cwd(), 0.5)
    if pid_file.exists():  # it started before its limit: it is gone now
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid_file.read_text()), 0)
    assert server.run(["-c", "print(2)"], dict(os.environ), Path.cwd(), 60).stdout == "2\n"


def test_modules_and_script_paths_run_as_main_with_their_argv_path_and_exit_handlers(server: ForkServer,
                                                                                     tmp_path: Path) -> None:
    import json

    body = ("import atexit, json, sys\nprint(json.dumps({'argv': sys.argv, 'path0': sys.path[0], 'name': __name__}))\n"
            "atexit.register(lambda: print('bye'))\n")
    (tmp_path / "probe_mod.py").write_text(body)
    script = tmp_path / "sub" / "probe_script.py"
    script.parent.mkdir()
    script.write_text(body)
    env = dict(os.environ)
    mod = server.run(["-m", "probe_mod", "x=1"], env, tmp_path, 60)
    path = server.run([str(script), "y=2"], env, tmp_path, 60)
    for proc, argv, path0 in ((mod, [str(tmp_path / "probe_mod.py"), "x=1"], ""), (path, [str(script), "y=2"],
                                                                                     str(script.parent))):
        out = proc.stdout.splitlines()
        assert proc.returncode == 0 and out[-1] == "bye", proc.stderr
        assert json.loads(out[0]) == {"argv": argv, "path0": path0, "name": "__main__"}


def test_jobs_run_side_by_side_and_take_signals(server: ForkServer, tmp_path: Path) -> None:
    """The first job waits for a file that only the second writes: they must run at once."""
    import signal

    flag = tmp_path / "flag"
    waiter = server.start(["-c", f"import os, time\nwhile not os.path.exists({str(flag)!r}): time.sleep(0.01)\n"
                                 "print('seen')"], dict(os.environ), tmp_path)
    writer = server.start(["-c", f"open({str(flag)!r}, 'w').close()"], dict(os.environ), tmp_path)
    assert writer.wait(60) == 0 and waiter.communicate(60) == ("seen\n", "")
    sleeper = server.start(["-c", "import signal; signal.pause()"], dict(os.environ), tmp_path)
    assert sleeper.poll() is None
    sleeper.send_signal(signal.SIGTERM)
    assert sleeper.wait(60) == -signal.SIGTERM


def test_a_job_with_another_pythonpath_is_refused(server: ForkServer) -> None:
    with pytest.raises(ValueError, match="PYTHONPATH="):
        server.start(["-c", "pass"], {**os.environ, "PYTHONPATH": "/elsewhere"}, Path.cwd())


def test_a_merged_job_writes_its_stderr_into_its_stdout(server: ForkServer) -> None:
    job = server.start(["-c", "import sys; print('out', flush=True); print('err', file=sys.stderr)"],
                       dict(os.environ), Path.cwd(), merge_stderr=True)
    assert job.communicate(60) == ("out\nerr\n", "")
