"""Ctrl-C during training: the first press finishes the iteration and checkpoints; the second
stops at once. Every file is written atomically, so the last complete checkpoint is intact
whatever was being written at that moment."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

from cory_lora.errors import UserError
from cory_lora.run.checkpoint import stopped_message


class Interrupted(UserError):
    """The user pressed Ctrl-C; a checkpoint was written."""

    exit_code = 130


class GracefulStop:
    """First Ctrl-C: set `requested` (the loop checkpoints and raises Interrupted). The second:
    exit 130 at once.

    The second press does not unwind (an exception could land anywhere, even in interpreter
    shutdown): it exits the process there and then.
    """

    def __init__(self, display, run_dir: Path):
        self.display, self.run_dir, self.requested, self._previous = display, run_dir, False, None

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            self.display.restore_terminal()
            print("\n" + stopped_message(self.run_dir), file=sys.stderr, flush=True)
            os._exit(130)
        self.requested = True
        self.display.message(
            "Ctrl-C: finishing this iteration, then a checkpoint (Ctrl-C again to stop now)"
        )

    def __exit__(self, *exc) -> None:
        # After a first Ctrl-C the process is on its way out: keep the handler, so a second
        # press during shutdown still exits at once and quietly.
        if self._previous is not None and not self.requested:
            signal.signal(signal.SIGINT, self._previous)
