"""The progress bar rank 0 shows on a terminal: step, loss, samples/s, ETA, and the built-in
alerts firing now (the launcher's file; read at each report, when it changed)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from scaletrain.tracking.reporter import NullReporter, StepReport

__all__ = ["ProgressBar", "progress_wanted"]


def progress_wanted() -> bool:
    return sys.stderr.isatty()


class ProgressBar(NullReporter):
    def __init__(self, description: str, alerts_file: str | Path | None = None):
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
            TextColumn("{task.fields[alert]}"),
            console=Console(stderr=True),
            transient=False,
        )
        self._description = description
        self._task_id: Any = None  # rich's TaskID once started
        self._alerts_file = Path(alerts_file) if alerts_file is not None else None
        self._alerts_seen: int | None = None  # the file's mtime (ns) when last read

    def on_start(self, total_steps: int | None, start_step: int) -> None:
        self._task_id = self._progress.add_task(
            self._description, total=total_steps, completed=start_step, loss="-", speed="-", alert=""
        )
        self._progress.start()

    def on_step(self, step: int) -> None:
        self._progress.update(self._task_id, completed=step)

    def on_train_metrics(self, reports: Sequence[StepReport]) -> None:
        metrics = reports[-1].metrics  # any runner's: loss and speed only when it reports them
        loss, speed = metrics.get("loss"), metrics.get("samples_per_s")
        self._progress.update(
            self._task_id,
            loss=f"{loss:.4f}" if loss is not None else "-",
            speed=f"{speed:,.0f}" if speed is not None else "-",
        )
        alert = self._alert_text()
        if alert is not None:
            self._progress.update(self._task_id, alert=alert)

    def _alert_text(self) -> str | None:
        """The alerts firing, as the bar says them; None when the file did not change."""
        if self._alerts_file is None:
            return None
        try:
            changed = os.stat(self._alerts_file).st_mtime_ns
        except OSError:
            changed = None
        if changed == self._alerts_seen:
            return None
        self._alerts_seen = changed
        try:
            names = self._alerts_file.read_text(encoding="utf-8").split() if changed is not None else []
        except OSError:
            return None
        return f"[bold red]alert: {', '.join(names)}[/]" if names else ""

    def on_end(self) -> None:
        self._progress.stop()
