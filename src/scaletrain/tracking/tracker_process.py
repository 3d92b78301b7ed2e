"""The tracking process's main (``python -m scaletrain.tracking.tracker_process``): everything
MLflow does for one attempt, in a process of its own.

It imports MLflow and opens the job's run (or reopens it, on resume) while the workers start,
so neither the launcher nor a worker ever imports MLflow, and none of that start-up (~2 s of
import, ~2 s more to create a new sqlite store's tables) lands in the training window. Once
the run is open it drops to SCHED_IDLE and tails the metric journal, sending it in batches
(MLflow's ingestion costs ~0.15 ms of CPU per point on sqlite: bench/tracking_overhead.py),
with MLflow's system-metrics sampler beside it. When the tracker does not answer, it warns
once and keeps trying with backoff while training goes on; the journal keeps every point
meanwhile.

Protocol with the launcher's handle on it (tracker_handle.py): it prints one JSON line when
the run is open (``{"event": "opened", "run_id", "uri"}``) and one when it is done
(``{"event": "closed", ...}``); the launcher writes one JSON line on its stdin at the end of
the attempt (how long to keep trying, the final status, tags and the artifacts to log). End of file
instead (the launcher died) means: deliver what is left within 30 s, leave the run's status
alone. Ctrl-C and SIGTERM are the launcher's to handle: this process waits for its word.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from scaletrain.rundir import EXTRA_TAGS_ENV, JOB_FILE, SPEC_FILE, TRACKING_DIR

__all__ = ["main"]

DEFAULT_CLOSE_TIMEOUT_S = 30.0


class _Commands:
    """The launcher's one line on stdin, read by a thread so opening can be abandoned."""

    def __init__(self) -> None:
        self.command: dict[str, Any] | None = None
        self.arrived = threading.Event()
        threading.Thread(target=self._read, name="scaletrain-stdin", daemon=True).start()

    def _read(self) -> None:
        line = sys.stdin.readline()
        try:
            command = json.loads(line) if line.strip() else None
            self.command = command if isinstance(command, dict) else None
        except ValueError:
            self.command = None
        self.arrived.set()


def _emit(message: dict[str, Any]) -> None:
    """A line to the launcher; nothing when it is gone (it died, or was killed: no one reads)."""
    try:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()
    except (BrokenPipeError, ValueError):
        pass


