"""Commands that check a job rather than train it for its result: ``verify-resume`` (does it
resume exactly?), ``validate`` (is the file right?), ``check`` (can it run here?), ``schema``.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer

from scaletrain.cli.app import (
    AddressOpt,
    EngineOpt,
    JobArg,
    OutcomeJsonOpt,
    ResultJsonOpt,
    SetOpt,
    app,
    scale_overrides,
    user_errors,
)
from scaletrain.cli.train import preflight_only


@app.command("verify-resume")
@user_errors
def verify_resume(
    job: JobArg,
    set_: SetOpt = None,
    steps: Annotated[int, typer.Option(help="steps to train; the kill comes at 3/4, the resume from 1/2")] = 20,
    as_json: ResultJsonOpt = False,
) -> None:
    """Check that a job resumes exactly: train, kill a worker, resume, compare final weights."""
    from scaletrain.verify_resume import verify_resume as check

    outcome = check(job, set_ or [], steps, announce=lambda line: typer.echo(line, err=True))
    if as_json:
        typer.echo(json.dumps(outcome))
    elif outcome["passed"]:
        typer.echo(
            f"PASS: resumed from step {outcome['resumed_from_step']} after a kill at step "
            f"{outcome['killed_at_step']}; final weights match bit for bit ({outcome['resumed_sha256'][:16]})"
        )
    else:
        typer.echo(f"FAIL: {outcome['problem']}")
    if not outcome["passed"]:
        raise typer.Exit(1)


@app.command()
@user_errors
def validate(job: JobArg, set_: SetOpt = None) -> None:
    """Check a job file (and that its task imports); print the resolved job."""
    from scaletrain.api import resolve_job
    from scaletrain.config import job_to_yaml
    from scaletrain.task import check_job_code, check_task_args, resolve_task_factory

    config, search_path = resolve_job(job, set_ or [])
    check_job_code(config, search_path)
    if config.task is not None:
        factory = resolve_task_factory(config.task.target, search_path)
        check_task_args(factory, config.task.args, config.task.target)
    elif config.loop is not None:
        from scaletrain.runners.loop import resolve_loop

        resolve_loop(config.loop.target, search_path)
    typer.echo(job_to_yaml(config), nl=False)


@app.command()
def check(
    job: JobArg,
    set_: SetOpt = None,
    engine: EngineOpt = None,
    address: AddressOpt = None,
    as_json: OutcomeJsonOpt = False,
) -> None:
    """Pre-flight a job, changing nothing: the task imports, the run directory and the
    checkpoint location can be written (a probe is written, read, listed and deleted), the
    disk holds the checkpoints kept, the MLflow store takes this user's runs."""
    preflight_only(job, scale_overrides(set_, engine, address), as_json)


@app.command()
def schema() -> None:
    """Print the JSON Schema of job files (for editor completion and validation)."""
    from scaletrain.config import job_schema

    typer.echo(json.dumps(job_schema(), indent=2))
