"""In rank 0: the reporter for MLflow, which only appends to the metric journal.

Sending happens elsewhere (the tracking process, tracker_process.py), so the training
process never imports mlflow for metrics, never waits for the tracker, and shares neither its
interpreter lock nor its start-up with a sender thread.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from scaletrain.tracking.journal import MetricJournal
from scaletrain.tracking.reporter import NullReporter, ReportWindow, StepReport, kept_indices, steps_of

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

    def _record(self, prefix: str, reports: Sequence[StepReport], indices: list[int]) -> None:
        done = self.recorded.get(prefix, 0)  # steps redone after a restart are journaled already
        steps = steps_of(reports)
        if indices and steps[indices[0]] <= done:  # (the steps ascend)
            indices = [i for i in indices if steps[i] > done]
        if not indices:
            return
        if isinstance(reports, ReportWindow) and len(indices) > 1:
            # The loop's window: its columns are the line's (the common case), no dict per step.
            walls, columns = reports.wall_times, reports.columns
            if len(indices) < len(steps):  # (all kept, tracking every step: as they are)
                steps, walls = [steps[i] for i in indices], [walls[i] for i in indices]
                columns = [[column[i] for i in indices] for column in columns]
            self.journal.append_window(steps, walls, [f"{prefix}/{name}" for name in reports.names], columns)
            return
        kept = [reports[i] for i in indices]
        names = list(kept[0].metrics)
        if len(kept) > 1 and all(list(r.metrics) == names for r in kept):
            # A batch of steps that name the same metrics (a loop's own reports): one line.
            self.journal.append_window(
                [r.step for r in kept], [r.wall_time for r in kept], [f"{prefix}/{name}" for name in names],
                [[float(r.metrics[name]) for r in kept] for name in names],
            )
            return
        self.journal.append([
            (r.step, int(r.wall_time * 1000), {f"{prefix}/{k}": float(v) for k, v in r.metrics.items()})
            for r in kept
        ])

    def on_train_metrics(self, reports: Sequence[StepReport]) -> None:
        self._record("train", reports, kept_indices(reports, self.every, self.total_steps))

    def on_eval_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self._record("eval", [StepReport(step, metrics, time.time())], [0])

    def on_end(self) -> None:
        self.journal.close()
