"""Read an iterator ahead on a thread of this process, so the training loop finds its next batch
waiting: the receiving end of torch's worker processes (unpickling a batch, mapping its shared
memory: about a millisecond a batch measured on 2 CPU cores, idle) and a stream's reading.

Only what involves no random numbers of this process runs on the thread: a DataLoader's workers
draw theirs in their own processes, and the training thread reseeds its own before each step.
Order is kept (one reader); an exception is raised where the loop asks for the batch it replaced.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["ThreadPrefetch"]

_END = object()


class _Raised:
    def __init__(self, error: BaseException):
        self.error = error


class ThreadPrefetch:
    """``depth`` items of ``source`` read ahead on a daemon thread."""

    def __init__(self, source: Iterator[Any], depth: int, name: str = "scaletrain-prefetch"):
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._read, args=(source,), name=name, daemon=True)
        self._thread.start()

    def __iter__(self) -> ThreadPrefetch:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        item = self._queue.get()
        if item is _END:
            self._done = True
            raise StopIteration
        if isinstance(item, _Raised):
            self._done = True
            raise item.error
        return item

    def qsize(self) -> int:
        return self._queue.qsize()

    def close(self) -> None:
        """Stop reading (the thread ends once its current item is read) and drop what was read."""
        self._stop.set()
        self._done = True
        try:
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            pass

    def _read(self, source: Iterator[Any]) -> None:
        try:
            for item in source:
                if not self._put(item):
                    return
            self._put(_END)
        except BaseException as exc:  # raised in the loop, where it waits for this item
            self._put(_Raised(exc))

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False
