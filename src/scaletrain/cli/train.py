"""Training commands: ``run`` a job and ``resume`` a run, and how their outcome is reported.

Ctrl-C while a job trains prints ``interrupted`` (exit 130); with ``--json`` a failed or
preempted run still prints its outcome on stdout (``scaletrain resume`` needs the run directory).
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
from collections.abc import Iterator
from typing import Annotated, Any, Callable, Optional

import typer

from scaletrain.cli.app import (
    AddressOpt,
    EngineOpt,
    JobArg,
    MetricsPortOpt,
    OutcomeJsonOpt,
    SetOpt,
    app,
    scale_overrides,
    user_errors,
)
from scaletrain.cli.render import print_checks, print_summary
from scaletrain.errors import RunInterrupted, RunPreempted, ScaletrainError

NodesOpt = Annotated[
    Optional[str],
    typer.Option("--nodes", help="local engine on several machines: a count, or MIN:MAX to go on "
                 "with fewer after losing some (sets scale.nodes)", show_default=False),
]
NodeRankOpt = Annotated[
    int,
    typer.Option("--node-rank", help="several machines: this machine's rank; 0 is the driver "
                 "(hosts the rendezvous, tracks the run), start it first", min=0),
]
RdzvEndpointOpt = Annotated[
    Optional[str],
    typer.Option("--rdzv-endpoint", help="several machines: HOST:PORT of node 0, where it listens "
                 "for the others (sets scale.rdzv_endpoint)", show_default=False),
]


@app.command()
def run(
    job: JobArg,
    set_: SetOpt = None,
    engine: EngineOpt = None,
    address: AddressOpt = None,
    nodes: NodesOpt = None,
    node_rank: NodeRankOpt = 0,
    rdzv_endpoint: RdzvEndpointOpt = None,
    metrics_port: MetricsPortOpt = None,
    as_json: OutcomeJsonOpt = False,
    preflight: Annotated[bool, typer.Option(
        "--preflight", help="only the pre-flight checks (as `scaletrain check`): train nothing")] = False,
) -> None:
    """Train a job: in this process for one worker, as local workers for more, or on Ray."""
    started_at = time.time()
    from scaletrain.api import run as run_job

    overrides = scale_overrides(set_, engine, address, metrics_port)
    if nodes:
        overrides.append(f"scale.nodes={json.dumps(nodes)}")
    if rdzv_endpoint:
        overrides.append(f"scale.rdzv_endpoint={json.dumps(rdzv_endpoint)}")
    if preflight:
        preflight_only(job, overrides, as_json)
        return
    _run_and_report(
        lambda: run_job(job, overrides, started_at=started_at, node_rank=node_rank), as_json
    )


@app.command()
def resume(
    target: Annotated[
        str,
        typer.Argument(
            help="a run directory, a run id under ./runs, or one checkpoint folder of a run",
            metavar="RUN|CHECKPOINT",
        ),
    ],
    set_: SetOpt = None,
    engine: EngineOpt = None,
    address: AddressOpt = None,
    metrics_port: MetricsPortOpt = None,
    as_json: OutcomeJsonOpt = False,
) -> None:
    """Continue a stopped, failed or preempted run from its newest verified checkpoint."""
    started_at = time.time()
    from scaletrain.api import resume as resume_run

    overrides = scale_overrides(set_, engine, address, metrics_port)
    _run_and_report(lambda: resume_run(target, overrides, started_at=started_at), as_json)


def _run_and_report(start: Callable[[], dict[str, Any]], as_json: bool) -> None:
    with user_errors(interrupted="interrupted"):  # the run only, not the printing after
        try:
            with _stops_interrupt():
                summary = start()
        except ScaletrainError as exc:
            if as_json:
                typer.echo(json.dumps(_failed_outcome(exc)))
            raise
    if as_json:
        typer.echo(json.dumps(summary))
    elif summary.get("note"):  # nothing ran (a finished run resumed)
        typer.echo(summary["note"])
    else:
        print_summary(summary)


@contextlib.contextmanager
def _stops_interrupt() -> Iterator[None]:
    """SIGTERM or SIGUSR1 while the launcher starts up (before its workers' stop handling takes
    over) or winds down ends the run as interrupted, with its outcome and exit code, as Ctrl-C
    does, instead of killing the process without a word."""
    def interrupt(signum: int, frame: object) -> None:
        raise RunInterrupted(signal.Signals(signum).name, signum)

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _failed_outcome(exc: ScaletrainError) -> dict[str, Any]:
    outcome: dict[str, Any] = {"status": "failed", "error": str(exc), "code": exc.code}
    if isinstance(exc, RunPreempted):  # what `scaletrain resume` needs
        outcome.update(status="preempted", run_dir=exc.run_dir, steps=exc.step,
                       checkpoint_step=exc.checkpoint_step)
    return outcome


@user_errors
def preflight_only(job: str, overrides: list[str], as_json: bool) -> None:
    """``run --preflight`` and ``check``: the checks printed; exit 2 if one failed."""
    from scaletrain.api import preflight

    checks = preflight(job, overrides)
    print_checks(checks, as_json)
    if any(not c.ok for c in checks):
        raise typer.Exit(2)
