"""``scaletrain tune``: a hyperparameter search on Ray Tune (Ray is imported only when it runs)."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from scaletrain.cli.app import AddressOpt, JobArg, OutcomeJsonOpt, SetOpt, app, user_errors
from scaletrain.cli.render import print_trials


@app.command()
def tune(
    job: JobArg,
    space: Annotated[str, typer.Option("--space", help="the search space file (YAML)", show_default=False)],
    trials: Annotated[int, typer.Option("--trials", help="how many trials to sample")] = 8,
    max_concurrent: Annotated[int, typer.Option("--max-concurrent", help="trials at once")] = 1,
    metric: Annotated[str, typer.Option("--metric", help="what to optimise: eval/<name> or train/<name>")] = "eval/loss",
    mode: Annotated[str, typer.Option("--mode", help="min or max")] = "min",
    search: Annotated[str, typer.Option("--search", help="random or optuna (TPE)")] = "random",
    scheduler: Annotated[str, typer.Option("--scheduler", help="asha (stop weak trials early) or none")] = "asha",
    resume: Annotated[bool, typer.Option("--resume", help="continue this job's interrupted search")] = False,
    address: AddressOpt = None,
    set_: SetOpt = None,
    as_json: OutcomeJsonOpt = False,
) -> None:
    """Search hyperparameters on Ray Tune: every trial is a full job with its own checkpoints."""
    from scaletrain.tune.search import SearchOptions, run_search

    options = SearchOptions(
        trials=trials, max_concurrent=max_concurrent, metric=metric, mode=mode, search=search,
        scheduler=scheduler, address=address, overrides=list(set_ or []),
    )
    with user_errors(interrupted="interrupted; continue with: scaletrain tune ... --resume"):
        summary = run_search(job, space, options, resume=resume)
    if as_json:
        typer.echo(json.dumps(summary))
        return
    print_trials(summary)
