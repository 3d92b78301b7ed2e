"""The one worker entry point every engine starts.

It reads only the RunSpec and the standard env contract (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT), so it does not care whether torch elastic, Ray or the current
process launched it. As a command (``python -m scaletrain.launch.worker SPEC.json``) it is what
the local engine starts: a fresh interpreter, like torchrun's, so the caller's ``__main__`` is
never re-imported in a worker.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import socket
import threading
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import default_collate

from scaletrain import __version__
from scaletrain.rundir.atomic import write_text_atomic
from scaletrain.checkpoint.location import checkpoint_location, config_hash
from scaletrain.checkpoint.manager import CheckpointManager
from scaletrain.checkpoint.retention import RetentionPolicy
from scaletrain.config.schema import JobConfig
from scaletrain.distributed.device import (
    Placement,
    apply_threads,
    check_bf16,
    choose_placement,
    set_determinism,
)
from scaletrain.distributed.env import DistEnv
from scaletrain.distributed.process_group import process_group
from scaletrain.engine.control import Control, StopRequest, Watchdog
from scaletrain.engine.trainer import Trainer, TrainResult
from scaletrain.faults import FaultPlan, deny_writes
from scaletrain.engine.weights import save_weights
from scaletrain.rundir import METRICS_FILE, RESTART_COUNT_ENV, TRACKING_DIR, WEIGHTS_FILE, RunSpec
from scaletrain.task import build_task
from scaletrain.tracking.logs import LOGGER_NAME, LogContext, setup_logging
from scaletrain.tracking.mlflow_model import MLFLOW_MODEL_DIR, example_input, save_mlflow_model
from scaletrain.tracking.mlflow_sink import MlflowReporter
from scaletrain.tracking.redact import Redactor
from scaletrain.tracking.run_card import build_run_card, data_fingerprint, write_run_card
from scaletrain.tracking.session import recorded_run
from scaletrain.tracking.progress import ProgressBar, progress_wanted
from scaletrain.tracking.reporter import LogReporter, MetricsFile, NullReporter, Reporters

__all__ = ["run_worker", "main"]

log = logging.getLogger(f"{LOGGER_NAME}.worker")


class _StepTracker(NullReporter):
    """Keeps the log context's step current on every rank."""

    def __init__(self, context: LogContext):
        self.context = context

    def on_step(self, step: int) -> None:
        self.context.step = step


def run_worker(
    spec: RunSpec,
    env: DistEnv | None = None,
    stop: StopRequest | None = None,
    node: str | None = None,
    console: Any = None,
    device: torch.device | None = None,
) -> dict[str, Any]:
    """Train this rank's share of the job. Returns the train result (the same on every rank).

    ``stop``: an engine's own way to ask for a clean stop (besides this process's signals);
    ``node``: the engine's name for the machine, for the log; ``console``: an engine's relay
    to the user's console (a Reporter sink and a logging handler, for rank 0), where the
    worker's stderr does not reach the user (Ray); ``device``: the GPU the engine gave this
    worker (Ray Train), kept as it is."""
    env = env or DistEnv.from_env()
    deny_writes()  # testing: SCALETRAIN_DENY_WRITES (a run directory this worker cannot reach)
    job = JobConfig.model_validate(spec.job)
    context = LogContext(spec.run_id, spec.trace_id, env.rank)
    undo_logging = setup_logging(
        context, spec.worker_log(env.rank), redactor=Redactor.for_config(spec.job)
    )
    reporter = _reporter_for(env, spec, job, context, console)
    relay = getattr(console, "log_handler", None) if env.is_main else None
    if relay is not None:  # rank 0's warnings reach the user's console through the engine
        logging.getLogger(LOGGER_NAME).addHandler(relay)
    # Armed from the start: a rendezvous or a resume that hangs is caught too.
    watchdog = Watchdog(job.recovery.hang_timeout_s, spec.worker_stacks(env.rank))
    watchdog.arm()
    stop = stop or StopRequest()
    restore_signals = stop.install()
    try:
        apply_threads(spec.threads)
        set_determinism(job.deterministic)
        placement = choose_placement(env, job.scale.backend, device)
        check_bf16(placement.device, job.train.precision)
        # ddp, fsdp and hsdp run in a process group, also with one worker.
        needs_group = job.scale.resolved_strategy != "single"
        log.info(
            "worker started",
            extra={
                "pid": os.getpid(),
                "world_size": env.world_size,
                "device": str(placement.device),
                "backend": placement.backend if env.is_distributed or needs_group else None,
                "threads": spec.threads,
                "host": socket.gethostname(),
                "node": node,
            },
        )
        with process_group(env, placement, needed=needs_group) as grouped:
            control = Control(grouped, stop, watchdog, _save_every_s(job))
            result = _train(spec, job, env, placement, reporter, control, console)
            if grouped:
                # Free DDP and its communication state while every peer is still connected:
                # a reducer torn down after the group is gone can block on a departed rank.
                gc.collect()
        log.info("worker finished", extra={"steps": result.steps, "step_time": result.step_time})
        return asdict(result)
    except BaseException as exc:
        # The launcher shows the user one line for the failure; the console needs no copy.
        log.error(
            "worker failed: %s: %s", type(exc).__name__, exc, exc_info=True,
            extra={"console": False},
        )
        _write_error(spec, env.rank, exc, Redactor.for_config(spec.job), context.step)
        raise
    finally:
        restore_signals()
        watchdog.close()
        reporter.on_end()
        if relay is not None:
            logging.getLogger(LOGGER_NAME).removeHandler(relay)
        undo_logging()


