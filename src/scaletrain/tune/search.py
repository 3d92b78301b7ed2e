"""`scaletrain tune`: a hyperparameter search on Ray Tune where every trial is a full job.

Each trial runs ``scaletrain run`` (or, when Tune retries it, ``scaletrain resume`` from its
own verified checkpoint) as a child process, with the trial's values as ``--set`` overrides,
and reports the search metric to Tune each time the job writes it to ``metrics.jsonl``. ASHA
stops a trial by ending its Tune actor; the child then gets SIGTERM and stops at a checkpoint,
like any preempted job. MLflow: one parent run for the search, the trials' runs nested under
it (``mlflow.parentRunId``), the best one tagged. Everything lives in one search directory:

    <run_dir>/tune/<job name>/<search id>/
        job.yaml         the job searched, redacted (secret values read ***)
        search.json      what was asked (job, space, options; --set values redacted)
        ray/             Ray Tune's experiment state
        trials/<trial>/  the trial's scaletrain run directory (runs/...), its job (unredacted:
                         the trial runs it; mode 0600, like spec.json), console.log, stdout.log
        best_job.yaml    the best trial's job, redacted (secrets come from the environment)
        results.json     one row per trial

The search's own files are written atomically and readable by their owner only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

from scaletrain.config import job_to_yaml
from scaletrain.config.loading import parse_job
from scaletrain.config.schema import JobConfig
from scaletrain.errors import ConfigError, SearchInterrupted
from scaletrain.rundir import SUMMARY_FILE, TELEMETRY_DIR, TRACKING_TAGS_ENV
from scaletrain.rundir.atomic import write_text_atomic
from scaletrain.tracking.redact import Redactor
from scaletrain.tracking.search_run import SearchRun
from scaletrain.tune.options import SearchOptions
from scaletrain.tune.space import Dimension, load_space
from scaletrain.tune.trial import overrides, trial_class

__all__ = ["SearchOptions", "run_search", "TRACKING_TAGS_ENV", "SearchInterrupted"]

log = logging.getLogger("scaletrain_launcher.tune")


def search_root(job: JobConfig) -> Path:
    """Absolute: Ray Tune takes a relative storage path for a URI without a scheme."""
    return (Path(job.run_dir).expanduser() / "tune" / job.name).resolve()


def run_search(job_file: str, space_file: str, options: SearchOptions, resume: bool = False) -> dict[str, Any]:
    """Run (or resume) a search; returns its summary (trials, best, best job file)."""
    from scaletrain.api import resolve_job

    job, search_path = resolve_job(job_file, options.overrides)
    space = load_space(space_file, job, search_path)
    options.check(space)
    _check_metric_is_produced(job, options.metric)
    root = search_root(job)
    redactor = Redactor.for_config(job.model_dump(mode="json"))
    directory = _latest_unfinished(root) if resume else None
    if resume and directory is None:
        raise ConfigError(f"no search of job '{job.name}' to resume under {root}; run without --resume")
    if directory is None:
        directory = root / time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        directory.mkdir(parents=True)
        write_text_atomic(directory / "job.yaml", _redacted_yaml(job, redactor))
        write_text_atomic(directory / "search.json", redactor.json({
            "job_file": str(Path(job_file).resolve()), "space": [asdict(d) for d in space],
            "options": asdict(options), "search_path": search_path, "finished": False,
            "trace_id": uuid.uuid4().hex,  # the search's, kept by --resume
        }, indent=2))
    from scaletrain.launch.ray.cluster import import_ray, ray_session

    ray = import_ray(local_instance=(options.address or os.environ.get("RAY_ADDRESS")) is None)
    parent = SearchRun(job, directory, {
        "metric": options.metric, "mode": options.mode, "trials": options.trials,
        "max_concurrent": options.max_concurrent, "search": options.search,
        "scheduler": options.scheduler,
        "space": json.dumps({d.key: {d.kind: list(d.values)} for d in space}),
    })
    from scaletrain.observe.exporter import observed
    from scaletrain.tracking.logs import LogContext, route_loggers_to_file
    from scaletrain.tune.observe import SEARCH_LOGGER, TUNE_LOG, SearchIdentity

    state = json.loads((directory / "search.json").read_text(encoding="utf-8"))
    identity = SearchIdentity(f"tune-{job.name}-{directory.name}", directory / "logs" / TELEMETRY_DIR,
                              state.get("trace_id") or uuid.uuid4().hex)
    context = LogContext(identity.run_id, identity.trace_id, None, identity.request_id)
    restore_log = route_loggers_to_file((SEARCH_LOGGER,), directory / "logs" / TUNE_LOG, logging.INFO,
                                        redactor=redactor, context=context)
    try:
        # The search's own figures (trials by status, failed trials) on its endpoint, its alerts;
        # Tune prints its own progress tables, ours is the table at the end (--json stays one object).
        with observed(job, identity, "tune", logging.getLogger(SEARCH_LOGGER)) as watch, \
                ray_session(ray, options.address, directory / "logs", redactor=redactor, context=context), \
                open(directory / "logs" / "tune-console.log", "a", encoding="utf-8") as tune_console, \
                contextlib.redirect_stdout(tune_console), contextlib.redirect_stderr(tune_console):
            grid = _tune(ray, job, space, options, directory, parent.run_id, resume, search_path)
            alerts = watch.finish() if watch is not None else []
            metrics_url = watch.endpoint.url if watch is not None else None
    finally:
        restore_log()
    _wait_for_stopped_trials(directory, job.recovery.grace_period_s + 30)
    if _interrupted(directory, _expected_trials(space, options)):
        # Ctrl-C: Tune stopped the trials (their jobs at checkpoints) and saved its state.
        parent.interrupted()
        raise SearchInterrupted(
            f"the search was interrupted; its state is in {directory}; continue with: "
            f"scaletrain tune {job_file} --space {space_file} --resume"
        )
    rows = _rows(grid, options, directory)
    best = _best(rows, options)
    summary = {"search_dir": str(directory), "metric": options.metric, "mode": options.mode,
               "trials": rows, "best": best, "mlflow_parent_run_id": parent.run_id,
               "trace_id": identity.trace_id, "metrics_url": metrics_url, "alerts": alerts}
    if best is not None:
        best_job = parse_job(job.model_dump(mode="json"), overrides(best["config"]))
        write_text_atomic(directory / "best_job.yaml", _redacted_yaml(best_job, redactor))
        summary["best_job"] = str(directory / "best_job.yaml")
    summary = redactor.value("", summary)
    write_text_atomic(directory / "results.json", json.dumps(summary, indent=2))
    write_text_atomic(directory / "search.json", json.dumps({**state, "finished": True}, indent=2))
    parent.finish(best, rows, options.metric)
    return summary


def _redacted_yaml(job: JobConfig, redactor: Redactor) -> str:
    """The job as YAML with its secret values masked (what the run directory's job.yaml is)."""
    return job_to_yaml(JobConfig.model_validate(redactor.value("", job.model_dump(mode="json"))))


def _expected_trials(space: list[Dimension], options: SearchOptions) -> int:
    count = options.trials
    for dimension in space:
        if dimension.kind == "grid":
            count *= len(dimension.values)
    return count


def _interrupted(directory: Path, expected: int) -> bool:
    """Did the search end before every trial did (Ctrl-C)? Read from Tune's saved state."""
    from ray.tune import ExperimentAnalysis

    try:
        trials = ExperimentAnalysis(str(directory / "ray" / "search")).trials
    except Exception:
        return False
    ended = [t for t in trials if str(t.status) in ("TERMINATED", "ERROR")]
    return len(ended) < expected


def _check_metric_is_produced(job: JobConfig, metric: str) -> None:
    if metric.startswith("eval/") and not job.train.eval_every:
        raise ConfigError(
            f"--metric {metric} needs evaluations during training for the scheduler to compare "
            "trials: set train.eval_every (e.g. --set train.eval_every=50)"
        )


def _latest_unfinished(root: Path) -> Path | None:
    if not root.exists():
        return None
    for directory in sorted((p for p in root.iterdir() if p.is_dir()), reverse=True):
        try:
            if not json.loads((directory / "search.json").read_text(encoding="utf-8"))["finished"]:
                return directory
        except (OSError, ValueError, KeyError):
            continue
    return None


def _tune(ray: Any, job: JobConfig, space: list[Dimension], options: SearchOptions, directory: Path,
          parent_run_id: str | None, resume: bool, search_path: list[str]) -> Any:
    from ray import tune

    from scaletrain.tune.observe import SearchFigures

    storage = str(directory / "ray")
    trainable = tune.with_resources(tune.with_parameters(
        trial_class(), job=job.model_dump(mode="json"), directory=str(directory),
        metric=options.metric, parent_run_id=parent_run_id, search_path=search_path,
        grace_s=job.recovery.grace_period_s,
    ), _trial_resources(ray, job))
    if resume and tune.Tuner.can_restore(os.path.join(storage, "search")):
        tuner = tune.Tuner.restore(os.path.join(storage, "search"), trainable, resume_errored=True)
        return tuner.fit()
    scheduler = None
    if options.scheduler == "asha":
        from ray.tune.schedulers import ASHAScheduler

        evals = _reports_per_trial(job, options.metric)
        scheduler = ASHAScheduler(max_t=max(1, evals), grace_period=1, reduction_factor=2)
    search_alg = None
    if options.search == "optuna":
        try:
            from ray.tune.search.optuna import OptunaSearch
        except ImportError:
            from scaletrain.errors import MissingExtraError

            raise MissingExtraError("--search optuna needs Optuna: pip install 'scaletrain[ray]'") from None
        search_alg = OptunaSearch(seed=job.seed)
    tuner = tune.Tuner(
        trainable,
        param_space={d.key: d.to_ray() for d in space},
        tune_config=tune.TuneConfig(
            metric=options.metric, mode=options.mode, num_samples=options.trials,
            max_concurrent_trials=options.max_concurrent, scheduler=scheduler, search_alg=search_alg,
        ),
        run_config=tune.RunConfig(
            name="search", storage_path=storage,
            failure_config=tune.FailureConfig(max_failures=options.max_failures),
            verbose=0, callbacks=[SearchFigures()],
        ),
    )
    return tuner.fit()


def _trial_resources(ray: Any, job: JobConfig) -> dict[str, float]:
    """What one trial reserves: a CPU for its actor, and on a cluster with GPUs one GPU per
    worker of its job (the job runs as local workers on the actor's node, on those GPUs only)."""
    resources = {"cpu": 1.0}
    if job.scale.engine == "local" and ray.cluster_resources().get("GPU", 0) >= 1:
        resources["gpu"] = float(job.scale.workers)
    return resources


def _reports_per_trial(job: JobConfig, metric: str) -> int:
    """How many times a full trial reports the metric (ASHA's max_t)."""
    steps = job.train.max_steps
    if steps is None:  # epochs: count from the task's data at run time; a generous bound
        return 1000
    if metric.startswith("eval/"):
        if not job.train.eval_every:  # evaluated once, at the end
            return 1
        every = job.train.eval_every
    else:
        every = job.train.log_every
    return steps // every + (1 if steps % every else 0)


def _wait_for_stopped_trials(directory: Path, timeout_s: float) -> None:
    """Trials the scheduler stopped are still writing their checkpoint and summary (their job
    got SIGTERM, as in a preemption): wait for them, within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    for run_dir in sorted(p.parent for p in directory.glob("trials/*/runs/*/*/spec.json")):
        while not (run_dir / SUMMARY_FILE).exists() and time.monotonic() < deadline:
            time.sleep(0.2)


def _rows(grid: Any, options: SearchOptions, directory: Path) -> list[dict[str, Any]]:
    rows = []
    for result in grid:
        metrics = result.metrics or {}
        trial_id = metrics.get("trial_id") or Path(str(result.path)).name
        trial_dir = directory / "trials" / trial_id
        summary = {}
        found = sorted(trial_dir.glob("runs/*/*/summary.json"))
        if found:
            summary = json.loads(found[-1].read_text(encoding="utf-8"))
        status = "failed" if result.error else (
            "finished" if summary.get("status") == "finished" else "pruned"
        )
        rows.append({
            "trial": trial_id,
            "config": result.config,
            "metric": metrics.get(options.metric),
            "reports": metrics.get("training_iteration"),
            "status": status,
            "run_dir": summary.get("run_dir"),
            "mlflow_run_id": summary.get("mlflow_run_id"),
            "error": str(result.error).strip().splitlines()[-1][:300] if result.error else None,
        })
    return rows


def _best(rows: list[dict[str, Any]], options: SearchOptions) -> dict[str, Any] | None:
    """The best trial among those that finished (a pruned trial's metric is from fewer steps)."""
    done = [r for r in rows if r["status"] == "finished" and r["metric"] is not None]
    if not done:
        return None
    pick = min if options.mode == "min" else max
    return pick(done, key=lambda r: r["metric"])
