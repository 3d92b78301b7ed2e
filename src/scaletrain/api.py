"""``scaletrain.run(job)``: the Python API. The CLI is a thin shell around it."""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from scaletrain.config import job_to_yaml, load_job, parse_job
from scaletrain.config.schema import JobConfig
from scaletrain.errors import RunInterrupted, RunPreempted, ScaletrainError
from scaletrain.observe.exporter import observed
from scaletrain.rundir import JOB_FILE, LOGS_DIR, RUN_CARD_FILE, SUMMARY_FILE, TRACKING_TAGS_ENV, WEIGHTS_FILE
from scaletrain.tracking.logs import LAUNCHER_LOGGER_NAME, LogContext, setup_logging
from scaletrain.tracking.redact import Redactor

__all__ = ["run", "resume", "resolve_job", "preflight"]

_launcher_log = logging.getLogger(f"{LAUNCHER_LOGGER_NAME}.tracking")


def resolve_job(
    job: str | os.PathLike | dict[str, Any] | JobConfig, overrides: list[str] | tuple[str, ...] = ()
) -> tuple[JobConfig, list[str]]:
    """A validated job and the directories its task is imported from (cwd, the job's folder)."""
    search_path = [os.getcwd()]
    if isinstance(job, JobConfig):
        config = parse_job(job.model_dump(mode="json"), overrides) if overrides else job
    elif isinstance(job, dict):
        config = parse_job(job, overrides)
    else:
        config = load_job(Path(job), overrides)
        search_path.append(str(Path(job).resolve().parent))
    return config, search_path


def run(
    job: str | os.PathLike | dict[str, Any] | JobConfig,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    started_at: float | None = None,
    search_path: list[str] | None = None,
    tracking_tags: dict[str, str] | None = None,
    node_rank: int = 0,
) -> dict[str, Any]:
    """Train a job (a YAML path, a mapping or a JobConfig) and return its summary.

    The summary is also written to ``summary.json`` in the run directory. Raises a
    ScaletrainError (ConfigError, TaskError, WorkerFailedError, RunPreempted...) with a
    user-facing message. ``search_path`` adds folders to import the task from;
    ``tracking_tags`` go on the MLflow run. ``node_rank``: a job on several nodes (scale.nodes)
    runs one launcher per node; node 0, the driver, tracks the run, the others join it.
    """
    from scaletrain.rundir import RunLock, RunSpec

    started_at = started_at or time.time()
    if tracking_tags is None and os.environ.get(TRACKING_TAGS_ENV):
        # A trial of `scaletrain tune`: its run nests under the search's MLflow run.
        tracking_tags = json.loads(os.environ[TRACKING_TAGS_ENV])
    config, job_search_path = resolve_job(job, overrides)
    search_path = job_search_path + [p for p in (search_path or []) if p not in job_search_path]
    rendezvous, run_id, trace = None, None, {}
    if node_rank and config.scale.engine == "local":  # the driver's run id, and a job that matches
        rendezvous, info = _join_driver(config, None, node_rank)
        run_id, trace = info["run_id"], {"trace_id": info["trace_id"]}
    spec = RunSpec.in_dir(config.model_dump(mode="json"), config.run_dir, run_id=run_id,
                          python_path=search_path, node_rank=node_rank, **trace)
    # The run directory is this launcher's while it lives (rundir.RunLock), taken once the
    # job and its pre-flight pass: bad input leaves no run directory behind.
    lock = RunLock(spec.run_dir, spec.run_id, node_rank)
    warm = _warm_tracker(config, node_rank)
    workers = _warm_workers(config, rendezvous)
    try:
        return _launch(config, spec, started_at, tracking_tags, rendezvous=rendezvous, lock=lock, warm=warm,
                       warm_workers=workers)
    finally:
        lock.release()
        if warm is not None:
            warm.discard()
        if workers is not None:
            workers.close()


