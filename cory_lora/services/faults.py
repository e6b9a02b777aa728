"""Fault injection for the crash-and-resume tests: die by SIGKILL at a named point.

`CORY_LORA_KILL_AT=update:7` kills the process the 7th time it passes the point `update` (after
an optimizer step); the points are `generation` (after a micro-batch of sampling), `update`
(after an optimizer step) and `checkpoint` (inside a checkpoint write: weights written, not yet
renamed into place). Under torchrun, `update:7@1` kills rank 1 alone. Unset, as always outside
the tests, this does nothing.
"""

from __future__ import annotations

import os
import signal
from collections import Counter

_TARGET, _, _RANK = os.environ.get("CORY_LORA_KILL_AT", "").partition("@")
_passes: Counter[str] = Counter()


def maybe_die(point: str) -> None:
    if not _TARGET or (_RANK and os.environ.get("RANK", "0") != _RANK):
        return
    _passes[point] += 1
    if f"{point}:{_passes[point]}" == _TARGET:
        os.kill(os.getpid(), signal.SIGKILL)
