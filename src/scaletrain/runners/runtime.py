"""The worker runtime: what every runner gets from the worker process it runs in.

Whatever the kind of job, the worker (launch/worker.py) has already set up JSON logging with the
run's trace id, installed the stop signals, armed the hang watchdog, chosen the device and
joined the process group; it will write the error file and name the root cause if the runner
raises. A runner trains, and uses only this:

- ``start(total_steps, start_step)`` then ``report(step, metrics)`` (or ``reporter``, the
  Reporter sinks, for batches of steps): rank 0's values go to metrics.jsonl, the JSON logs, the
  progress bar and the MLflow journal (one MLflow run per job); other ranks' reports only keep
  their log lines' step current.
- ``checkpoints(model_strategy)``: the job's verified checkpoints (DCP, hashed, manifest last,
  retention, async, local or object storage), or None when the job keeps none; its
  ``restore_latest`` and ``save`` are the whole protocol.
- ``should_stop(step)`` (or ``control.check``): the stop every rank agrees on (a SIGTERM/SIGUSR1
  on any rank, or the engine's relay), and a time-based save falling due; it also tells the hang
  watchdog that this rank makes progress. Call it after every step: it is cheap when no check is
  due, and a collective when one is (every rank must call it at the same steps).
- ``after_step(step)``: call after every step (fault injection in tests; a no-op otherwise).
- who and where: ``spec`` (the run directory), ``job``, ``env`` (rank, world size), ``placement``
  (device, backend), ``restart_count`` (0 on the first start of the launch), ``is_main``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from scaletrain import __version__
from scaletrain.checkpoint.location import checkpoint_location, config_hash
from scaletrain.checkpoint.manager import CheckpointManager
from scaletrain.checkpoint.retention import RetentionPolicy
from scaletrain.config.schema import JobConfig
from scaletrain.distributed.device import Placement
from scaletrain.distributed.env import DistEnv
from scaletrain.engine.control import Control
from scaletrain.recovery.faults import FaultPlan
from scaletrain.rundir import RunSpec
from scaletrain.tracking.reporter import Reporters, StepReport
from scaletrain.tracking.tracker_handle import recorded_run

__all__ = ["WorkerRuntime", "ConsoleRelay"]

log = logging.getLogger("scaletrain.worker")


class ConsoleRelay(Protocol):
    """An engine's way to the user's console where the worker's stderr does not reach it (Ray):
    a Reporter sink and a logging handler for rank 0, and the run's files before a checkpoint
    commits (a worker on another machine than the driver's)."""

    log_handler: logging.Handler
    before_checkpoint: Callable[[], None] | None

    def mlflow_run_id(self) -> str | None: ...


@dataclass
class WorkerRuntime:
    spec: RunSpec
    job: JobConfig
    env: DistEnv
    placement: Placement
    reporter: Reporters
    control: Control
    restart_count: int = 0
    console: ConsoleRelay | None = None  # rank 0's, under Ray
    faults: FaultPlan = field(default_factory=lambda: FaultPlan(0, 0, {}))
    _started: bool = field(default=False, init=False, repr=False)

    @property
    def is_main(self) -> bool:
        return self.env.is_main

    @property
    def after_step(self) -> Callable[[int], None] | None:
        return self.faults.after_step if self.faults.active else None

    def start(self, total_steps: int | None, start_step: int = 0) -> None:
        """Before the first report: how many steps the run takes (None: unknown), and the step
        it starts from (after a restore). Steps already recorded by an earlier attempt are not
        recorded twice."""
        self.reporter.on_start(total_steps=total_steps, start_step=start_step)
        self._started = True

    def report(self, step: int, metrics: dict[str, float]) -> None:
        """One step's training metrics (rank 0's are recorded)."""
        if not self._started:
            self.start(self.job.train.max_steps, step - 1)
        self.reporter.on_step(step)
        self.reporter.on_train_metrics([StepReport(step, {k: float(v) for k, v in metrics.items()},
                                                   time.time())])

    def should_stop(self, step: int) -> str | None:
        """The signal every rank agreed to stop on at this step, or None."""
        return self.control.check(step, async_ready=True, async_pending=False).stop

    def checkpoints(self, strategy: str | None = None) -> CheckpointManager | None:
        """This run's checkpoints for a model wrapped by ``strategy`` (the job's by default)."""
        job, spec = self.job, self.spec
        if not job.checkpoint.enabled:
            return None
        best = job.checkpoint.keep_best
        policy = RetentionPolicy(
            keep_last=job.checkpoint.keep_last,
            best_metric=best.metric if best else None,
            best_mode=best.mode if best else "min",
            best_count=best.count if best else 1,
            keep_every=job.checkpoint.keep_every,
        )
        console = self.console if self.is_main else None
        return CheckpointManager(
            self.checkpoint_location(),
            rank=self.env.rank,
            world_size=self.env.world_size,
            strategy=strategy or job.scale.resolved_strategy,
            scratch_dir=spec.out_dir,  # staging for object storage, and this machine's cache
            identity={
                "run_id": spec.run_id,
                "run_dir": spec.run_dir,
                # Opened by the tracking process while the workers start: read when a checkpoint
                # is written (under Ray, the driver tells).
                "mlflow_run_id": getattr(console, "mlflow_run_id", None)
                or (lambda: (recorded_run(spec.run_dir) or {}).get("run_id")),
                "config_hash": config_hash(job),
                "versions": {"scaletrain": __version__, "torch": torch.__version__},
            },
            policy=policy,
            async_save=job.checkpoint.async_save,
            single_file=job.checkpoint.format == "auto",
            fault_hook=self.faults.during_checkpoint if self.faults.active else None,
            local_rank=self.env.local_rank,
            before_commit=getattr(console, "before_checkpoint", None),
        )

    def write_run_card(self, dataset: object | None, task: object | None = None,
                       fingerprint: str | None = None, extra: dict[str, Any] | None = None) -> None:
        """run_card.json (environment, git state, the training data's fingerprint: given, the
        task's own, else a sample of ``dataset``'s items; ``extra``: a runner's own entries, such
        as TensorFlow's version and devices); a failure is a warning, never the run's."""
        from scaletrain.tracking.redact import Redactor
        from scaletrain.tracking.run_card import build_run_card, data_fingerprint, write_run_card

        spec = self.spec
        try:
            if fingerprint is None:
                fingerprint = (data_fingerprint(task, dataset) if dataset is not None or task is not None
                               else "not known: the loop read no data through ctx.loader")
            card = {**build_run_card(spec.job, fingerprint, self.env.world_size, spec.git), **(extra or {})}
            write_run_card(spec.out_dir, card, Redactor.for_config(spec.job))
        except Exception:
            log.warning("could not write the run card", exc_info=True)

    def checkpoint_location(self) -> str:
        return self.spec.checkpoints or checkpoint_location(self.job, self.spec.run_id, self.spec.run_dir)
