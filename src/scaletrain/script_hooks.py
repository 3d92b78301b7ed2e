"""``scaletrain.report()`` and ``scaletrain.should_stop()`` for a script run by ``scaletrain
launch``: the job's metrics (metrics.jsonl, the one MLflow run) and an agreed stop. Anywhere
else (plain torchrun, python) both are no-ops, so a script that calls them still runs there.

Both count as progress for the hang check (they touch this rank's heartbeat file, at most twice
a second). The first ``should_stop()`` takes over SIGTERM and SIGUSR1 from the default (ending
the process) and is a collective from then on: every rank calls it after every step.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from scaletrain.rundir.names import HEARTBEAT_ENV, SCRIPT_SPEC_ENV

__all__ = ["report", "should_stop"]

_session: Any = None
_BEAT_EVERY_S = 0.5


class _Session:
    def __init__(self, spec_file: str):
        from scaletrain.config.schema import JobConfig
        from scaletrain.rundir import RunSpec
        from scaletrain.tracking.logs import LOGGER_NAME, LogContext
        from scaletrain.tracking.worker_sinks import worker_reporter

        spec = RunSpec.read(spec_file)
        job = JobConfig.model_validate(spec.job)
        self.rank = int(os.environ.get("RANK", "0"))
        self.heartbeat = os.environ.get(HEARTBEAT_ENV)
        self.beat_at = 0.0
        self.reported = 0  # the last step reported
        self.ended = 0  # should_stop() calls: the step its agreement is about
        self.stop: Any = None
        self.control: Any = None
        # The workers' reporter: rank 0's metrics.jsonl and the MLflow journal. Its log records
        # stay out of the script's own logging (its output is already this rank's log).
        logging.getLogger(f"{LOGGER_NAME}.metrics").propagate = False
        context = LogContext.for_spec(spec, self.rank)
        self.reporter = worker_reporter(spec, job, context, is_main=self.rank == 0)
        self.reporter.on_start(total_steps=job.train.max_steps, start_step=0)

    def beat(self) -> None:
        now = time.monotonic()
        if self.heartbeat and now - self.beat_at >= _BEAT_EVERY_S:
            self.beat_at = now
            try:
                Path(self.heartbeat).touch()
            except OSError:
                pass


def _current() -> _Session | None:
    global _session
    if _session is None:
        spec_file = os.environ.get(SCRIPT_SPEC_ENV)
        if not spec_file:
            return None
        _session = _Session(spec_file)
    return _session


def report(metrics: dict[str, Any], step: int | None = None) -> None:
    """Metrics of a step (one past the last reported, by default) to the job's run: rank 0's are kept (names
    starting eval/ as evaluation metrics, the rest as train/<name>). A no-op outside
    ``scaletrain launch``."""
    session = _current()
    if session is None:
        return
    from scaletrain.tracking.reporter import StepReport, split_metrics

    step = session.reported + 1 if step is None else int(step)
    session.reported = max(session.reported, step)
    session.beat()
    session.reporter.on_step(step)
    if session.rank != 0:
        return
    train, evaluation = split_metrics(metrics)
    if train:
        session.reporter.on_train_metrics([StepReport(step, train, time.time())])
    if evaluation:
        session.reporter.on_eval_metrics(step, evaluation)


def should_stop() -> bool:
    """Call after every step, on every rank: True when the ranks agreed to stop (SIGTERM or
    SIGUSR1 reached any of them): save what you need and exit 0. False outside ``scaletrain
    launch``."""
    session = _current()
    if session is None:
        return False
    session.beat()
    if session.control is None:
        from scaletrain.distributed import collectives
        from scaletrain.engine.control import Control
        from scaletrain.recovery.signals import StopRequest

        session.stop = StopRequest()
        session.stop.install()
        group = collectives.new_gloo_group()  # collective: the first call is made by every rank
        session.control = Control(collectives.active(), session.stop, None, None, group=group)
        session.ended += 1
        session.control.start(session.ended)
        return False
    session.ended += 1
    return session.control.check(session.ended, async_ready=True, async_pending=False).stop is not None
