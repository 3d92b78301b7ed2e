"""Commands on tracked runs (the MLflow store): ``runs`` lists them, ``show`` one, ``report``
draws one, ``reproduce`` runs one again, ``ui`` opens the MLflow UI. MLflow is imported only by what they call."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from scaletrain.cli.app import JsonOpt, ResultJsonOpt, app, user_errors
from scaletrain.cli.render import print_runs

UriOpt = Annotated[
    Optional[str],
    typer.Option("--uri", help="tracking store or server (default: MLFLOW_TRACKING_URI, else ./mlflow.db)"),
]
RunArg = Annotated[str, typer.Argument(help="MLflow run id or scaletrain run id", metavar="RUN")]


def _tracking_uri(uri: str | None) -> str:
    from scaletrain.tracking.mlflow_run import resolve_tracking_uri

    return uri or resolve_tracking_uri()


@app.command()
@user_errors
def runs(
    experiment: Annotated[Optional[str], typer.Option("--experiment", "-e", help="only this experiment")] = None,
    limit: Annotated[int, typer.Option(help="newest N runs")] = 20,
    uri: UriOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """List tracked runs: status, steps, final loss, duration, git SHA."""
    from scaletrain.tracking.runs import list_runs

    rows = list_runs(_tracking_uri(uri), experiment, limit)
    if as_json:
        typer.echo(json.dumps(rows))
        return
    print_runs(rows)


@app.command()
@user_errors
def show(run_id: RunArg, uri: UriOpt = None) -> None:
    """Show one run: params, final metrics, artifacts, run card."""
    from scaletrain.tracking.runs import run_details

    typer.echo(json.dumps(run_details(_tracking_uri(uri), run_id), indent=2))


@app.command()
@user_errors
def report(
    run_id: RunArg,
    out: Annotated[Optional[Path], typer.Option(
        "--out", "-o", help="folder for report.html and its PNGs (default: reports/<run>)")] = None,
    attach: Annotated[bool, typer.Option(
        "--attach/--no-attach", help="also attach the report to the MLflow run (report/)")] = True,
    uri: UriOpt = None,
    as_json: ResultJsonOpt = False,
) -> None:
    """Write one self-contained HTML page (and PNGs) for a run or a tune search: loss and eval
    curves, speed per rank, restarts, checkpoints and alerts over time, the run card."""
    from scaletrain.run_report.build import write_report

    written = write_report(_tracking_uri(uri), run_id, out, attach=attach)
    if as_json:
        typer.echo(json.dumps(written))
        return
    where = f"; attached to MLflow run {written['mlflow_run_id']} as {written['artifact']}" if written["artifact"] else ""
    typer.echo(f"report: {written['report']} ({len(written['images'])} plots{where})")


@app.command()
@user_errors
def reproduce(
    run_id: RunArg,
    uri: UriOpt = None,
    set_: Annotated[Optional[list[str]], typer.Option(
        "--set", "-s", help="a value the tracking server's copy of the job has masked (***): "
        "--set task.args.api_token=... (repeatable; nothing else can be changed)")] = None,
    as_json: ResultJsonOpt = False,
) -> None:
    """Run a recorded job again (its recorded code, tracked in the store given); report what
    differs, then whether the weights match."""
    from scaletrain.reproduce import reproduce as reproduce_run

    outcome = reproduce_run(
        run_id, _tracking_uri(uri), announce=lambda line: typer.echo(line, err=True),
        overrides=list(set_ or []),
    )
    if as_json:
        outcome = {k: v for k, v in outcome.items() if k != "summary"}
        typer.echo(json.dumps(outcome))
        return
    if outcome["weights_match"] is None:
        typer.echo(f"final weights {outcome['weights_sha256']}: nothing to compare with (the original "
                   "run recorded no weights hash: no summary.json with one)")
    else:
        verdict = "match bit for bit" if outcome["weights_match"] else "DIFFER"
        typer.echo(f"final weights {verdict}: {outcome['weights_sha256']} (recorded {outcome['recorded_weights_sha256']})")
    if not outcome["weights_match"]:
        raise typer.Exit(1)


@app.command()
def ui(
    uri: UriOpt = None,
    port: Annotated[int, typer.Option(help="port on 127.0.0.1")] = 5000,
) -> None:
    """Open the MLflow UI on the tracking store, bound to 127.0.0.1."""
    import os
    import shutil

    from scaletrain.tracking.redact import redact_url

    # The mlflow next to this interpreter first: another one on PATH may be another install.
    beside = os.path.join(os.path.dirname(sys.executable), "mlflow")
    mlflow_bin = beside if os.path.exists(beside) else shutil.which("mlflow") or beside
    store = _tracking_uri(uri)
    typer.echo(f"MLflow UI for {redact_url(store)} at http://127.0.0.1:{port}", err=True)
    # The store goes in the environment, not on the command line every local user can read
    # (ps, /proc/*/cmdline): a database URI holds its password.
    os.execve(mlflow_bin, [mlflow_bin, "ui", "--host", "127.0.0.1", "--port", str(port)],  # noqa: S606  our venv's mlflow, fixed argv
              {**os.environ, "MLFLOW_BACKEND_STORE_URI": store})
