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
from typing import Any

import torch

from scaletrain.config.schema import JobConfig
from scaletrain.distributed.device import (
    apply_threads,
    check_bf16,
    choose_placement,
    control_placement,
    set_determinism,
)
from scaletrain.distributed.env import DistEnv
from scaletrain.distributed.process_group import process_group
from scaletrain.engine.control import Control
from scaletrain.observe.telemetry import Telemetry
from scaletrain.observe.telemetry import install as install_telemetry
from scaletrain.recovery.attempts import error_code, restart_count, write_error
from scaletrain.recovery.faults import FaultPlan, deny_writes
from scaletrain.recovery.signals import StopRequest
from scaletrain.recovery.watchdog import Watchdog, collective_timeout_s
from scaletrain.rundir import RunSpec
from scaletrain.rundir.atomic import write_text_atomic
from scaletrain.runners import get_runner, runner_kind
from scaletrain.runners.runtime import ConsoleRelay, WorkerRuntime
from scaletrain.tracking.logs import LOGGER_NAME, LogContext, setup_logging
from scaletrain.tracking.redact import Redactor
from scaletrain.tracking.worker_sinks import worker_reporter

__all__ = ["run_worker", "main"]

log = logging.getLogger(f"{LOGGER_NAME}.worker")


def run_worker(
    spec: RunSpec,
    env: DistEnv | None = None,
    stop: StopRequest | None = None,
    node: str | None = None,
    console: ConsoleRelay | None = None,
    device: torch.device | None = None,
) -> dict[str, Any]:
    """Run this rank's share of the job with the runner its kind names. Returns the result (the
    same on every rank).

    ``stop``: an engine's own way to ask for a clean stop (besides this process's signals);
    ``node``: the engine's name for the machine, for the log; ``console``: an engine's relay
    to the user's console (a Reporter sink and a logging handler, for rank 0), where the
    worker's stderr does not reach the user (Ray); ``device``: the GPU the engine gave this
    worker (Ray Train), kept as it is."""
    env = env or DistEnv.from_env()
    deny_writes()  # testing: SCALETRAIN_DENY_WRITES (a run directory this worker cannot reach)
    job = JobConfig.model_validate(spec.job)
    # Logging, with the run's trace id; rank 0's warnings also reach an engine's console relay.
    context = LogContext.for_spec(spec, env.rank)
    redactor = Redactor.for_config(spec.job)
    undo_logging = setup_logging(context, spec.worker_log(env.rank), redactor=redactor)
    console = console if env.is_main else None
    # This rank's share of the job's live figures, for the launcher's metrics endpoint.
    telemetry = Telemetry(spec.telemetry_dir / f"rank-{env.rank}.json" if job.observability.enabled else None,
                          {"rank": str(env.rank)})
    previous_telemetry = install_telemetry(telemetry)
    reporter = worker_reporter(spec, job, context, env.is_main, console, telemetry, env.world_size)
    relay = getattr(console, "log_handler", None)
    if relay is not None:
        logging.getLogger(LOGGER_NAME).addHandler(relay)
    # Signals and the watchdog, armed from the start: a rendezvous or a resume that hangs is caught too.
    watchdog = Watchdog(job.recovery.hang_timeout_s, spec.worker_stacks(env.rank))
    watchdog.arm()
    stop = stop or StopRequest()
    restore_signals = stop.install()
    attempt = restart_count()
    try:
        runner = get_runner(runner_kind(job))
        # Placement: threads, determinism, device and backend.
        apply_threads(spec.threads)
        set_determinism(job.deterministic)
        placement = (choose_placement(env, job.scale.backend, device) if runner.uses_torch_device
                     else control_placement())
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
                "runner": runner.kind,
            },
        )
        with process_group(env, placement, collective_timeout_s(job.recovery.hang_timeout_s),
                           needed=needs_group) as grouped:
            runtime = WorkerRuntime(
                spec, job, env, placement, reporter,
                control=Control(grouped, stop, watchdog, _save_every_s(job)),
                restart_count=attempt, console=console, faults=FaultPlan(env.rank, attempt),
            )
            result = runner.run(runtime)
            if grouped:
                # Free DDP and its communication state while every peer is still connected:
                # a reducer torn down after the group is gone can block on a departed rank.
                gc.collect()
        log.info("worker finished", extra={"steps": result["steps"], "step_time": result.get("step_time")})
        return result
    except BaseException as exc:
        # The launcher shows the user one line for the failure; the console needs no copy.
        log.error(
            "worker failed: %s: %s", type(exc).__name__, exc, exc_info=True,
            extra={"console": False, "code": error_code(exc)},
        )
        _report_failure(spec, env.rank, exc, redactor, context.step, attempt)
        raise
    finally:
        restore_signals()
        watchdog.close()
        reporter.on_end()
        telemetry.flush(force=True)
        install_telemetry(previous_telemetry)
        if relay is not None:
            logging.getLogger(LOGGER_NAME).removeHandler(relay)
        undo_logging()


def _save_every_s(job: JobConfig) -> float | None:
    minutes = job.checkpoint.every_minutes
    return minutes * 60 if minutes and job.checkpoint.enabled else None


def _report_failure(spec: RunSpec, rank: int, exc: BaseException, redactor: Redactor,
                    steps: int | None, attempt: int) -> None:
    """This rank's error file; on a job of several nodes, also sent to the driver with the
    log's last lines."""
    error = write_error(spec, rank, exc, redactor, steps)
    from scaletrain.launch.rendezvous import report_failure

    report_failure(rank, {"error": error, "log_tail": _log_tail(spec, rank), "attempt": attempt})


def _log_tail(spec: RunSpec, rank: int, lines: int = 50) -> list[str]:
    try:
        return spec.worker_log(rank).read_text(encoding="utf-8").splitlines()[-lines:]
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
