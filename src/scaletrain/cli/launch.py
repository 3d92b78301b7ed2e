"""``scaletrain launch train.py -- ARGS``: a script written for torchrun, run unchanged, with
restarts, per-rank JSON logs, a hang check, the root cause of a failure and one MLflow run
(launch/script_worker.py says what each worker does)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from scaletrain.cli.app import OutcomeJsonOpt, SetOpt, app
from scaletrain.cli.train import NodeRankOpt, NodesOpt, RdzvEndpointOpt, _run_and_report
from scaletrain.errors import ConfigError


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def launch(
    ctx: typer.Context,
    script: Annotated[str, typer.Argument(help="the script, as you would give it to torchrun",
                                          show_default=False, metavar="SCRIPT")],
    workers: Annotated[int, typer.Option("--workers", "-n", help="processes on this machine "
                                         "(torchrun's --nproc-per-node)", min=1)] = 1,
    max_restarts: Annotated[Optional[int], typer.Option(
        "--max-restarts", help="restart every worker up to K times after a failure or a hang",
        min=0, show_default=False)] = None,
    job: Annotated[Optional[str], typer.Option(
        "--job", help="a YAML file with further job settings (tracking, recovery, scale, name)",
        show_default=False)] = None,
    nodes: NodesOpt = None,
    node_rank: NodeRankOpt = 0,
    rdzv_endpoint: RdzvEndpointOpt = None,
    set_: SetOpt = None,
    as_json: OutcomeJsonOpt = False,
) -> None:
    """Run a torchrun script unchanged: `scaletrain launch --workers 2 train.py -- --lr 0.1`."""
    started_at = time.time()
    from scaletrain.api import run as run_job

    def start() -> dict[str, Any]:
        settings = script_job(script, list(ctx.args), job)
        overrides = [f"scale.workers={workers}", *(set_ or [])]
        if max_restarts is not None:
            overrides.append(f"recovery.max_restarts={max_restarts}")
        if nodes:
            overrides.append(f"scale.nodes={json.dumps(nodes)}")
        if rdzv_endpoint:
            overrides.append(f"scale.rdzv_endpoint={json.dumps(rdzv_endpoint)}")
        return run_job(settings, overrides, started_at=started_at, node_rank=node_rank)

    _run_and_report(start, as_json)


def script_job(script: str, args: list[str], job_file: str | None) -> dict[str, Any]:
    """The job of a script: the job file's settings, the script and its arguments."""
    from scaletrain.config.loading import read_job_mapping

    path = Path(script)
    if not path.is_file():
        raise ConfigError(f"script '{script}' not found; give the path of a Python file")
    if args and args[0] == "--":
        args = args[1:]
    settings = read_job_mapping(Path(job_file)) if job_file else {}
    kinds = [kind for kind in ("task", "loop", "script") if kind in settings]
    if kinds:
        raise ConfigError(f"--job: the file names its code ({kinds[0]}:); scaletrain launch runs the "
                          "script it is given: leave task:/loop:/script: out of it")
    if not job_file:
        settings["name"] = re.sub(r"[^\w.-]", "_", path.stem)[:100] or "script"
    settings["script"] = {"path": str(path), "args": args}
    return settings
