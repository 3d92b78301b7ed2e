"""In the tracking process (tracker_process.py): tail the metric journal and hand new points
to the batch sender (batch_sender.py), which sends them to MLflow.

It starts from the journal's cursor, so points an earlier attempt could not deliver go first.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from scaletrain.tracking.batch_sender import MetricSender
from scaletrain.tracking.journal import MetricJournal

__all__ = ["JournalShipper"]


class JournalShipper:
    def __init__(
        self,
        client: Any,
        run_id: str,
        journal_dir: str | Path,
        logger: logging.Logger,
        poll_s: float = 1.0,
    ):
        self.journal = MetricJournal(journal_dir)
        self.sender = MetricSender(lambda: client, run_id, self.journal, logger)
        self._poll = poll_s
        self._offset = 0
        self._cursor = self.journal.sent_cursor()
        self._stop = threading.Event()
        self._tail = threading.Thread(target=self._run, name="scaletrain-journal", daemon=True)

    def start(self) -> JournalShipper:
        self.sender.start()
        self._tail.start()
        return self

    def _read_new(self) -> None:
        points, self._offset = self.journal.read_from(self._offset)
        fresh = [p for p in points if p.seq > self._cursor]
        if fresh:
            self._cursor = fresh[-1].seq
            self.sender.submit(fresh)

    def _run(self) -> None:
        while not self._stop.wait(self._poll):
            self._read_new()

    def close(self, timeout_s: float) -> int:
        """Read what the workers wrote last, deliver within ``timeout_s``; return points left."""
        self._stop.set()
        self._tail.join()
        self._read_new()
        return self.sender.close(timeout_s)

