"""Ctrl-C, SIGTERM and SIGHUP during training: the first finishes the iteration and
checkpoints; a second stops at once. Every file is written atomically, so the last complete
checkpoint is intact whatever was being written at that moment.

Clusters, Docker and job schedulers stop work with SIGTERM, a closed terminal sends SIGHUP: both
are a Ctrl-C here. Outside the training loop (model loading, a study between runs) they unwind
as `Terminated`, a KeyboardInterrupt. The exit code is 128 + the signal (130, 143, 129).

A process started by another cory-lora process (a study's run, a launched rank) dies with it:
the parent names itself in CORY_LORA_PARENT_PID and the child asks the kernel for a SIGTERM when
that parent dies, however it dies (kill -9 included), so no child outlives its parent.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from pathlib import Path

from cory_lora.errors import UserError
from cory_lora.run.checkpoint import stopped_message

STOP_SIGNALS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP"}
STOP_EXIT_CODES = frozenset(128 + int(s) for s in STOP_SIGNALS)  # 130, 143, 129: handled


def stopped_by_signal(code: int) -> bool:
    """Whether a process's exit code says a stop signal ended it: handled (128 + the signal)
    or not (a Popen return code of minus the signal)."""
    return code in STOP_EXIT_CODES or -code in STOP_SIGNALS


PARENT_PID = "CORY_LORA_PARENT_PID"
PR_SET_PDEATHSIG = 1  # linux/prctl.h


class Interrupted(UserError):
    """Ctrl-C, SIGTERM or SIGHUP stopped training; a checkpoint was written."""

    def __init__(self, message: str, signum: int = signal.SIGINT):
        super().__init__(message)
        self.exit_code = 128 + int(signum)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP outside the training loop: unwinds as Ctrl-C does."""

    def __init__(self, signum: int):
        super().__init__(STOP_SIGNALS.get(signum, str(signum)))
        self.signum = signum


def exit_code(interrupt: KeyboardInterrupt) -> int:
    """130 for Ctrl-C, 128 + the signal for the others."""
    return 128 + int(getattr(interrupt, "signum", signal.SIGINT))


def stop_like_ctrl_c() -> None:
    """Make SIGTERM and SIGHUP raise Terminated in the main thread, and, in a process another
    cory-lora process started, have the kernel send SIGTERM when that parent dies."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _raise_terminated)
    parent = os.environ.get(PARENT_PID)
    if parent and sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if str(os.getppid()) != parent:  # the parent died before the request above
            raise Terminated(signal.SIGTERM)


def _raise_terminated(signum, frame) -> None:
    raise Terminated(signum)


def child_environment() -> dict[str, str]:
    """The environment for a cory-lora child process that must die with this one."""
    return {**os.environ, PARENT_PID: str(os.getpid()), "PYTHONUNBUFFERED": "1"}


class GracefulStop:
    """The first Ctrl-C, SIGTERM or SIGHUP: set `requested` to that signal (the loop checkpoints
    and raises Interrupted). The second: exit at once (128 + the signal).

    The second press does not unwind (an exception could land anywhere, even in interpreter
    shutdown): it exits the process there and then.
    """

    def __init__(self, display, run_dir: Path):
        self.display, self.run_dir, self.requested, self._previous = display, run_dir, 0, {}

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            self.display.restore_terminal()
            print("\n" + stopped_message(self.run_dir), file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.requested = signum
        self.display.message(
            f"{STOP_SIGNALS[signum]}: finishing this iteration, then a checkpoint "
            "(Ctrl-C again to stop now)"
        )

    def __exit__(self, *exc) -> None:
        # After a first signal the process is on its way out: keep the handlers, so a second
        # one during shutdown still exits at once and quietly.
        if not self.requested:
            for signum, previous in self._previous.items():
                signal.signal(signum, previous)