def _save_every_s(job: JobConfig) -> float | None:
    minutes = job.checkpoint.every_minutes
    return minutes * 60 if minutes and job.checkpoint.enabled else None


def restart_count() -> int:
    """Which attempt of this launch this is (our launchers count; torch elastic's own count, under
    plain torchrun, misses a restart caused by another node)."""
    count = os.environ.get(RESTART_COUNT_ENV) or os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return int(count or 0)


def _checkpoints(spec: RunSpec, job: JobConfig, env: DistEnv, faults: FaultPlan,
                 console: Any = None) -> CheckpointManager | None:
    """``console``: an engine's relay for rank 0 (Ray), which may give the MLflow run's id and
    bring the run's files up to date before a checkpoint commits."""
    if not job.checkpoint.enabled:
        return None
    policy = RetentionPolicy(
        keep_last=job.checkpoint.keep_last,
        best_metric=job.checkpoint.keep_best.metric if job.checkpoint.keep_best else None,
        best_mode=job.checkpoint.keep_best.mode if job.checkpoint.keep_best else "min",
        best_count=job.checkpoint.keep_best.count if job.checkpoint.keep_best else 1,
        keep_every=job.checkpoint.keep_every,
    )
    return CheckpointManager(
        spec.checkpoints or checkpoint_location(job, spec.run_id, spec.run_dir),
        rank=env.rank,
        world_size=env.world_size,
        strategy=job.scale.resolved_strategy,
        scratch_dir=spec.out_dir,  # staging for object storage, and this machine's cache
        identity={
            "run_id": spec.run_id,
            "run_dir": spec.run_dir,
            # Opened by the tracking process while the workers start: read when a checkpoint is written.
            "mlflow_run_id": getattr(console, "mlflow_run_id", None)
            or (lambda: (recorded_run(spec.run_dir) or {}).get("run_id")),
            "config_hash": config_hash(job),
            "versions": {"scaletrain": __version__, "torch": torch.__version__},
        },
        policy=policy,
        async_save=job.checkpoint.async_save,
        fault_hook=faults.during_checkpoint if faults.active else None,
        local_rank=env.local_rank,
        before_commit=getattr(console, "before_checkpoint", None),
    )


