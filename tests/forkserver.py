"""Python scripts in forks of one process that has imported the heavy stack once.

Each interpreter check used to start ``python -c SCRIPT``, and every start imported torch, Triton, numpy and fla
again: about 6 s of the 2-core machine's time, eighteen times per suite. :class:`ForkServer` imports them once, in a
process started with the environment the scripts need; each :meth:`ForkServer.run` forks it, and the fork runs the
script as ``python -c`` would (``sys.argv``, ``__main__``, the caller's environment and working directory, stdout and
stderr to files), so each script still starts from a process of its own that no earlier script has touched.

The server imports nothing of this repository: the code under test is imported by each script, after the fork, as
in a fresh process. Nothing in the server runs a torch operator before forking, so no intra-op thread pool exists
to be copied half-alive into the forks.
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

_SERVER = r"""
import importlib, json, os, sys, traceback
for name in sys.argv[1].split(","):
    importlib.import_module(name)
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            for fd, path in ((0, os.devnull), (1, job["stdout"]), (2, job["stderr"])):
                os.dup2(os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC if fd else os.O_RDONLY), fd)
            os.environ.clear()
            os.environ.update(job["env"])
            os.chdir(job["cwd"])
            sys.argv = ["-c", *job["args"]]
            exec(compile(job["script"], "<string>", "exec"), {"__name__": "__main__"})
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
            if not isinstance(e.code, int) and e.code is not None:
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    print(json.dumps({"pid": pid}), flush=True)
    print(json.dumps({"rc": os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}), flush=True)
"""


class ForkServer:
    """A ``python`` process with ``env`` that imported ``modules``; :meth:`run` runs a script in a fork of it.

    Args:
        modules: imported once by the server, before any fork (third-party only: see the module docstring).
        env: the server's environment (the variables read at import time, e.g. ``TRITON_INTERPRET``).
        cwd: the server's working directory.
    """

    def __init__(self, modules: tuple[str, ...], env: dict[str, str], cwd: Path) -> None:
        self._proc = subprocess.Popen([sys.executable, "-c", _SERVER, ",".join(modules)], cwd=cwd, env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._lock = threading.Lock()
        self._tmp = tempfile.TemporaryDirectory(prefix="kdn-forkserver-")
        self._reply(None)

    def _reply(self, timeout: float | None) -> dict:
        """The server's next JSON line; ``TimeoutError`` after ``timeout`` seconds, ``RuntimeError`` if it died."""
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork server exited (code {self._proc.wait()}): see the test's stderr")
        return json.loads(line)

    def run(self, script: str, args: tuple[str, ...], env: dict[str, str], cwd: Path,
            timeout: float) -> subprocess.CompletedProcess:
        """Run ``script`` as ``python -c script *args`` would, in a fork, with ``env`` and ``cwd``.

        Returns:
            A ``CompletedProcess`` with the script's exit code, stdout and stderr.

        Raises:
            subprocess.TimeoutExpired: after ``timeout`` seconds (the fork is killed).
        """
        with self._lock:
            out, err = (Path(self._tmp.name) / n for n in ("stdout", "stderr"))
            job = {"script": script, "args": list(args), "env": env, "cwd": str(cwd), "stdout": str(out),
                   "stderr": str(err)}
            self._proc.stdin.write(json.dumps(job) + "\n")
            self._proc.stdin.flush()
            pid = self._reply(None)["pid"]
            try:
                rc = self._reply(timeout)["rc"]
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
                self._reply(None)
                raise subprocess.TimeoutExpired(["python", "-c", "..."], timeout) from None
            return subprocess.CompletedProcess(["python", "-c", "..."], rc, out.read_text(), err.read_text())

    def close(self) -> None:
        """Stop the server (its stdin closes; it exits after the running fork, if any)."""
        self._proc.stdin.close()
        self._proc.wait()
        self._tmp.cleanup()
