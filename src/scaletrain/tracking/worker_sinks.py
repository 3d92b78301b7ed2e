"""The reporter a worker hands its runner: rank 0 fans each report out to every sink the job
asks for; every rank keeps its log context's step current."""

from __future__ import annotations

import logging
import os
from typing import Any

from scaletrain.config.schema import JobConfig
from scaletrain.observe.alerts import ALERTS_FIRING_FILE
from scaletrain.observe.telemetry import StepMark, Telemetry, TelemetrySink, read_step_mark
from scaletrain.rundir import METRICS_FILE, TRACKING_DIR, RunSpec
from scaletrain.tracking.journal_sink import JournalReporter
from scaletrain.tracking.logs import LOGGER_NAME, LogContext
from scaletrain.tracking.progress import ProgressBar, progress_wanted
from scaletrain.tracking.reporter import LogReporter, MetricsFile, NullReporter, Reporters

__all__ = ["worker_reporter"]


class _StepTracker(NullReporter):
    """Keeps the log context's step current on every rank, and its step mark (what the root
    cause of a hang or a crash says the rank finished last)."""

    def __init__(self, context: LogContext, mark: StepMark | None):
        self.context = context
        self.mark = mark

    def on_step(self, step: int) -> None:
        self.context.step = step
        if self.mark is not None:
            self.mark.set(step)

    def on_end(self) -> None:
        if self.mark is not None:
            self.mark.close()
            self.mark = None


def worker_reporter(spec: RunSpec, job: JobConfig, context: LogContext, is_main: bool,
                    console: Any = None, telemetry: Telemetry | None = None, world_size: int = 1) -> Reporters:
    """``console``: an engine's relay to the user's console (Ray), a sink for rank 0.

    Every rank keeps its share of the live figures (``telemetry``: step times, samples, its last
    step). Rank 0 writes metrics.jsonl and JSON log records for every log_every-th step, draws the progress
    bar on a terminal, and journals for MLflow (written even while the tracker is unreachable)."""
    reached = read_step_mark(spec.worker_step(context.rank)) if context.rank is not None else None
    mark = StepMark(spec.worker_step(context.rank)) if context.rank is not None else None
    sinks: list[Any] = [_StepTracker(context, mark)]
    if telemetry is not None and telemetry.path is not None:
        sinks.append(TelemetrySink(telemetry, world_size, is_main, context.request_id, reached))
    if not is_main:
        return Reporters(*sinks)
    if console is not None:
        sinks.append(console)
    # A loop or a script reports when it chooses: all of it is kept (the console keeps its cadence).
    kept_every = 1 if job.task is None else job.train.log_every
    sinks += [
        MetricsFile(os.path.join(spec.out_dir, METRICS_FILE), every=kept_every),
        LogReporter(logging.getLogger(f"{LOGGER_NAME}.metrics"), every=job.train.log_every),
    ]
    if progress_wanted():
        sinks.append(ProgressBar(job.name, spec.telemetry_dir / ALERTS_FIRING_FILE))
    if job.tracking.enabled:
        sinks.append(
            JournalReporter(
                os.path.join(spec.out_dir, TRACKING_DIR),
                every=job.tracking.log_every_steps or kept_every,
            )
        )
    return Reporters(*sinks)