def _train(
    spec: RunSpec, job: JobConfig, env: DistEnv, placement: Placement, reporter: Reporters,
    control: Control, console: Any = None,
) -> TrainResult:
    """Build, resume if there is a checkpoint, fit; the trainer (model, DDP, optimizer) dies
    with this frame."""
    task = build_task(job.task.target, job.task.args, spec.python_path)
    if job.scale.strategy == "auto":  # the planner's choice for these workers, logged with its reason
        from scaletrain.plan.auto import resolve_auto_strategy

        job = resolve_auto_strategy(job, task, env.world_size, placement.device, env.is_main)
    faults = FaultPlan(env.rank, restart_count())
    trainer = Trainer(
        job, task, env, placement, reporter,
        checkpoints=_checkpoints(spec, job, env, faults, console if env.is_main else None),
        control=control, after_step=faults.after_step if faults.active else None,
    )
    resumed_at = trainer.restore()
    if resumed_at is None and env.local_rank == 0 and job.checkpoint.enabled:
        from scaletrain.preflight import check_disk_for_model

        check_disk_for_model(job, spec.checkpoints or checkpoint_location(job, spec.run_id, spec.run_dir),
                             trainer.strategy.unwrap(trainer.model))
    if restart_count() and env.is_main:  # the console's only sign that a worker failed
        log.warning(
            "restart %d of %d after a worker failure (its exit is in %s); %s",
            restart_count(), job.recovery.max_restarts, spec.launcher_log,
            f"resumed from step {resumed_at}" if resumed_at is not None else "no checkpoint yet: from step 0",
        )
    elif resumed_at is not None:
        log.info("resumed", extra={"step": resumed_at})
    card_writer = None
    if env.is_main:  # off the critical path: the card is written while training starts
        card_writer = threading.Thread(
            target=_write_card, args=(spec, task, trainer.train_set, env.world_size), daemon=True,
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
        model = trainer.strategy.unwrap(trainer.model)
        if trainer.strategy.sharded:  # a plain copy of the model with the gathered weights
            model = task.build_model()
            model.load_state_dict(trainer.final_state)
        save_weights(
            model,
            os.path.join(spec.out_dir, WEIGHTS_FILE),
            metadata={"run_id": spec.run_id, "step": str(result.steps)},
        )
        if job.tracking.enabled and job.tracking.log_model:
            example = example_input(task, trainer.train_set, trainer.collate or default_collate)
            save_mlflow_model(model, os.path.join(spec.out_dir, MLFLOW_MODEL_DIR), example)
    return result


def _write_card(spec: RunSpec, task: Any, dataset: Any, world_size: int) -> None:
    try:
        card = build_run_card(spec.job, data_fingerprint(task, dataset), world_size)
        write_run_card(spec.out_dir, card, Redactor.for_config(spec.job))
    except Exception:
        log.warning("could not write the run card", exc_info=True)


def _reporter_for(
    env: DistEnv, spec: RunSpec, job: JobConfig, context: LogContext, console: Any = None
) -> Reporters:
    sinks: list[Any] = [_StepTracker(context)]
    if env.is_main and console is not None:
        sinks.append(console)
    if env.is_main:
        sinks += [
            MetricsFile(os.path.join(spec.out_dir, METRICS_FILE), every=job.train.log_every),
            LogReporter(logging.getLogger(f"{LOGGER_NAME}.metrics"), every=job.train.log_every),
        ]
        if progress_wanted():
            sinks.append(ProgressBar(job.name))
        if job.tracking.enabled:  # journaled even while the tracker is unreachable
            sinks.append(
                MlflowReporter(
                    os.path.join(spec.out_dir, TRACKING_DIR),
                    every=job.tracking.log_every_steps or job.train.log_every,
                )
            )
    return Reporters(*sinks)


def _write_error(spec: RunSpec, rank: int, exc: BaseException, redactor: Redactor,
                 steps: int | None = None) -> None:
    """A small JSON file per failed rank, so any launcher can show the user the real error
    (and the steps trained); on a job of several nodes, also sent to the driver with the
    log's last lines."""
    error = {
        "rank": rank,
        "steps": steps,
        "type": type(exc).__name__,
        "message": redactor.text(str(exc)),
        "traceback": redactor.text(traceback.format_exc()),
        "timestamp": time.time(),
    }
    try:
        write_text_atomic(spec.worker_error(rank), json.dumps(error))
    except OSError:
        log.warning("could not write the error file for rank %s", rank, exc_info=True)
    from scaletrain.launch.rendezvous import report_failure

    report_failure(rank, {"error": error, "log_tail": _log_tail(spec.worker_log(rank)),
                          "attempt": restart_count()})


def _log_tail(path: Path, lines: int = 50) -> list[str]:
    try:
        return path.read_text(encoding="utf-8").splitlines()[-lines:]
    except OSError:
        return []


def main(argv: list[str] | None = None) -> int:
    """Command entry: run this rank from a spec file; the node's first worker writes its result
    beside it (on the driver that is rank 0's, with the weights' hash)."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    spec = RunSpec.read(args[0])
    env = DistEnv.from_env()
    try:
        result = run_worker(spec, env)
    except BaseException:  # already logged and written to this rank's error file
        return 1
    if env.local_rank == 0:
        write_text_atomic(spec.worker_result(), json.dumps({**result, "restarts": restart_count()}))
    return 0


if __name__ == "__main__":
    from scaletrain.quick_exit import exit_quickly

    exit_quickly(main())
