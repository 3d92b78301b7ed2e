"""The ``scaletrain`` typer app and what every command shares: the option types, and one way
to turn a user's mistake into one ``error: ...`` line and an exit code (``user_errors``).

Bad input ends with exit code 2; a failed run with exit code 1 (``ScaletrainError.exit_code``).
Command modules register on ``app``; nothing heavy is imported here (``--help`` stays fast).
"""

from __future__ import annotations

import contextlib
import enum
import json
from typing import Annotated, Iterator, Optional

import typer

from scaletrain import __version__
from scaletrain.errors import ConfigError, ScaletrainError
from scaletrain.quick_exit import exit_quickly

app = typer.Typer(
    name="scaletrain",
    help="Train a PyTorch job from one job file: one process, local workers, or a cluster.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

JobArg = Annotated[str, typer.Argument(help="the YAML job file", show_default=False, metavar="JOB")]
SetOpt = Annotated[
    Optional[list[str]],
    typer.Option("--set", "-s", help="override a job key: --set optim.lr=3e-4 (repeatable)"),
]
# --json, in the three wordings the commands have: a table, a run's outcome, a check's outcome.
JsonOpt = Annotated[bool, typer.Option("--json", help="JSON instead of a table")]
OutcomeJsonOpt = Annotated[
    bool, typer.Option("--json", help="print one JSON object with the outcome on stdout")
]
ResultJsonOpt = Annotated[bool, typer.Option("--json", help="print the outcome as JSON")]


class Engine(str, enum.Enum):
    local = "local"
    ray = "ray"


EngineOpt = Annotated[
    Optional[Engine],
    typer.Option("--engine", help="who starts the workers (sets scale.engine)", show_default=False),
]
MetricsPortOpt = Annotated[
    Optional[int],
    typer.Option("--metrics-port", help="serve the job's live figures for Prometheus on this port "
                 "(sets observability.port; default: a free one, said in the log)", min=0, max=65535,
                 show_default=False),
]
AddressOpt = Annotated[
    Optional[str],
    typer.Option(
        "--address",
        help="ray engine: the cluster to join, e.g. 10.0.0.5:6379 (sets scale.address; "
        "default RAY_ADDRESS, else a local Ray instance)",
        show_default=False,
    ),
]


def scale_overrides(set_: list[str] | None, engine: Engine | None, address: str | None,
                    metrics_port: int | None = None) -> list[str]:
    """The --set overrides, with --engine, --address and --metrics-port turned into the keys they set."""
    overrides = list(set_ or [])
    if metrics_port is not None:
        overrides.append(f"observability.port={metrics_port}")
    if engine:
        overrides.append(f"scale.engine={engine.value}")
    if address:
        overrides.append(f"scale.address={json.dumps(address)}")
    return overrides


def _fail(exc: ScaletrainError) -> None:
    if isinstance(exc, ConfigError):
        prefix = f"{exc.source}: " if exc.source else ""
        for problem in exc.problems:  # one line each, whatever a file name or a key holds
            typer.echo(" ".join(f"error: {prefix}{problem}".splitlines()), err=True)
    else:
        typer.echo(f"error: {exc}", err=True)
    raise typer.Exit(exc.exit_code)


@contextlib.contextmanager
def _user_errors(interrupted: str | None, value_errors: bool) -> Iterator[None]:
    try:
        yield
    except ScaletrainError as exc:
        _fail(exc)
    except ValueError as exc:
        if not value_errors:
            raise
        _fail(ConfigError(str(exc)))
    except KeyboardInterrupt:
        if interrupted is None:
            raise
        typer.echo(interrupted, err=True)
        raise typer.Exit(130) from None


def user_errors(fn=None, /, *, interrupted: str | None = None, value_errors: bool = False):
    """A ScaletrainError ends the command with its ``error:`` line(s) and exit code.

    ``interrupted``: Ctrl-C prints this line and exits 130 (else it propagates).
    ``value_errors``: a ValueError is bad input too (a ConfigError, exit 2).
    As ``@user_errors`` on a command, or ``with user_errors(...):`` around the calls that can
    fail, where the rest of the command must not be covered (Ctrl-C while printing).
    """
    handler = _user_errors(interrupted, value_errors)
    return handler(fn) if fn is not None else handler


def _version(value: bool) -> None:
    if value:
        typer.echo(f"scaletrain {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="show the version")
    ] = False,
) -> None:
    """scaletrain: one job file, from one process to many."""


def entrypoint() -> None:
    try:
        code = app()
    except SystemExit as exc:  # click ends every command this way
        code = exc.code
    exit_quickly(code)
