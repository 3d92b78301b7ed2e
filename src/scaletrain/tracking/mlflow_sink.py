"""Rank 0's MLflow reporter: it only appends to the metric journal.

Sending happens elsewhere (tracking/shipper.py, in the launcher process), so the training
process never imports mlflow for metrics, never waits for the tracker, and shares neither its
interpreter lock nor its start-up with a sender thread.
"""

from __future__ import annotations

import time
from pathlib import Path

from scaletrain.tracking.journal import MetricJournal
from scaletrain.tracking.reporter import NullReporter

__all__ = ["MlflowReporter"]


class MlflowReporter(NullReporter):
    def __init__(self, journal_dir: str | Path, every: int):
        self.journal = MetricJournal(journal_dir)
        self.every = every
        self.total_steps = 0
        self.recorded: dict[str, int] = {}

    def on_start(self, total_steps: int, start_step: int) -> None:
        self.total_steps = total_steps
        self.recorded = self.journal.last_steps()

    def _record(self, prefix: str, step: int, metrics: dict[str, float]) -> None:
        if step <= self.recorded.get(prefix, 0):  # redone after a restart: already journaled
            return
        self.journal.append(
            {f"{prefix}/{k}": v for k, v in metrics.items()}, step, int(time.time() * 1000)
        )

    def on_train_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if step % self.every == 0 or step == self.total_steps or step == 1:
            self._record("train", step, metrics)

    def on_eval_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self._record("eval", step, metrics)

    def on_end(self) -> None:
        self.journal.close()
