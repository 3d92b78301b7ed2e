"""Where the loop's numbers go. The loop calls a Reporter; rank 0 fans out to the sinks.

Training metrics arrive in batches: the loop keeps each step's values on the device and
reports every pending step about 4 times a second, so a sink writes a batch with one call
(one write, one flush) instead of one per step. The loop's batch is a ReportWindow: the metric
names once and a column of values per metric, as the journal packs them; a step's dict is built
only for a sink that keeps that step (logging every step cost the training thread ~7 us a
step in dicts nobody read).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol, cast, overload

__all__ = ["Reporter", "StepReport", "ReportWindow", "NullReporter", "Reporters", "MetricsFile", "LogReporter",
           "split_metrics", "steps_of", "kept_indices"]


@dataclass(frozen=True)
class StepReport:
    step: int
    metrics: dict[str, float]
    wall_time: float  # time.time() when the step ended


class ReportWindow(Sequence[StepReport]):
    """Steps reported together, oldest first, as columns: ``names`` once, ``columns[k]`` the
    values of ``names[k]`` at every step (as the loop computes them and the journal packs
    them). Indexing gives a StepReport (built then)."""

    __slots__ = ("steps", "names", "columns", "wall_times")

    def __init__(self, steps: list[int], names: list[str], columns: list[list[float]], wall_times: list[float]):
        self.steps, self.names, self.columns, self.wall_times = steps, names, columns, wall_times

    def __len__(self) -> int:
        return len(self.steps)

    @overload
    def __getitem__(self, index: int) -> StepReport: ...

    @overload
    def __getitem__(self, index: slice) -> list[StepReport]: ...

    def __getitem__(self, index: int | slice) -> StepReport | list[StepReport]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return StepReport(self.steps[index], {name: column[index] for name, column in zip(self.names, self.columns)},
                          self.wall_times[index])

    def column(self, name: str) -> list[float | None]:
        """One metric's value at every step (None everywhere when the window lacks it)."""
        if name not in self.names:
            return [None] * len(self.steps)
        return cast("list[float | None]", self.columns[self.names.index(name)])


def steps_of(reports: Sequence[StepReport]) -> list[int]:
    """The steps of a batch of reports (a window's without building its reports)."""
    return reports.steps if isinstance(reports, ReportWindow) else [r.step for r in reports]


class Reporter(Protocol):
    def on_start(self, total_steps: int | None, start_step: int) -> None: ...

    def on_step(self, step: int) -> None: ...

    def on_train_metrics(self, reports: Sequence[StepReport]) -> None:
        """Steps reported together, oldest first (the loop's: a ReportWindow)."""

    def on_eval_metrics(self, step: int, metrics: dict[str, float]) -> None: ...

    def on_end(self) -> None: ...


class NullReporter:
    """For ranks other than 0: they compute metrics (collectives need them) but report nothing."""

    def on_start(self, total_steps: int | None, start_step: int) -> None:
        pass

    def on_step(self, step: int) -> None:
        pass

    def on_train_metrics(self, reports: Sequence[StepReport]) -> None:
        pass

    def on_eval_metrics(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def on_end(self) -> None:
        pass


class Reporters(NullReporter):
    def __init__(self, *sinks: Reporter):
        self.sinks = sinks

    def on_start(self, total_steps: int | None, start_step: int) -> None:
        for sink in self.sinks:
            sink.on_start(total_steps, start_step)

    def on_step(self, step: int) -> None:
        for sink in self.sinks:
            sink.on_step(step)

    def on_train_metrics(self, reports: Sequence[StepReport]) -> None:
        for sink in self.sinks:
            sink.on_train_metrics(reports)

    def on_eval_metrics(self, step: int, metrics: dict[str, float]) -> None:
        for sink in self.sinks:
            sink.on_eval_metrics(step, metrics)

    def on_end(self) -> None:
        for sink in self.sinks:
            sink.on_end()


class MetricsFile(NullReporter):
    """``metrics.jsonl`` in the run directory: train metrics every ``every`` steps (the console
    cadence; MLflow may take more), eval metrics always; flushed as written."""

    def __init__(self, path: str | Path, every: int = 1):
        self.path = Path(path)
        self.every = every
        self.total_steps: int | None = 0
        self._file: IO[str] | None = None
        self._written: dict[str, int] = {}

    def on_start(self, total_steps: int | None, start_step: int) -> None:
        self.total_steps = total_steps
        self._written = _last_rows(self.path)
        self._file = open(self.path, "a", encoding="utf-8")
        if _ends_torn(self.path):  # a crash cut the last row short: ours start on a fresh line
            self._file.write("\n")

    def _write(self, split: str, rows: list[tuple[int, dict[str, float]]]) -> None:
        if self._file is None:
            return
        # Steps redone after a restart from a checkpoint are already here (and identical).
        done = self._written.get(split, 0)
        lines = [
            json.dumps({"split": split, "step": step, **metrics}) + "\n"
            for step, metrics in rows
            if step > done
        ]
        if lines:
            self._file.write("".join(lines))
            self._file.flush()

    def on_train_metrics(self, reports: Sequence[StepReport]) -> None:
        kept = kept_indices(reports, self.every, self.total_steps)
        self._write("train", [(reports[i].step, reports[i].metrics) for i in kept])

    def on_eval_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self._write("eval", [(step, metrics)])

    def on_end(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class LogReporter(NullReporter):
    """Metrics as structured log records (they reach the JSON worker log)."""

    def __init__(self, logger: logging.Logger, every: int = 1):
        self.logger = logger
        self.every = every
        self.total_steps: int | None = 0

    def on_start(self, total_steps: int | None, start_step: int) -> None:
        self.total_steps = total_steps

    def on_train_metrics(self, reports: Sequence[StepReport]) -> None:
        for i in kept_indices(reports, self.every, self.total_steps):
            report = reports[i]
            self.logger.info("train metrics", extra={"step": report.step, "metrics": report.metrics})

    def on_eval_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.logger.info("eval metrics", extra={"step": step, "metrics": metrics})


def kept_indices(reports: Sequence[StepReport], every: int, last: int | None) -> list[int]:
    """Which of a batch's steps a sink keeping every ``every`` steps keeps (and the first and
    the last step)."""
    return [i for i, step in enumerate(steps_of(reports)) if step % every == 0 or step in (1, last)]


def _ends_torn(path: Path) -> bool:
    try:
        with open(path, "rb") as handle:
            handle.seek(0, 2)
            if handle.tell() == 0:
                return False
            handle.seek(-1, 2)
            return handle.read(1) != b"\n"
    except OSError:
        return False


def _last_rows(path: Path) -> dict[str, int]:
    """The last step per split in an existing metrics file (a torn last line is skipped)."""
    last: dict[str, int] = {}
    if not path.exists():
        return last
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
            last[row["split"]] = max(last.get(row["split"], 0), int(row["step"]))
        except (ValueError, KeyError, TypeError):
            continue
    return last


def split_metrics(metrics: dict[str, Any]) -> tuple[dict[str, float], dict[str, float]]:
    """A user's report as (train, eval) values: names starting ``eval/`` are evaluation metrics,
    the rest training ones (a ``train/`` prefix dropped); tensors read with ``.item()``."""
    train: dict[str, float] = {}
    evaluation: dict[str, float] = {}
    for key, value in metrics.items():
        name, number = str(key), float(value.item() if hasattr(value, "item") else value)
        if name.startswith("eval/"):
            evaluation[name.removeprefix("eval/")] = number
        else:
            train[name.removeprefix("train/")] = number
    return train, evaluation
