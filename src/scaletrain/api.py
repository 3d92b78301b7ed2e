"""``scaletrain.run(job)``: the Python API. The CLI is a thin shell around it."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from scaletrain.config import job_to_yaml, load_job, parse_job
from scaletrain.config.schema import JobConfig
from scaletrain.errors import RunInterrupted, ScaletrainError

__all__ = ["run", "resolve_job"]


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
        config = load_job(job, overrides)
        search_path.append(str(Path(job).resolve().parent))
    return config, search_path


def run(
    job: str | os.PathLike | dict[str, Any] | JobConfig,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    started_at: float | None = None,
) -> dict[str, Any]:
    """Train a job (a YAML path, a mapping or a JobConfig) and return its summary.

    The summary is also written to ``summary.json`` in the run directory. Raises a
    ScaletrainError (ConfigError, TaskError, WorkerFailedError...) with a user-facing message.
    """
    from scaletrain.checkpoint.atomic import write_text_atomic
    from scaletrain.distributed.device import threads_per_worker
    from scaletrain.launch import launcher_for
    from scaletrain.launch.spec import RunSpec
    from scaletrain.launch.worker import WEIGHTS_FILE
    from scaletrain.task import check_task_target

    started_at = started_at or time.time()
    config, search_path = resolve_job(job, overrides)
    # Fail before any worker starts if the task does not exist or its args do not fit.
    check_task_target(config.task.target, config.task.args, search_path)

    workers = config.scale.workers
    spec = RunSpec.in_dir(
        config.model_dump(mode="json"),
        config.run_dir,
        python_path=search_path,
        threads=threads_per_worker(workers, config.scale.threads_per_worker),
    )
    run_dir = Path(spec.run_dir)
    spec.logs_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(run_dir / "job.yaml", job_to_yaml(config))

    launcher = launcher_for(config)
    summary: dict[str, Any] = {
        "status": "running",
        "run_id": spec.run_id,
        "run_dir": spec.run_dir,
        "job": config.name,
        "engine": launcher.name,
        "strategy": config.scale.resolved_strategy,
        "world_size": workers,
        "started_at": started_at,
    }
    try:
        result = launcher.launch(spec, workers)
    except RunInterrupted as exc:
        summary.update(status="interrupted", error=str(exc), wall_time_s=time.time() - started_at)
        write_text_atomic(run_dir / "summary.json", json.dumps(summary, indent=2))
        raise
    except ScaletrainError as exc:
        summary.update(status="failed", error=str(exc), wall_time_s=time.time() - started_at)
        write_text_atomic(run_dir / "summary.json", json.dumps(summary, indent=2))
        raise
    except KeyboardInterrupt:
        summary.update(status="interrupted", wall_time_s=time.time() - started_at)
        write_text_atomic(run_dir / "summary.json", json.dumps(summary, indent=2))
        raise
    first_step_at = result.get("first_step_at")
    summary.update(
        status="finished",
        steps=result["steps"],
        train=result["train"],
        eval=result["eval"],
        wall_time_s=round(time.time() - started_at, 3),
        time_to_first_step_s=round(first_step_at - started_at, 3) if first_step_at else None,
        weights_sha256=result["weights_sha256"],
        weights=str(run_dir / WEIGHTS_FILE),
        logs=str(spec.logs_dir),
    )
    write_text_atomic(run_dir / "summary.json", json.dumps(summary, indent=2))
    return summary
