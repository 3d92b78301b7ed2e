"""``scaletrain checkpoints ls|verify``: what a run or a checkpoint location holds, and whether
every file still matches its manifest (exit 1 if not)."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from scaletrain.cli.app import JsonOpt, app, user_errors
from scaletrain.cli.render import print_checkpoints

checkpoints_app = typer.Typer(help="List and verify checkpoints.", no_args_is_help=True)
app.add_typer(checkpoints_app, name="checkpoints")
PathArg = Annotated[
    str,
    typer.Argument(
        help="a run directory, a checkpoint location (path or s3://...) or one checkpoint",
        metavar="PATH",
    ),
]


@checkpoints_app.command("ls")
def checkpoints_ls(path: PathArg, as_json: JsonOpt = False) -> None:
    """Checkpoints at PATH: step, size, metrics, committed or not and why (no hashing)."""
    _checkpoint_rows(path, verify=False, as_json=as_json)


@checkpoints_app.command("verify")
def checkpoints_verify(path: PathArg, as_json: JsonOpt = False) -> None:
    """Hash every file of every checkpoint at PATH against its manifest; exit 1 if any fails."""
    rows = _checkpoint_rows(path, verify=True, as_json=as_json)
    if not rows or any(row["status"] != "verified" for row in rows):
        raise typer.Exit(1)


@user_errors
def _checkpoint_rows(path: str, verify: bool, as_json: bool) -> list[dict[str, Any]]:
    from scaletrain.checkpoint.inspect import describe_checkpoints

    rows = describe_checkpoints(path, verify)
    if as_json:
        typer.echo(json.dumps(rows))
    else:
        print_checkpoints(rows, path)
    return rows
