"""Python scripts and commands in forks of one process that has imported the heavy stack once.

A check that starts ``python -c SCRIPT`` (an interpreter check) or ``python train.py ...`` (a command refusing bad
input) spends most of its time importing torch, Triton, fla, transformers and hydra again: 5-7 s of the 2-core
machine's time per start. :class:`ForkServer` imports them once, in a process started with the environment the jobs
need; :meth:`ForkServer.start` forks it, and the fork runs the job as ``python`` would (``sys.argv``, ``sys.path[0]``,
``__main__``, the caller's environment and working directory, stdout and stderr to files, the exit handlers at the
end), so each job still runs in a process of its own that no earlier job has touched. Jobs may run side by side.

The server imports nothing of this repository: the code under test is imported by each job, after the fork, as in a
fresh process. Nothing in the server runs a torch operator before forking, so no intra-op thread pool exists to be
copied half-alive into the forks. ``sys.path`` comes from the server's ``PYTHONPATH``, so a job must name the same.
"""
from __future__ import annotations

import atexit
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

_SERVER = r"""
import atexit, importlib, json, os, runpy, select, signal, sys, threading
for name in sys.argv[1].split(","):
    importlib.import_module(name)
wake_r, wake_w = os.pipe()
os.set_blocking(wake_w, False)
signal.set_wakeup_fd(wake_w)
signal.signal(signal.SIGCHLD, lambda *_: None)
status = {}  # pid -> the file its exit code goes to


def reap():
    while status:
        pid, st = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        path = status.pop(pid)
        with open(path + ".tmp", "w") as f:
            f.write(str(os.waitstatus_to_exitcode(st)))
        os.replace(path + ".tmp", path)


def run(job):
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.close(wake_r)
    os.close(wake_w)
    for fd, path in ((0, os.devnull), (1, job["stdout"]), (2, job["stderr"])):
        os.dup2(os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC if fd else os.O_RDONLY), fd)
    if job["merge"]:  # stderr into stdout, as subprocess's stderr=STDOUT
        os.dup2(1, 2)
    os.environ.clear()
    os.environ.update(job["env"])
    os.chdir(job["cwd"])
    kind, target, args = job["kind"], job["target"], job["args"]
    if kind == "c":
        sys.argv = ["-c", *args]
        exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})
    elif kind == "m":
        sys.argv = ["-m", *args]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [target, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")


print(json.dumps({"ready": True}), flush=True)
while True:
    ready = select.select([sys.stdin, wake_r], [], [])[0]
    if wake_r in ready:
        os.read(wake_r, 4096)
        reap()
    if sys.stdin not in ready:
        continue
    line = sys.stdin.readline()
    if not line:
        break
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            run(job)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
            if not isinstance(e.code, int) and e.code is not None:
                print(e.code, file=sys.stderr)
        except BaseException:
            sys.excepthook(*sys.exc_info())
        finally:
            threading._shutdown()
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    status[pid] = job["status"]
    print(json.dumps({"pid": pid}), flush=True)
    reap()
"""


