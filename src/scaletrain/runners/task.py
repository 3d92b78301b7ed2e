"""The Task runner: a scaletrain Task (model, datasets, loss) trained by the engine's loop.

Build the task, let the planner pick the strategy when the job says ``auto``, build the Trainer,
resume from the newest verified checkpoint, fit, then export the final weights (safetensors)
and the MLflow model from rank 0. The run card is written beside training, off its critical
path."""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import asdict
from typing import Any

from torch.utils.data import default_collate

from scaletrain.engine.trainer import Trainer, TrainResult
from scaletrain.engine.weights import save_weights
from scaletrain.rundir import WEIGHTS_FILE, RunSpec
from scaletrain.runners.base import Runner
from scaletrain.runners.runtime import WorkerRuntime
from scaletrain.task import build_task
from scaletrain.tracking.logs import LOGGER_NAME
from scaletrain.tracking.mlflow_model import MLFLOW_MODEL_DIR, example_input, export_model

__all__ = ["TaskRunner"]

log = logging.getLogger(f"{LOGGER_NAME}.worker")


class TaskRunner(Runner):
    kind = "task"

    def run(self, runtime: WorkerRuntime) -> dict[str, Any]:
        # The trainer (model, DDP, optimizer) dies with this frame, before the worker leaves
        # the process group.
        return asdict(self._fit(runtime))

    def _fit(self, runtime: WorkerRuntime) -> TrainResult:
        spec, job, env = runtime.spec, runtime.job, runtime.env
        assert job.task is not None  # noqa: S101  the runner of task jobs
        task = build_task(job.task.target, job.task.args, spec.python_path)
        if job.scale.strategy == "auto":  # the planner's choice for these workers, logged with its reason
            from scaletrain.plan.auto import resolve_auto_strategy

            job = resolve_auto_strategy(job, task, env.world_size, runtime.placement.device, env.is_main)
        trainer = Trainer(
            job, task, env, runtime.placement, runtime.reporter,
            checkpoints=runtime.checkpoints(job.scale.resolved_strategy),
            control=runtime.control, after_step=runtime.after_step,
        )
        resumed_at = trainer.restore()
        if resumed_at is None and env.local_rank == 0 and job.checkpoint.enabled:
            from scaletrain.preflight import check_disk_for_model

            check_disk_for_model(job, runtime.checkpoint_location(), trainer.strategy.unwrap(trainer.model))
        _log_start(runtime, resumed_at)
        card_writer = None
        if env.is_main:  # off the critical path: the card is written while training starts
            card_writer = threading.Thread(
                target=runtime.write_run_card, args=(trainer.train_set, task), daemon=True,
                name="scaletrain-card",
            )
            card_writer.start()
        try:
            result = trainer.fit()
        except BaseException:
            # Nothing of a failed attempt may write after it: in-process, the launcher returns
            # right away and the run directory may be moved or resumed next.
            if trainer.checkpoints is not None:
                trainer.checkpoints.abandon()
            raise
        finally:
            if card_writer is not None:
                card_writer.join()
        if env.is_main and result.preempted is None:
            _export(spec, task, trainer, result)
        return result


def _log_start(runtime: WorkerRuntime, resumed_at: int | None) -> None:
    if runtime.restart_count and runtime.is_main:  # the console's only sign that a worker failed
        log.warning(
            "restart %d of %d after a worker failure (its exit is in %s); %s",
            runtime.restart_count, runtime.job.recovery.max_restarts, runtime.spec.launcher_log,
            f"resumed from step {resumed_at}" if resumed_at is not None else "no checkpoint yet: from step 0",
        )
    elif resumed_at is not None:
        log.info("resumed", extra={"step": resumed_at})


def _export(spec: RunSpec, task: Any, trainer: Trainer, result: TrainResult) -> None:
    """Rank 0: the final weights as safetensors, and the model traced by torch.export (the
    tracking process makes it an MLflow model)."""
    model = trainer.strategy.unwrap(trainer.model)
    if trainer.strategy.sharded:  # a plain copy of the model with the gathered weights
        model = task.build_model()
        model.load_state_dict(trainer.final_state)
    save_weights(
        model,
        os.path.join(spec.out_dir, WEIGHTS_FILE),
        metadata={"run_id": spec.run_id, "step": str(result.steps)},
    )
    if trainer.job.tracking.enabled and trainer.job.tracking.log_model:
        example = example_input(task, trainer.train_set, trainer.collate or default_collate)
        export_model(model, os.path.join(spec.out_dir, MLFLOW_MODEL_DIR), example)

