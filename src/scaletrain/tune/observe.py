"""A search's own figures and log, beside its trials' (each trial is a full job with its own):
trials by status (pending, running, paused, finished, failed: the search's queue), each ended
trial a unit of work and each failed one an error (so the error-rate alert covers trials), served
by the search's metrics endpoint; every trial's start, retry and end in ``logs/tune.jsonl``,
stamped with the search's trace id (kept by --resume) and this invocation's request id.

Imports Ray: search.py imports it only once a search starts. The callback is a module-level class:
Tune pickles it with the search's state, and a resumed search gets it back."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ray.tune import Callback

from scaletrain.observe.telemetry import current

__all__ = ["SearchIdentity", "SearchFigures", "SEARCH_LOGGER", "TUNE_LOG", "STATUS"]

SEARCH_LOGGER = "scaletrain_launcher.tune.trials"  # to logs/tune.jsonl only
TUNE_LOG = "tune.jsonl"  # in the search's logs/
# Tune's trial states -> the `status` label of scaletrain_trials.
STATUS = {"PENDING": "pending", "RUNNING": "running", "PAUSED": "paused", "TERMINATED": "finished",
          "ERROR": "failed"}


@dataclass
class SearchIdentity:
    """What the metrics endpoint and the log lines say the search is (observe.exporter.observed
    reads these names from a run's spec)."""

    run_id: str
    telemetry_dir: Path
    trace_id: str
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    node_rank: int = 0


class SearchFigures(Callback):
    """Run in the search's process by Tune's loop. ``logger``: a name, so that a pickled copy
    (a resumed search's) logs where this invocation routes it."""

    def __init__(self, logger: str = SEARCH_LOGGER):
        self.logger = logger

    @property
    def log(self) -> logging.Logger:
        return logging.getLogger(self.logger)

    def on_step_end(self, iteration: int, trials: list[Any], **info: Any) -> None:
        counts = dict.fromkeys(STATUS.values(), 0)
        for trial in trials:
            counts[STATUS.get(str(trial.status), "pending")] += 1
        figures = current()
        for status, count in counts.items():
            figures.set("trials", count, status)
        figures.flush()

    def on_trial_start(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self.log.info("trial %s started", trial.trial_id, extra={"trial": trial.trial_id})

    def on_trial_recover(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self.log.warning("trial %s failed; Tune retries it from its checkpoint", trial.trial_id,
                         extra={"trial": trial.trial_id})

    def on_trial_complete(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        current().work("trial", 1)
        self.log.info("trial %s ended", trial.trial_id, extra={"trial": trial.trial_id})

    def on_trial_error(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        current().work("trial", 1, errors=1)
        self.log.warning("trial %s failed for good (its console.log says why)", trial.trial_id,
                         extra={"trial": trial.trial_id, "code": "ST-WORKER"})

    def on_experiment_end(self, trials: list[Any], **info: Any) -> None:
        self.on_step_end(0, trials)
        current().flush(force=True)
