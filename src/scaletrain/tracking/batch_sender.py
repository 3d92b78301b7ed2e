"""In the tracking process (tracker_process.py): a background thread that sends the points
journal_tail.py hands it to MLflow, in batches.

Training never waits for the tracker: the workers only append to the journal; this thread
sends at most one request every ``interval_s`` (or per 1000 points).
A failed batch is retried with backoff (the same batch, so order and the cursor stay
simple); the first failure logs one warning and the recovery one line, never one per step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from scaletrain.observe.telemetry import current as telemetry
from scaletrain.tracking.journal import MetricJournal, MetricPoint

__all__ = ["MetricSender", "MAX_METRICS_PER_BATCH"]

MAX_METRICS_PER_BATCH = 1000  # MLflow's log_batch limit (and 1 MB a request: ~100 B a point)


class MetricSender:
    def __init__(
        self,
        client_factory: Callable[[], Any],
        run_id: str,
        journal: MetricJournal,
        logger: logging.Logger,
        max_backoff_s: float = 10.0,
        interval_s: float = 2.0,
    ):
        self._client_factory = client_factory
        self._run_id = run_id
        self._journal = journal
        self._log = logger
        self._max_backoff = max_backoff_s
        self._interval = interval_s
        self._queue: deque[MetricPoint] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self._give_up_at = float("inf")
        self._failing_since: float | None = None
        self.delivered = 0
        self._thread = threading.Thread(target=self._run, name="scaletrain-metrics", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, points: list[MetricPoint]) -> None:
        with self._cond:
            self._queue.extend(points)
            backlog = len(self._queue)
            self._cond.notify()
        telemetry().set("metrics_backlog_points", backlog)
        telemetry().flush()

    def close(self, timeout_s: float) -> int:
        """Deliver what is queued within ``timeout_s``; return how many points are left
        (they stay in the journal, for a later attempt)."""
        with self._cond:
            self._give_up_at = time.monotonic() + timeout_s
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout_s + 5)
        with self._cond:
            return len(self._queue)

    def _run(self) -> None:
        client = None
        backoff = 0.5
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                # Gather for a while: one request a few seconds costs the training loop
                # nothing, one a step costs it dearly (the sender shares the rank's cores).
                gather_until = time.monotonic() + self._interval
                while (
                    not self._closing
                    and len(self._queue) < MAX_METRICS_PER_BATCH
                    and time.monotonic() < gather_until
                ):
                    self._cond.wait(gather_until - time.monotonic())
                if not self._queue:
                    return
                count = min(MAX_METRICS_PER_BATCH, len(self._queue))
                batch = [self._queue[i] for i in range(count)]
            try:
                if client is None:
                    client = self._client_factory()
                _log_batch(client, self._run_id, batch)
            except Exception as exc:  # network, server down, 5xx: keep the points, retry
                telemetry().work("delivery", 1, errors=1)
                telemetry().flush()
                self._on_failure(exc)
                with self._cond:
                    if self._closing and time.monotonic() >= self._give_up_at:
                        return
                    self._cond.wait(backoff)
                backoff = min(self._max_backoff, backoff * 2)
                continue
            backoff = 0.5
            with self._cond:
                for _ in batch:
                    self._queue.popleft()
                backlog = len(self._queue)
            self._journal.mark_sent(batch[-1].seq)
            self.delivered += len(batch)
            figures = telemetry()
            figures.work("delivery", 1)
            figures.set("metrics_backlog_points", backlog)
            figures.set("metric_delivery_lag_seconds", max(0.0, time.time() - batch[0].timestamp_ms / 1000))
            figures.flush()
            if self._failing_since is not None:
                self._log.warning(
                    "tracking server reachable again after %.0f s; sending the metrics kept meanwhile",
                    time.monotonic() - self._failing_since,
                )
                self._failing_since = None

    def _on_failure(self, exc: Exception) -> None:
        if self._failing_since is None:
            self._failing_since = time.monotonic()
            self._log.warning(
                "cannot reach the tracking server (%s: %s); training goes on, metrics are kept "
                "in %s and sent when it is back",
                type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "", self._journal.path,
            )


def _log_batch(client: Any, run_id: str, batch: list[MetricPoint]) -> None:
    from mlflow.entities import Metric

    client.log_batch(
        run_id,
        metrics=[Metric(p.key, p.value, p.timestamp_ms, p.step) for p in batch],
        synchronous=True,
    )

