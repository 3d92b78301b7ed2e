"""In rank 0: the reporter for MLflow, which only appends to the metric journal.

Sending happens elsewhere (the tracking process, tracker_process.py), so the training
process never imports mlflow for metrics, never waits for the tracker, and shares neither its
interpreter lock nor its start-up with a sender thread.
"""

from __future__ import annotations

import time
from pathlib import Path

from scaletrain.tracking.journal import MetricJournal
from scaletrain.tracking.reporter import NullReporter, StepReport

__all__ = ["JournalReporter"]


class JournalReporter(NullReporter):
    def __init__(self, journal_dir: str | Path, every: int):
        self.journal = MetricJournal(journal_dir)
        self.every = every
        self.total_steps: int | None = 0
        self.recorded: dict[str, int] = {}

    def on_start(self, total_steps: int | None, start_step: int) -> None:
        self.total_steps = total_steps
        self.recorded = self.journal.last_steps()

    def _record(self, prefix: str, reports: list[StepReport]) -> None:
        done = self.recorded.get(prefix, 0)  # steps redone after a restart are journaled already
        reports = [r for r in reports if r.step > done]
        if not reports:
            return
        names = list(reports[0].metrics)
        if len(reports) > 1 and all(list(r.metrics) == names for r in reports):
            # A window of steps that name the same metrics: one line (the common case).
            self.journal.append_window(
                [r.step for r in reports], [int(r.wall_time * 1000) for r in reports],
                [f"{prefix}/{name}" for name in names],
                [[float(v) for v in r.metrics.values()] for r in reports],
            )
            return
        self.journal.append([
            (r.step, int(r.wall_time * 1000), {f"{prefix}/{k}": float(v) for k, v in r.metrics.items()})
            for r in reports
        ])

    def on_train_metrics(self, reports: list[StepReport]) -> None:
        every, last = self.every, self.total_steps
        self._record("train", [r for r in reports if r.step % every == 0 or r.step in (1, last)])

    def on_eval_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self._record("eval", [StepReport(step, metrics, time.time())])

    def on_end(self) -> None:
        self.journal.close()
