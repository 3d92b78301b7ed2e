"""The progress bar rank 0 shows on a terminal: step, loss, samples/s, ETA."""

from __future__ import annotations

import sys
from typing import Any

from scaletrain.tracking.reporter import NullReporter, StepReport

__all__ = ["ProgressBar", "progress_wanted"]


def progress_wanted() -> bool:
    return sys.stderr.isatty()


class ProgressBar(NullReporter):
    def __init__(self, description: str):
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[speed]} samples/s"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            transient=False,
        )
        self._description = description
        self._task_id: Any = None  # rich's TaskID once started

    def on_start(self, total_steps: int | None, start_step: int) -> None:
        self._task_id = self._progress.add_task(
            self._description, total=total_steps, completed=start_step, loss="-", speed="-"
        )
        self._progress.start()

    def on_step(self, step: int) -> None:
        self._progress.update(self._task_id, completed=step)

    def on_train_metrics(self, reports: list[StepReport]) -> None:
        metrics = reports[-1].metrics  # any runner's: loss and speed only when it reports them
        loss, speed = metrics.get("loss"), metrics.get("samples_per_s")
        self._progress.update(
            self._task_id,
            loss=f"{loss:.4f}" if loss is not None else "-",
            speed=f"{speed:,.0f}" if speed is not None else "-",
        )

    def on_end(self) -> None:
        self._progress.stop()
