"""The stop request that SIGTERM/SIGINT turn into a clean save-and-exit (design §7): training, regeneration and
their servers' jobs check it at a boundary and stop there. Several processes agree on the stop with
`distributed.StopVote`."""

from __future__ import annotations

import logging
import signal
from typing import Any

log = logging.getLogger(__name__)


class StopRequest:
    """While active, SIGTERM (preemption) and SIGINT (Ctrl-C) only set `requested`; the train loop checks it
    at each step boundary, saves a checkpoint and returns. A second SIGINT interrupts as usual."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        for signum in self.SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested == "SIGINT" and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = name
        log.warning("%s received: saving a checkpoint and stopping after the current step", name)