def resume(
    target: str | os.PathLike,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    started_at: float | None = None,
) -> dict[str, Any]:
    """Continue a stopped, failed or preempted run from its newest verified checkpoint. A
    finished run (unless the overrides make it longer) is left unchanged: its summary comes
    back with a ``note`` saying so.

    ``target``: a run directory, a scaletrain run id (looked up under ``./runs``) or one
    checkpoint folder of a run (newer checkpoints of that run are set aside, not deleted).
    Overrides may change how it runs (``scale.workers``...), not what it computes: a changed
    global batch is refused by the workers. The MLflow run continues (``scaletrain.attempts``).
    Refused (RunInUse, exit 2) while another launcher uses the run directory.
    """
    from scaletrain.recovery.resume import RunFinished, prepare_resume

    started_at = started_at or time.time()
    try:
        spec, notes, lock = prepare_resume(str(target), overrides)  # the run directory, locked
    except RunFinished as finished:  # its summary as it is, and why nothing ran
        return {**finished.summary, "note": finished.note}
    with lock:
        config = JobConfig.model_validate(spec.job)
        warm = _warm_tracker(config, spec.node_rank)
        workers = _warm_workers(config, None)
        try:
            return _launch(config, spec, started_at, None, notes, warm=warm, warm_workers=workers)
        finally:
            if warm is not None:
                warm.discard()
            if workers is not None:
                workers.close()


def _git_state() -> Any:
    """The run card's git state; None if git misbehaves (the run goes on without it)."""
    from scaletrain.tracking.git_state import git_state

    try:
        return git_state()
    except Exception:
        return None


def _warm_tracker(config: JobConfig, node_rank: int) -> Any:
    """The driver's tracking process, started now: it imports MLflow while this process
    imports torch and checks the job (tracking/tracker_handle.py WarmTracker)."""
    if not config.tracking.enabled or node_rank:
        return None
    from scaletrain.tracking.tracker_handle import WarmTracker

    return WarmTracker(config)


def _warm_workers(config: JobConfig, rendezvous: Any) -> Any:
    """The process the local engine forks its workers from, started now: it imports torch and
    the worker's code while this process starts up and checks the job (launch/warm_workers.py)."""
    from scaletrain.launch import launcher_name
    from scaletrain.launch.warm_workers import WarmWorkers, enabled

    several_nodes = config.scale.node_range[1] > 1
    if not enabled() or config.script is not None or (launcher_name(config, rendezvous) != "local" and not several_nodes):
        return None
    return WarmWorkers()


def _join_driver(config: JobConfig, run_id: str | None, node_rank: int) -> tuple[Any, dict]:
    from scaletrain.checkpoint.location import config_hash
    from scaletrain.launch.rendezvous import for_job

    if config.scale.node_range[1] == 1:
        from scaletrain.errors import ConfigError

        raise ConfigError(f"--node-rank {node_rank}: this job runs on one node (set scale.nodes)")
    rendezvous = for_job(config, run_id or "pending", node_rank).open()
    try:
        info = rendezvous.check_joined(run_id, config_hash(config))
    except BaseException:
        rendezvous.close()
        raise
    rendezvous.run_id = info["run_id"]
    return rendezvous, info


def _open_rendezvous(config: JobConfig, spec: Any) -> Any:
    """A job on several nodes: the driver hosts the rendezvous and publishes its run; another
    node resuming connects and checks it resumes the same run."""
    from scaletrain.checkpoint.location import config_hash
    from scaletrain.launch.rendezvous import for_job

    if spec.node_rank:
        return _join_driver(config, spec.run_id, spec.node_rank)[0]
    rendezvous = for_job(config, spec.run_id, 0).open()
    rendezvous.publish_run({"run_id": spec.run_id, "trace_id": spec.trace_id,
                            "config_hash": config_hash(config), "attempt": spec.attempt})
    return rendezvous


