"""The stop request that SIGTERM/SIGINT turn into a clean save-and-exit (design §7, §7.3): training, regeneration
and their servers' jobs check it at a boundary and stop there. Several processes agree on the stop with
`distributed.StopVote`. A stop with a grace budget (training's checkpoint save) ends the process when the
budget runs out: a scheduler's kill would come soon after, and a line naming the last complete checkpoint then
tells where the rerun resumes."""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from typing import Any

from dflash_jax.runtime.storage import Deadline

log = logging.getLogger(__name__)

# A stop whose grace budget ran out before its work (the checkpoint save) finished: rerun to resume from the last
# complete checkpoint, which the one error line names. The code after EX_TEMPFAIL (75, a stop that finished its
# save); sysexits' own meaning of 76 (EX_PROTOCOL) does not apply.
EXIT_STOP_GRACE_EXPIRED = 76


class StopRequest:
    """While active, SIGTERM (preemption) and SIGINT (Ctrl-C) only set `requested`; the train loop checks it
    at each step boundary, saves a checkpoint and returns. A second SIGINT interrupts as usual.

    grace_seconds: from the first signal (or from `start_grace`, for a stop another process received), the rest
    of the stop has that long until this block exits; else the process ends with one line, the stop's and then
    `resume_point()`'s words, and exit code EXIT_STOP_GRACE_EXPIRED. The watchdog starts in the signal handler
    itself, so that work between the signal and the next boundary (a step, a metrics upload, an evaluation)
    counts too. None: no budget (a job whose stop is a boundary away)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, grace_seconds: float | None = None, resume_point: Callable[[], str] = str):
        self.requested: str | None = None
        self._previous: dict[int, Any] = {}
        self._grace_seconds, self._resume_point = grace_seconds, resume_point
        self._grace: int | None = None  # the watchdog's entry while the budget runs

    def __enter__(self) -> StopRequest:
        for signum in self.SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        if self._grace is not None:
            Deadline.end(self._grace)
            self._grace = None

    def start_grace(self) -> None:
        """Starts the grace budget now unless it runs already (a signal here started it at the signal)."""
        if self._grace_seconds is None or self._grace is not None:
            return
        cause, seconds = self.requested or "a stop on another process", self._grace_seconds
        started = time.strftime("%H:%M:%S")
        self._grace = Deadline.start(seconds, lambda: (
            f"stop grace expired: the stop by {cause} at {started} did not finish within {seconds:g} s "
            f"(config.stop_grace_seconds); {self._resume_point()} (exit code {EXIT_STOP_GRACE_EXPIRED})"),
            EXIT_STOP_GRACE_EXPIRED)

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested == "SIGINT" and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = name
        log.warning("%s received: saving a checkpoint and stopping after the current step", name)
        self.start_grace()
