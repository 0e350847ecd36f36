"""Preemption: a signal sets a flag; the loop saves at the next step boundary and exits for a requeue.

SLURM sends ``SIGUSR1`` before the time limit (``#SBATCH --signal=USR1@180``) and ``SIGTERM`` on
preemption. After the checkpoint, ``handoff`` calls the handler that was installed before ours
(submitit's requeue handler under the Hydra submitit launcher) and then exits with
``REQUEUE_EXIT_CODE``, which ``slurm/train.sbatch`` turns into ``scontrol requeue``. Before that,
``exit_on_signals`` covers the start-up: a signal during the imports exits with the same code.
"""
from __future__ import annotations

import os
import signal
from collections.abc import Sequence
from types import FrameType, TracebackType
from typing import Any, NoReturn

REQUEUE_EXIT_CODE = 75  # EX_TEMPFAIL: "try again later"


def parse_signal(name: str) -> signal.Signals:
    """``"SIGUSR1"`` or ``"USR1"`` -> ``signal.SIGUSR1``; a clear ``ValueError`` otherwise."""
    key = name.upper() if name.upper().startswith("SIG") else "SIG" + name.upper()
    try:
        return signal.Signals[key]
    except KeyError:
        raise ValueError(f"unknown signal {name!r}; use names such as SIGUSR1, SIGUSR2, SIGTERM") from None


class Preemption:
    """Context manager installing flag-setting handlers for ``signals``; restores the old ones on exit."""

    def __init__(self, signals: Sequence[str]) -> None:
        self.signals = [parse_signal(s) for s in signals]
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def __enter__(self) -> Preemption:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(signum)

    @property
    def requested(self) -> bool:
        """Whether a preemption signal arrived since entering."""
        return self.received is not None

    def handoff(self) -> NoReturn:
        """Call the pre-existing handler of the received signal (if it is a Python callable), then exit
        with ``REQUEUE_EXIT_CODE``. Call only after the checkpoint is on disk."""
        if self.received is None:
            raise RuntimeError("handoff() called without a preemption signal")
        previous = self._previous.get(self.received)
        if callable(previous):
            previous(int(self.received), None)
        raise SystemExit(REQUEUE_EXIT_CODE)


def exit_on_signals(signals: Sequence[str] = ("SIGUSR1", "SIGUSR2", "SIGTERM")) -> None:
    """Make each of ``signals`` exit at once with ``REQUEUE_EXIT_CODE`` until a ``Preemption`` takes over (and
    again after it restores them). For a launcher script's start-up, before its heavy imports: there is nothing
    to save yet, and a requeue resumes from the run directory.

    The handler ends the process with ``os._exit`` rather than raising ``SystemExit``: a signal lands wherever the
    interpreter is, often inside a third-party import, whose half-initialised modules and ``except`` clauses can
    turn a raised exit into an ``AttributeError`` or ``RecursionError`` and exit code 1, which is not requeued."""
    def _exit(signum: int, frame: FrameType | None) -> NoReturn:
        os.write(2, f"{signal.Signals(signum).name} during start-up: exiting {REQUEUE_EXIT_CODE} for a "
                    "requeue\n".encode())
        os._exit(REQUEUE_EXIT_CODE)

    for name in signals:
        signal.signal(parse_signal(name), _exit)