def _launch(
    config: JobConfig, spec: Any, started_at: float, tracking_tags: dict[str, str] | None,
    notes: Sequence[str] = (), rendezvous: Any = None, lock: Any = None, warm: Any = None,
    warm_workers: Any = None,
) -> dict[str, Any]:
    # The run card's git state, taken here (beside torch's import) for the workers: a worker
    # must not start git while its DataLoader forks (rundir/spec.py RunSpec.git).
    from concurrent.futures import ThreadPoolExecutor

    taking = ThreadPoolExecutor(1, thread_name_prefix="scaletrain-git-state")
    git = taking.submit(_git_state)
    taking.shutdown(wait=False)  # its thread ends with the call
    from scaletrain.distributed.device import check_local_workers, threads_per_worker
    from scaletrain.launch import launcher_for
    from scaletrain.task import check_job_code

    # Fail before any worker starts if the task or loop does not exist or its args do not fit,
    # or anything the run writes (run dir, checkpoints, MLflow) would be refused (pre-flight).
    check_job_code(config, spec.python_path)
    if config.checkpoint.enabled and config.checkpoint.dir:  # its fsspec driver is installed
        from scaletrain.checkpoint.storage import open_storage

        open_storage(config.checkpoint.dir)
    spec.job = config.model_dump(mode="json")
    if config.scale.engine == "local":
        check_local_workers(config.scale.workers_per_node, config.scale.backend)
    if config.scale.engine == "ray":  # the CPUs Ray reserves for each worker
        spec.threads = config.scale.threads_per_worker or max(1, int(config.scale.cpus_per_worker))
    else:
        spec.threads = threads_per_worker(config.scale.workers_per_node, config.scale.threads_per_worker)
    spec.attempt += 1
    spec.request_id = uuid.uuid4().hex[:16]  # this launch's; the trace id stays the run's
    _resolve_checkpoints(config, spec)
    try:
        checks = _preflight(config, spec)
        if lock is not None:  # a new run's directory: locked now that nothing refused it
            lock.acquire()
    except BaseException:
        if rendezvous is not None:  # a node that joined the driver leaves it
            rendezvous.close()
        raise
    if config.scale.node_range[1] > 1 and rendezvous is None:
        rendezvous = _open_rendezvous(config, spec)
    launcher = launcher_for(config, rendezvous)
    if warm_workers is not None and hasattr(launcher, "warm_workers"):  # the local engine's
        launcher.warm_workers = warm_workers
    spec.git = git.result()
    spec.logs_dir.mkdir(parents=True, exist_ok=True)
    _write_redacted_job(config, Path(spec.run_dir) / JOB_FILE)
    undo_logging = setup_logging(
        LogContext.for_spec(spec, rank=None),
        spec.launcher_log,
        redactor=Redactor.for_config(spec.job),
        logger_name=LAUNCHER_LOGGER_NAME,
    )
    logging.getLogger(f"{LAUNCHER_LOGGER_NAME}.preflight").info(
        "pre-flight passed in %.0f ms", 1000 * sum(c.seconds for c in checks),
        extra={"console": False, "checks": [{"name": c.name, "detail": c.detail, "warning": c.warning,
                                             "seconds": round(c.seconds, 4)} for c in checks]})
    for note in notes:  # on the console and in launcher.jsonl
        logging.getLogger(LAUNCHER_LOGGER_NAME).warning("%s", note)
    try:
        with observed(config, spec, launcher.name, logging.getLogger(f"{LAUNCHER_LOGGER_NAME}.metrics")) as watch:
            return _run_attempt(config, spec, launcher, started_at, tracking_tags, watch, warm)
    finally:
        undo_logging()
        if rendezvous is not None:
            rendezvous.close()


def _resolve_checkpoints(config: JobConfig, spec: Any) -> None:
    """Where the run's checkpoints go, resolved once by the launcher that starts the run: a
    relative checkpoint.dir means the directory the run was started from, also for a resume
    started elsewhere."""
    if config.checkpoint.enabled and spec.checkpoints is None:
        from scaletrain.checkpoint.location import checkpoint_location

        spec.checkpoints = checkpoint_location(config, spec.run_id, spec.run_dir)


