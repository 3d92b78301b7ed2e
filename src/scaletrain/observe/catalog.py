"""Every figure the job's metrics endpoint serves, once: its Prometheus name, type, help text,
the label it is kept by, and how the processes' shares add up (docs/observability.md).

Each process (a rank, the tracking process, the launcher) keeps its own share in a telemetry
file (telemetry.py); the launcher's collector (exporter.py) adds them up on every scrape:
``per_rank`` figures keep a ``rank`` label, the others are one figure for the job (``sum`` of the
shares, or the ``max``: the newest checkpoint is the newest of any rank's).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Figure", "FIGURES", "PREFIX", "STEP_BUCKETS", "ERROR_KINDS"]

PREFIX = "scaletrain_"
# Seconds: a 1 ms CPU step to a minute-long one.
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
SAVE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

# errors_total{kind} / work_total{kind} is the error rate of each kind of work.
ERROR_KINDS = {
    "step": "optimizer steps; errors: steps skipped for a non-finite loss or gradient (train.nonfinite: skip)",
    "sample": "samples read; errors: samples whose dataset raised (data.on_error: skip)",
    "checkpoint_save": "checkpoint saves; errors: saves that failed",
    "delivery": "metric batches sent to MLflow; errors: batches the tracker refused or did not answer",
    "attempt": "starts of the workers; errors: attempts that ended in a worker failure",
    "trial": "tune trials ended (finished or stopped early); errors: trials that failed for good",
}


@dataclass(frozen=True)
class Figure:
    name: str  # without PREFIX
    type: str  # counter, gauge or histogram
    help: str
    aggregate: str = "sum"  # per_rank, sum or max
    label: str | None = None  # the label it is kept by (errors by kind)
    buckets: tuple[float, ...] = ()


FIGURES = {f.name: f for f in (
    Figure("steps_total", "counter", "Training steps this rank finished (redone steps after a restart count again).",
           "per_rank"),
    Figure("samples_total", "counter", "Samples this rank trained on.", "per_rank"),
    Figure("tokens_total", "counter", "Tokens this rank trained on (a task that sets tokens_per_sample).",
           "per_rank"),
    Figure("step_seconds", "histogram", "Step time on this rank (each step of a reporting window at the "
           "window's mean: no device sync per step).", "per_rank", buckets=STEP_BUCKETS),
    Figure("data_wait_seconds_total", "counter", "Seconds this rank's training loop waited for data.",
           "per_rank"),
    Figure("data_ready_batches", "gauge", "Batches the data loader's workers have ready ahead of the training "
           "loop, at the last report (data.loader_workers > 0).", "per_rank"),
    Figure("last_step", "gauge", "The last step this rank finished.", "per_rank"),
    Figure("last_step_timestamp_seconds", "gauge", "Unix time this rank last finished a step.", "per_rank"),
    Figure("errors_total", "counter", "Failed units of work, by kind (rate: divide by work_total).",
           label="kind"),
    Figure("work_total", "counter", "Units of work done or tried, by kind.", label="kind"),
    Figure("checkpoint_save_seconds", "histogram", "Training stall per checkpoint save (the whole save when "
           "synchronous; the staging when async).", "max", buckets=SAVE_BUCKETS),
    Figure("checkpoint_restore_seconds", "gauge", "How long the last restore from a checkpoint took.", "max"),
    Figure("last_checkpoint_step", "gauge", "The step of the newest committed checkpoint.", "max"),
    Figure("last_checkpoint_timestamp_seconds", "gauge", "Unix time the newest checkpoint was committed.", "max"),
    Figure("checkpoint_writes_pending", "gauge", "Asynchronous checkpoint writes not yet committed.", "max"),
    Figure("metrics_backlog_points", "gauge", "Metric points journaled but not yet delivered to MLflow.", "max"),
    Figure("metric_delivery_lag_seconds", "gauge", "For the last batch delivered to MLflow: from its oldest "
           "point being logged to its delivery.", "max"),
    Figure("restarts_total", "counter", "Restarts of the workers after a failure."),
    Figure("evals_total", "counter", "Evaluations run (rank 0).", "max"),
    Figure("trials", "gauge", "Trials of a tune search by status (pending, running, paused, finished, failed).",
           label="status"),
)}