def _idle_priority() -> None:
    """SCHED_IDLE for the calling thread and the threads it starts from now on (else nice 19)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        try:
            os.nice(19)
        except OSError:
            pass


def _open_run(config: Any, spec: Any, engine: str, extra_tags: dict[str, str], log: logging.Logger,
              commands: _Commands, max_backoff_s: float) -> Any:
    """The job's MLflow run, reopened on resume; retried with backoff until it opens or the
    launcher says the attempt is over (then None)."""
    from scaletrain.tracking.mlflow_client import configure_mlflow_client
    from scaletrain.tracking.mlflow_run import TrackingRun
    from scaletrain.tracking.tracker_handle import record_run, recorded_run

    run_dir = Path(spec.run_dir)
    backoff, failing = 1.0, False
    while True:
        try:
            configure_mlflow_client()
            known = recorded_run(run_dir, config)
            if known:  # a resumed job continues its run
                run = TrackingRun.reopen(config, known["uri"], known["run_id"], spec.attempt)
            else:
                run = TrackingRun.start(config, spec.run_id, spec.trace_id, engine, spec.python_path,
                                        extra_tags)
                record_run(run_dir, run.uri, run.run_id)
                run.log_artifact(run_dir / JOB_FILE)
        except Exception as exc:
            if not failing:
                log.warning(
                    "cannot reach the tracking server to open the MLflow run (%s); training goes "
                    "on, metrics are journaled in %s and sent once it answers",
                    _one_line(exc), run_dir / TRACKING_DIR,
                )
                failing = True
            if commands.arrived.wait(backoff):
                return None
            backoff = min(max_backoff_s, backoff * 2)
            continue
        if failing:
            log.warning("tracking server reachable: opened MLflow run %s; sending the journaled "
                        "metrics", run.run_id)
        return run


def _finish(run: Any, command: dict[str, Any], log: logging.Logger) -> str | None:
    """Log the artifacts and the final status; returns the error, if any."""
    from scaletrain.tracking.mlflow_package import is_exported_model, package_pytorch_model

    try:
        for path, artifact_path in command.get("artifacts", []):
            if artifact_path == "model" and is_exported_model(path):  # rank 0's torch.export
                try:
                    package_pytorch_model(path)
                except Exception as exc:  # the model is extra: the run still ends as it should
                    log.warning("the final model was not logged in MLflow's format (%s); the "
                                "weights are logged", _one_line(exc))
                    continue
            if artifact_path == "model" and Path(path, "MLmodel").is_file():  # an MLflow 3 logged model
                model_id = run.log_model(path, "model", (command.get("tags") or {}).get("scaletrain.steps"))
                log.info("logged model %s of run %s", model_id, run.run_id)
            else:
                run.log_artifact(path, artifact_path)
        run.finish(command["status"], command.get("tags") or {}, restarts=command.get("restarts", 0),
                   metrics=command.get("metrics") or {}, step=command.get("step"))
        return None
    except Exception as exc:
        log.warning("could not record the end of MLflow run %s (%s); the run directory has it all",
                    run.run_id, _one_line(exc))
        return _one_line(exc)


def _warm_up(scheme: str) -> dict[str, Any] | None:
    """MLflow imported (and the store's module, for an sqlite store) before the attempt is
    known; then the attempt's details, one JSON line on stdin (None: end of file)."""
    from scaletrain.tracking.mlflow_client import configure_mlflow_client

    configure_mlflow_client()
    if scheme == "sqlite":
        import mlflow.store.tracking.sqlalchemy_store  # noqa: F401  the import is the point
    line = sys.stdin.readline()
    try:
        attempt = json.loads(line) if line.strip() else None
    except ValueError:
        return None
    return attempt if isinstance(attempt, dict) and isinstance(attempt.get("args"), list) else None


def main(argv: list[str] | None = None) -> int:
    # The launcher handles Ctrl-C and preemption, then tells this process how to end the run.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from scaletrain.config.schema import JobConfig
    from scaletrain.rundir import RunSpec
    from scaletrain.tracking.journal_tail import JournalShipper
    from scaletrain.tracking.logs import LAUNCHER_LOGGER_NAME, LogContext, setup_logging
    from scaletrain.tracking.redact import Redactor

    argv = argv or sys.argv[1:]
    if argv[:1] == ["--warm"]:  # started early (tracker_handle.WarmTracker): import, then wait
        attempt = _warm_up(argv[1] if len(argv) > 1 else "")
        if attempt is None:  # the job stopped before its attempt
            return 0
        argv, extra_tags = attempt["args"], json.dumps(attempt.get("extra_tags") or {})
    else:
        extra_tags = os.environ.pop(EXTRA_TAGS_ENV, "{}")
    run_dir, log_file, engine, max_backoff = argv[:4]
    spec = RunSpec.read(Path(run_dir) / SPEC_FILE)
    undo = setup_logging(LogContext.for_spec(spec, rank=None), log_file,
                         redactor=Redactor.for_config(spec.job), logger_name=LAUNCHER_LOGGER_NAME)
    log = logging.getLogger(f"{LAUNCHER_LOGGER_NAME}.tracking")
    commands = _Commands()
    config = JobConfig.model_validate(spec.job)
    if config.observability.enabled:  # deliveries, the backlog and its lag, for the metrics endpoint
        from scaletrain.observe.telemetry import Telemetry, install

        install(Telemetry(spec.telemetry_dir / "tracker.json", {"source": "tracker"}))
    run = _open_run(config, spec, engine, json.loads(extra_tags), log, commands, float(max_backoff))
    shipper = None
    if run is not None:
        _emit({"event": "opened", "run_id": run.run_id, "uri": run.uri})
        startup_cpu_s = process_cpu_s()
        _idle_priority()  # from here on, only cycles training leaves free
        run.start_system_metrics(config.tracking.system_metrics_every_s)
        shipper = JournalShipper(run.client, run.run_id, Path(run_dir) / TRACKING_DIR, log).start()
    commands.arrived.wait()
    command = commands.command or {}
    timeout = float(command.get("timeout_s", DEFAULT_CLOSE_TIMEOUT_S))
    report: dict[str, Any] = {"event": "closed", "opened": run is not None, "left": -1, "delivered": None,
                              "finished": False}
    if run is not None and shipper is not None:
        started = time.monotonic()
        report["left"] = shipper.close(timeout)
        report["delivered"] = shipper.sender.delivered
        if command.get("status"):
            report["error"] = _finish(run, command, log)
            report["finished"] = report["error"] is None
        elif run.system_metrics is not None:
            run.system_metrics.finish()
        report["close_s"] = round(time.monotonic() - started, 3)
        report["startup_cpu_s"] = startup_cpu_s
    report["cpu_s"] = process_cpu_s()
    from scaletrain.observe.telemetry import current

    current().flush(force=True)
    _emit(report)
    undo()
    return 0


def process_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return round(usage.ru_utime + usage.ru_stime, 3)


def _one_line(exc: BaseException) -> str:
    text = str(exc).splitlines()[0][:200] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


if __name__ == "__main__":
    from scaletrain.quick_exit import exit_quickly

    exit_quickly(main())