def _preflight(config: JobConfig, spec: Any, checkpoint_bytes: int | None = None) -> list[Any]:
    """Every pre-flight check of this launch (raises PreflightError on the first refusal)."""
    from scaletrain.preflight import raise_on_failure, run_preflight
    from scaletrain.tracking.tracker_handle import recorded_run

    recorded = recorded_run(spec.run_dir, config) or {}
    checks = run_preflight(config, spec, checkpoint_bytes=checkpoint_bytes,
                           tracking_uri=recorded.get("uri"), recorded_run_id=recorded.get("run_id"))
    raise_on_failure(checks)
    return checks


def preflight(
    job: str | os.PathLike | dict[str, Any] | JobConfig, overrides: list[str] | tuple[str, ...] = (),
) -> list[Any]:
    """Only the pre-flight checks of a new run of ``job`` (``scaletrain check``): the task
    imports, the run directory, the checkpoint location (a probe written, read, listed and
    deleted), the disk for the checkpoints kept (from the model's shapes, built on the meta
    device), the MLflow store. Returns every check, failed ones included; changes nothing."""
    from scaletrain.preflight import Check, run_preflight, state_bytes_of_task
    from scaletrain.rundir import RunSpec
    from scaletrain.task import check_job_code

    config, search_path = resolve_job(job, overrides)
    check_job_code(config, search_path)
    spec = RunSpec.in_dir(config.model_dump(mode="json"), config.run_dir, python_path=search_path)
    _resolve_checkpoints(config, spec)
    size, size_check = None, []
    if config.kind == "task" and config.checkpoint.enabled and spec.checkpoints and "://" not in spec.checkpoints:
        started = time.perf_counter()
        try:
            size = state_bytes_of_task(config, search_path)
        except Exception as exc:  # the task's own code: say so, do not crash the check
            size_check = [Check("disk", True, f"not checked: building the model on the meta device "
                                f"failed ({type(exc).__name__}: {exc})", warning=True,
                                seconds=time.perf_counter() - started)]
    return run_preflight(config, spec, checkpoint_bytes=size, tidy=True) + size_check


def _run_attempt(
    config: JobConfig, spec: Any, launcher: Any, started_at: float, tracking_tags: dict | None,
    watch: Any = None, warm: Any = None,
) -> dict[str, Any]:
    from scaletrain.observe.goodput import goodput, rank0_figures
    from scaletrain.observe.telemetry import current as telemetry

    run_dir = Path(spec.run_dir)
    spec.write()  # what the workers, the metric shipper and `scaletrain resume` start from
    tracking = None
    if config.tracking.enabled and spec.node_rank == 0:  # the driver tracks the job
        from scaletrain.tracking.tracker_handle import TrackingSession

        tracking = TrackingSession(config, spec, launcher.name, tracking_tags, _launcher_log).start(warm)

    summary: dict[str, Any] = {
        "status": "running",
        "run_id": spec.run_id,
        "run_dir": spec.run_dir,
        "job": config.name,
        "engine": launcher.name,
        "strategy": config.scale.resolved_strategy,
        "world_size": config.scale.workers,
        "attempt": spec.attempt,
        "started_at": started_at,
        "mlflow_run_id": tracking.run_id if tracking else None,
    }
    if config.scale.node_range[1] > 1:
        summary["node_rank"] = spec.node_rank
    if watch is not None:
        summary["metrics_url"] = watch.endpoint.url
    telemetry().work("attempt", 1)
    telemetry().flush(force=True)
    rank0_before = rank0_figures(spec.telemetry_dir)
    try:
        # The local engine starts this node's share of the workers; Ray places all of them.
        result = launcher.launch(spec, config.scale.workers_per_node if config.scale.engine == "local"
                                 else config.scale.workers)
    except (ScaletrainError, KeyboardInterrupt) as exc:
        if watch is not None and (fired := watch.finish()):
            summary["alerts"] = fired
            stopper = watch.alerts.stopped_by
            if stopper is not None and isinstance(exc, RunPreempted) and exc.step is not None:
                summary["stopped_by"] = stopper.alert  # not a preemption: the job's own alert
                exc = RunPreempted(f"alert {stopper.alert} ({stopper.description})", exc.step, exc.checkpoint_step,
                                   exc.run_dir)
        preempted = isinstance(exc, RunPreempted)
        interrupted = preempted or isinstance(exc, (RunInterrupted, KeyboardInterrupt))
        summary.update(
            status="preempted" if preempted else "interrupted" if interrupted else "failed",
            error=str(exc) or type(exc).__name__,
            error_code=getattr(exc, "code", "ST-INTERRUPTED"),
            wall_time_s=round(time.time() - started_at, 3),
        )
        if not interrupted:
            telemetry().add("errors_total", 1, "attempt")
            telemetry().flush(force=True)
        if isinstance(exc, RunPreempted):
            summary.update(steps=exc.step, checkpoint_step=exc.checkpoint_step)
        elif (steps := getattr(exc, "steps", None)) is not None:  # a failed rank said how far it got
            summary["steps"] = steps
        _close(summary, run_dir, tracking, "KILLED" if interrupted else "FAILED", Redactor.for_config(spec.job))
        if "stopped_by" in summary:
            raise exc from None
        raise
    if watch is not None and (fired := watch.finish()):
        summary["alerts"] = fired
    first_step_at = result.get("first_step_at")
    summary.update(
        status="finished",
        steps=result["steps"],
        strategy=result.get("strategy") or summary["strategy"],
        resumed_from_step=result.get("resumed_from_step"),
        restarts=result.get("restarts", 0),
        checkpoint_step=result.get("last_checkpoint_step"),
        train=result["train"],
        eval=result["eval"],
        wall_time_s=round(time.time() - started_at, 3),
        time_to_first_step_s=round(first_step_at - started_at, 3) if first_step_at else None,
        weights_sha256=result["weights_sha256"],
        # the driver's; none when the job wrote none (a script's weights are its own business)
        weights=str(run_dir / WEIGHTS_FILE) if spec.node_rank == 0 and (run_dir / WEIGHTS_FILE).exists() else None,
        logs=str(spec.logs_dir),
    )
    spent = goodput(rank0_before, rank0_figures(spec.telemetry_dir), summary["steps"], started_at,
                    summary["wall_time_s"], spec.request_id)
    if spent is not None:
        summary["goodput"] = spent
    _close(summary, run_dir, tracking, "FINISHED", Redactor.for_config(spec.job))
    return summary


