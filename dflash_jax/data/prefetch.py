"""Batches built in a background thread while the devices run the steps before them."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from dflash_jax.data.loader import BatchLoader

_PUT_POLL_SECONDS = 0.1


class Prefetcher(Iterator[tuple[dict[str, np.ndarray], dict[str, Any]]]):
    """Yields (batch, loader position after it) of `loader`, built up to `depth` batches ahead by one thread.

    The position travels with its batch, so a checkpoint saved after a step records the position after the
    batch that step consumed, not after the ones waiting in the queue. An error the loader raises (a bad
    record) is raised by the `next` that would have returned its batch. `close` stops the thread and then
    closes the loader.
    """

    def __init__(self, loader: BatchLoader, depth: int = 2):
        self._loader = loader
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._closing = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._fill, name="batch-prefetch", daemon=True)
        self._thread.start()

    def __next__(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        if self._error is None:
            item = self._queue.get()
            if not isinstance(item, BaseException):
                return item
            self._error = item
        raise self._error

    def close(self) -> None:
        self._closing.set()
        self._thread.join()
        self._loader.close()

    def _fill(self) -> None:
        try:
            while not self._closing.is_set():
                batch = next(self._loader)
                if not self._put((batch, self._loader.state())):
                    return
        except BaseException as error:  # handed to the consumer, which raises it
            self._put(error)

    def _put(self, item: Any) -> bool:
        """Waits for room in the queue; False when the consumer closed it first."""
        while not self._closing.is_set():
            try:
                self._queue.put(item, timeout=_PUT_POLL_SECONDS)
                return True
            except queue.Full:
                continue
        return False