class Forked:
    """A job of :class:`ForkServer`, with the parts of ``subprocess.Popen`` the tests use."""

    def __init__(self, pid: int, args: list[str], files: dict[str, Path]) -> None:
        self.pid, self.args, self._files, self.returncode = pid, args, files, None

    def poll(self) -> int | None:
        """The exit code (negative: the signal that ended it), or None while it runs."""
        if self.returncode is None and self._files["status"].is_file():
            self.returncode = int(self._files["status"].read_text())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Its exit code; ``subprocess.TimeoutExpired`` after ``timeout`` seconds (it keeps running)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """``(stdout, stderr)`` once it exits (``subprocess.TimeoutExpired`` after ``timeout`` seconds)."""
        self.wait(timeout)
        return self._files["stdout"].read_text(), self._files["stderr"].read_text()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """A ``python`` process with ``env`` that imported ``modules``; :meth:`start` runs a job in a fork of it.

    Args:
        modules: imported once by the server, before any fork (third-party only: see the module docstring).
        env: the server's environment (the variables read at import time, e.g. ``TRITON_INTERPRET``).
        cwd: the server's working directory.
    """

    def __init__(self, modules: tuple[str, ...], env: dict[str, str], cwd: Path) -> None:
        self._proc = subprocess.Popen([sys.executable, "-c", _SERVER, ",".join(modules)], cwd=cwd, env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._pythonpath = env.get("PYTHONPATH")
        self._lock = threading.Lock()
        self._tmp = tempfile.TemporaryDirectory(prefix="kdn-forkserver-")
        self._jobs = 0
        self._reply()

    def _reply(self) -> dict:
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork server exited (code {self._proc.wait()}): see the test's stderr")
        return json.loads(line)

    def start(self, args: list[str], env: dict[str, str], cwd: Path, merge_stderr: bool = False) -> Forked:
        """Start ``python *args`` in a fork: ``args`` begins with ``-c SCRIPT``, ``-m MODULE`` or a script's path;
        ``merge_stderr``: its stderr goes to its stdout (``subprocess``'s ``stderr=STDOUT``).

        Returns:
            The running job (:class:`Forked`).
        """
        if env.get("PYTHONPATH") != self._pythonpath:
            raise ValueError(f"PYTHONPATH={env.get('PYTHONPATH')!r}: this fork server's sys.path was made from "
                             f"PYTHONPATH={self._pythonpath!r}; start the job with that or use subprocess")
        if args[0] in ("-c", "-m"):
            kind, target, rest = args[0][1], args[1], args[2:]
        else:
            kind, target, rest = "path", args[0], args[1:]
        with self._lock:
            self._jobs += 1
            files = {n: Path(self._tmp.name) / f"{self._jobs}.{n}" for n in ("stdout", "stderr", "status")}
            job = {"kind": kind, "target": target, "args": rest, "env": env, "cwd": str(cwd), "merge": merge_stderr,
                   **{n: str(p) for n, p in files.items()}}
            self._proc.stdin.write(json.dumps(job) + "\n")
            self._proc.stdin.flush()
            return Forked(self._reply()["pid"], ["python", *args], files)

    def run(self, args: list[str], env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
        """:meth:`start`, then wait: a ``CompletedProcess`` with the exit code, stdout and stderr.

        Raises:
            subprocess.TimeoutExpired: after ``timeout`` seconds (the job is killed).
        """
        job = self.start(args, env, cwd)
        try:
            out, err = job.communicate(timeout)
        except subprocess.TimeoutExpired:
            job.kill()
            job.wait(timeout)
            raise
        return subprocess.CompletedProcess(job.args, job.returncode, out, err)

    def close(self) -> None:
        """Stop the server (its stdin closes; running jobs go on to their end)."""
        self._proc.stdin.close()
        self._proc.wait()
        self._tmp.cleanup()


ROOT = Path(__file__).resolve().parents[1]
# what the repository's commands import before their own code: torch (with the compiler stack that flex_attention
# brings), transformers and hydra
COMMAND_MODULES = ("numpy", "torch", "torch.nn.attention.flex_attention", "transformers", "omegaconf", "hydra")


@functools.cache
def shared(modules: tuple[str, ...], **extra_env: str) -> ForkServer:
    """This test process's one fork server that imported ``modules`` in :func:`command_env` ``(**extra_env)`` at the
    repository root, started on first use and stopped at exit."""
    server = ForkServer(modules, command_env(**extra_env), ROOT)
    atexit.register(server.close)
    return server


def commands() -> ForkServer:
    """The fork server for the repository's commands (``train.py``, ``python -m eval.mqar``, ...), with
    ``PYTHONPATH`` the repository root: jobs pass ``env`` with that ``PYTHONPATH`` (:func:`command_env`)."""
    return shared(COMMAND_MODULES)


def command_env(**extra: str) -> dict[str, str]:
    """This process's environment with ``PYTHONPATH`` the repository root, and ``extra``."""
    return {**os.environ, "PYTHONPATH": str(ROOT), **extra}