def _write_redacted_job(config: JobConfig, path: Path) -> None:
    from scaletrain.rundir.atomic import write_text_atomic
    from scaletrain.tracking.redact import Redactor

    raw = config.model_dump(mode="json")
    redacted = Redactor.for_config(raw).value("", raw)
    write_text_atomic(path, job_to_yaml(JobConfig.model_validate(redacted)))


def _close(
    summary: dict[str, Any], run_dir: Path, tracking: Any, status: str, redactor: Redactor
) -> None:
    """summary.json, then the last metrics, the run's artifacts and final status in MLflow.
    The summary is redacted in place: its error text can quote a secret, and it is uploaded."""
    from scaletrain.rundir.atomic import write_text_atomic
    from scaletrain.tracking.mlflow_model import MLFLOW_MODEL_DIR

    if tracking is not None:
        summary["mlflow_run_id"] = tracking.finish_opening()
    summary.update(redactor.value("", summary))
    write_text_atomic(run_dir / SUMMARY_FILE, json.dumps(summary, indent=2))
    if tracking is None:
        return
    from scaletrain.observe.exporter import job_totals
    from scaletrain.rundir import TELEMETRY_DIR

    # The job's figures as it ends (errors and units of work by kind, restarts, stalls, goodput).
    totals = job_totals(run_dir / LOGS_DIR / TELEMETRY_DIR)
    for key, value in (summary.get("goodput") or {}).items():
        totals["system/goodput" if key == "ratio" else f"system/goodput/{key}"] = value
    tracking.close(summary, status, totals, [
        (run_dir / SUMMARY_FILE, None),
        (run_dir / RUN_CARD_FILE, None),
        (run_dir / LOGS_DIR, "logs"),
        (run_dir / WEIGHTS_FILE, "weights"),
        (run_dir / MLFLOW_MODEL_DIR, "model"),
    ])
