"""The ``scaletrain`` command. Thin: parse flags, call the API, print the outcome.

Bad input ends with one ``error: ...`` line and exit code 2; a failed run with exit code 1.
"""

from __future__ import annotations

import enum
import json
import sys
import time
from typing import Annotated, Any, Optional

import typer

from scaletrain import __version__
from scaletrain.errors import ConfigError, RunPreempted, ScaletrainError
from scaletrain.quick_exit import exit_quickly

app = typer.Typer(
    name="scaletrain",
    help="Train a PyTorch job from one job file: one process, local workers, or a cluster.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

JobArg = Annotated[str, typer.Argument(help="the YAML job file", show_default=False, metavar="JOB")]
OutcomeJsonOpt = Annotated[
    bool, typer.Option("--json", help="print one JSON object with the outcome on stdout")
]
SetOpt = Annotated[
    Optional[list[str]],
    typer.Option("--set", "-s", help="override a job key: --set optim.lr=3e-4 (repeatable)"),
]

class Engine(str, enum.Enum):
    local = "local"
    ray = "ray"


EngineOpt = Annotated[
    Optional[Engine],
    typer.Option("--engine", help="who starts the workers (sets scale.engine)", show_default=False),
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


def _scale_overrides(set_: list[str] | None, engine: Engine | None, address: str | None) -> list[str]:
    overrides = list(set_ or [])
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


@app.command()
def run(
    job: JobArg,
    set_: SetOpt = None,
    engine: EngineOpt = None,
    address: AddressOpt = None,
    nodes: NodesOpt = None,
    node_rank: NodeRankOpt = 0,
    rdzv_endpoint: RdzvEndpointOpt = None,
    as_json: OutcomeJsonOpt = False,
    preflight: Annotated[bool, typer.Option(
        "--preflight", help="only the pre-flight checks (as `scaletrain check`): train nothing")] = False,
) -> None:
    """Train a job: in this process for one worker, as local workers for more, or on Ray."""
    started_at = time.time()
    from scaletrain.api import run as run_job

    overrides = _scale_overrides(set_, engine, address)
    if nodes:
        overrides.append(f"scale.nodes={json.dumps(nodes)}")
    if rdzv_endpoint:
        overrides.append(f"scale.rdzv_endpoint={json.dumps(rdzv_endpoint)}")
    if preflight:
        _check(job, overrides, as_json)
        return
    _run_and_report(
        lambda: run_job(job, overrides, started_at=started_at, node_rank=node_rank), as_json
    )


def _run_and_report(start: Any, as_json: bool) -> None:
    try:
        summary = start()
    except ScaletrainError as exc:
        if as_json:
            outcome: dict[str, Any] = {"status": "failed", "error": str(exc)}
            if isinstance(exc, RunPreempted):  # what `scaletrain resume` needs
                outcome.update(status="preempted", run_dir=exc.run_dir, steps=exc.step,
                               checkpoint_step=exc.checkpoint_step)
            typer.echo(json.dumps(outcome))
        _fail(exc)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        raise typer.Exit(130) from None
    if as_json:
        typer.echo(json.dumps(summary))
    elif summary.get("note"):  # nothing ran (a finished run resumed)
        typer.echo(summary["note"])
    else:
        _print_summary(summary)


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
    as_json: OutcomeJsonOpt = False,
) -> None:
    """Continue a stopped, failed or preempted run from its newest verified checkpoint."""
    started_at = time.time()
    from scaletrain.api import resume as resume_run

    overrides = _scale_overrides(set_, engine, address)
    _run_and_report(lambda: resume_run(target, overrides, started_at=started_at), as_json)


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
    try:
        summary = run_search(job, space, options, resume=resume)
    except ScaletrainError as exc:
        _fail(exc)
    except KeyboardInterrupt:
        typer.echo("interrupted; continue with: scaletrain tune ... --resume", err=True)
        raise typer.Exit(130) from None
    if as_json:
        typer.echo(json.dumps(summary))
        return
    _print_trials(summary)


def _print_trials(summary: dict[str, Any]) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    keys = sorted({key for row in summary["trials"] for key in row["config"]})
    # Compact, the trial ids whole (Tune's trial folders and logs carry them); errors below.
    table = Table(title=f"{len(summary['trials'])} trials, {summary['metric']} ({summary['mode']})",
                  box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, title_justify="left",
                  padding=(0, 1, 0, 0))
    table.add_column("trial", no_wrap=True)
    for key in keys:  # the shortest ending of the dotted key that still tells them apart
        table.add_column(_short_key(key, keys), justify="right")
    table.add_column(summary["metric"], no_wrap=True, justify="right")
    table.add_column("reports", no_wrap=True, justify="right")
    table.add_column("status", no_wrap=True)
    best = (summary.get("best") or {}).get("trial")
    rows = sorted(summary["trials"], key=lambda r: r["trial"])
    for row in rows:
        value = row["metric"]
        table.add_row(
            row["trial"] + (" *" if row["trial"] == best else "  "),
            *(f"{row['config'].get(k):.4g}" if isinstance(row["config"].get(k), float) else str(row["config"].get(k)) for k in keys),
            f"{value:.4f}" if isinstance(value, (int, float)) else "-",
            str(row["reports"] or "-"),
            row["status"],
        )
    console = Console()
    console.print(table)
    for row in rows:
        if row.get("error"):
            console.print(f"trial {row['trial']} {row['status']}: {row['error']}", soft_wrap=True)
    if summary.get("best_job"):
        console.print(f"best trial * -> {summary['best_job']}  (scaletrain run {summary['best_job']})",
                      soft_wrap=True)
    else:
        console.print("no trial finished: no best job")


def _short_key(key: str, keys: list[str]) -> str:
    parts = key.split(".")
    for n in range(1, len(parts) + 1):
        tail = ".".join(parts[-n:])
        if sum(1 for other in keys if other == tail or other.endswith("." + tail)) == 1:
            return tail
    return key


@app.command()
def plan(
    job: Annotated[Optional[str], typer.Argument(help="a job file (or give --params / a transformer shape)", metavar="[JOB]", show_default=False)] = None,
    set_: SetOpt = None,
    params: Annotated[Optional[float], typer.Option("--params", help="what-if: a parameter count, e.g. 7e9")] = None,
    layers: Annotated[Optional[int], typer.Option("--layers", help="what-if transformer: layers")] = None,
    hidden: Annotated[Optional[int], typer.Option("--hidden", help="hidden size")] = None,
    heads: Annotated[Optional[int], typer.Option("--heads", help="attention heads")] = None,
    vocab: Annotated[int, typer.Option("--vocab", help="vocabulary size")] = 32000,
    seq: Annotated[int, typer.Option("--seq", help="sequence length")] = 2048,
    batch: Annotated[int, typer.Option("--batch", help="what-if: samples (sequences) per device per step")] = 1,
    precision: Annotated[str, typer.Option("--precision", help="what-if: bf16 or fp32")] = "bf16",
    optimizer: Annotated[str, typer.Option("--optimizer", help="what-if: adamw or sgd")] = "adamw",
    gpu: Annotated[Optional[str], typer.Option("--gpu", help="what-if GPUs: H200, H100, A100, L40S, L4, A10, V100, T4")] = None,
    devices_per_node: Annotated[Optional[int], typer.Option("--devices-per-node", help="GPUs (or CPU workers) per node")] = None,
    nodes: Annotated[Optional[int], typer.Option("--nodes", help="nodes")] = None,
    memory_gb: Annotated[Optional[float], typer.Option("--memory-gb", help="memory per device, GiB")] = None,
    tflops: Annotated[Optional[float], typer.Option("--tflops", help="sustained TFLOP/s per device")] = None,
    intra_gbps: Annotated[Optional[float], typer.Option("--intra-gbps", help="GB/s per rank within a node")] = None,
    inter_gbps: Annotated[Optional[float], typer.Option("--inter-gbps", help="GB/s per rank across nodes")] = None,
    collective_us: Annotated[Optional[float], typer.Option("--collective-us", help="fixed cost of one collective call, microseconds")] = None,
    host_memory_gb: Annotated[Optional[float], typer.Option("--host-memory-gb", help="host memory per node, GiB (checked for CPU offload)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="JSON instead of a table")] = False,
) -> None:
    """Memory, communication and step time of every strategy; which one to use, and why."""
    from scaletrain.plan import plan_job, plan_what_if

    hardware = {
        "gpu": gpu, "devices_per_node": devices_per_node, "nodes": nodes,
        "memory_bytes": memory_gb * 1024**3 if memory_gb else None, "flops": tflops * 1e12 if tflops else None,
        "intra_bw": intra_gbps * 1e9 if intra_gbps else None, "inter_bw": inter_gbps * 1e9 if inter_gbps else None,
        "collective_s": collective_us * 1e-6 if collective_us is not None else None,
        "host_memory_bytes": host_memory_gb * 1024**3 if host_memory_gb else None,
    }
    shape = {"layers": layers, "hidden": hidden, "heads": heads}
    try:
        if job is not None:
            if params is not None or any(shape.values()):
                raise ConfigError("give a job file or a what-if (--params, or --layers/--hidden/--heads), not both")
            from scaletrain.api import resolve_job
            from scaletrain.task import build_task

            config, search_path = resolve_job(job, set_ or [])
            result = plan_job(config, build_task(config.task.target, config.task.args, search_path), hardware)
        elif any(shape.values()):
            missing = [f"--{k}" for k, v in shape.items() if not v]
            if missing:
                raise ConfigError(f"a transformer what-if needs {', '.join(missing)} as well")
            result = plan_what_if(shape={**shape, "vocab": vocab, "seq": seq}, batch=batch,
                                  hardware=hardware, optimizer=optimizer, precision=precision)
        elif params is not None:
            if params <= 0:
                raise ConfigError(f"--params must be a positive count, got {params:g}")
            result = plan_what_if(params=params, batch=batch, hardware=hardware, optimizer=optimizer, precision=precision)
        else:
            raise ConfigError("give a job file, --params N, or a transformer shape (--layers --hidden --heads)")
    except ValueError as exc:
        _fail(ConfigError(str(exc)))
    except ScaletrainError as exc:
        _fail(exc)
    if as_json:
        typer.echo(json.dumps(result.as_dict()))
    else:
        _print_plan(result)


def _print_plan(result: Any) -> None:
    from rich.console import Console
    from rich.measure import Measurement
    from rich.table import Table

    def size(value: float) -> str:
        return f"{value / 1024**3:.2f} GiB" if value >= 1024**3 / 10 else f"{value / 1024**2:.1f} MiB"

    model, hw = result.model, result.hardware
    console = Console()
    console.print(
        f"[bold]{model['name']}[/]: {model['params']:,} parameters ({size(model['param_bytes'])}), "
        f"{model['blocks']} blocks; batch {result.batch_per_device} per device"
    )
    console.print(
        f"hardware ({hw['source']}): {hw['nodes']} x {hw['devices_per_node']} {hw['device']} devices, "
        f"{hw['name']}, {size(hw['memory_bytes'])} each, {hw['flops'] / 1e12:.2f} TFLOP/s sustained"
    )
    title = "memory per device, communication and time per step"
    table = Table(title=title)
    for column in ("strategy", "ranks", "params", "grads", "optim", "activ.", "buffers", "total", "fits",
                   "comm/step", "calls", "step", "samples/s"):
        table.add_column(column, justify="left" if column == "strategy" else "right", no_wrap=True)
    for e in result.estimates:
        m = e.memory
        chosen = result.recommended is e
        table.add_row(
            ("* " if chosen else "") + e.option.label, str(e.option.world), size(m["params"]),
            size(m["grads"]), size(m["optimizer"]), size(m["activations"]), size(m["buffers"]),
            size(m["total"]), "yes" if e.fits else "[red]no[/]", size(sum(e.comm_bytes.values())),
            str(e.collectives), f"{e.step_s * 1e3:.1f} ms" if e.step_s else "-",
            f"{e.samples_per_s:,.0f}" if e.samples_per_s else "-",
        )
    wide = Measurement.get(console, console.options.update(max_width=10_000), table).maximum
    if wide <= console.width:
        console.print(table)
    else:  # e.g. 80 columns: the units in the header, the model states as one column
        console.print(_narrow_plan_table(result, title))
        console.print(f"state: parameters, gradients, optimizer and buffers (each apart with --json, or "
                      f"on a terminal of {wide} columns)")
    console.print(f"[bold]recommendation[/]: {result.reason}")
    for note in result.notes:
        console.print(f"note: {note}")


def _narrow_plan_table(result: Any, title: str) -> Any:
    from rich import box
    from rich.table import Table

    def gib(value: float) -> str:
        return f"{value / 1024**3:.1f}" if value >= 1024**3 / 20 else f"{value / 1024**3:.2f}"

    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("strategy", max_width=18)
    for column in ("ranks", "state\nGiB", "activ.\nGiB", "total\nGiB", "fits", "comm\nGiB", "step\nms",
                   "samples\n/s"):
        table.add_column(column, justify="right", no_wrap=True)
    for e in result.estimates:
        m = e.memory
        state = m["params"] + m["grads"] + m["optimizer"] + m["buffers"]
        table.add_row(
            ("* " if result.recommended is e else "") + e.option.label, str(e.option.world), gib(state),
            gib(m["activations"]), gib(m["total"]), "yes" if e.fits else "[red]no[/]",
            gib(sum(e.comm_bytes.values())), f"{e.step_s * 1e3:,.0f}" if e.step_s else "-",
            f"{e.samples_per_s:,.0f}" if e.samples_per_s else "-",
        )
    return table


checkpoints_app = typer.Typer(help="List and verify checkpoints.", no_args_is_help=True)
app.add_typer(checkpoints_app, name="checkpoints")
PathArg = Annotated[
    str,
    typer.Argument(
        help="a run directory, a checkpoint location (path or s3://...) or one checkpoint",
        metavar="PATH",
    ),
]


def _checkpoint_rows(path: str, verify: bool, as_json: bool) -> list[dict[str, Any]]:
    from scaletrain.checkpoint.inspect import describe_checkpoints

    try:
        rows = describe_checkpoints(path, verify)
    except ScaletrainError as exc:
        _fail(exc)
    if as_json:
        typer.echo(json.dumps(rows))
        return rows
    from rich.console import Console
    from rich.table import Table

    show_why = any(row["why"] for row in rows)
    from rich.table import Column

    table = Table(Column("checkpoint", no_wrap=True), "step", "size", "workers", "metrics",
                  "status", *(["why"] if show_why else []))
    for row in rows:
        shown = {k: v for k, v in (row.get("metrics") or {}).items()
                 if k == "train/loss" or k.startswith("eval/")}
        metrics = "  ".join(f"{k} {_fmt(v)}" for k, v in sorted(shown.items(), reverse=True))
        table.add_row(
            row["name"], str(row["step"]),
            _size(row["bytes"]) if "bytes" in row else "",
            str(row.get("world_size", "")), metrics, row["status"],
            *([row["why"]] if show_why else []),
        )
    Console().print(table if rows else f"no checkpoints at {path}")
    return rows


@checkpoints_app.command("ls")
def checkpoints_ls(
    path: PathArg,
    as_json: Annotated[bool, typer.Option("--json", help="JSON instead of a table")] = False,
) -> None:
    """Checkpoints at PATH: step, size, metrics, committed or not and why (no hashing)."""
    _checkpoint_rows(path, verify=False, as_json=as_json)


@checkpoints_app.command("verify")
def checkpoints_verify(
    path: PathArg,
    as_json: Annotated[bool, typer.Option("--json", help="JSON instead of a table")] = False,
) -> None:
    """Hash every file of every checkpoint at PATH against its manifest; exit 1 if any fails."""
    rows = _checkpoint_rows(path, verify=True, as_json=as_json)
    if not rows or any(row["status"] != "verified" for row in rows):
        raise typer.Exit(1)


@app.command("verify-resume")
def verify_resume(
    job: JobArg,
    set_: SetOpt = None,
    steps: Annotated[int, typer.Option(help="steps to train; the kill comes at 3/4, the resume from 1/2")] = 20,
    as_json: Annotated[bool, typer.Option("--json", help="print the outcome as JSON")] = False,
) -> None:
    """Check that a job resumes exactly: train, kill a worker, resume, compare final weights."""
    from scaletrain.verify_resume import verify_resume as check

    try:
        outcome = check(job, set_ or [], steps, announce=lambda line: typer.echo(line, err=True))
    except ScaletrainError as exc:
        _fail(exc)
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
def validate(job: JobArg, set_: SetOpt = None) -> None:
    """Check a job file (and that its task imports); print the resolved job."""
    from scaletrain.api import resolve_job
    from scaletrain.config import job_to_yaml
    from scaletrain.task import check_task_args, check_task_target, resolve_task_factory

    try:
        config, search_path = resolve_job(job, set_ or [])
        check_task_target(config.task.target, config.task.args, search_path)
        factory = resolve_task_factory(config.task.target, search_path)
        check_task_args(factory, config.task.args, config.task.target)
    except ScaletrainError as exc:
        _fail(exc)
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
    _check(job, _scale_overrides(set_, engine, address), as_json)


def _check(job: str, overrides: list[str], as_json: bool) -> None:
    from scaletrain.api import preflight

    try:
        checks = preflight(job, overrides)
    except ScaletrainError as exc:
        _fail(exc)
    failed = [c for c in checks if not c.ok]
    seconds = sum(c.seconds for c in checks)
    if as_json:
        typer.echo(json.dumps({"passed": not failed, "seconds": round(seconds, 4), "checks": [
            {"name": c.name, "ok": c.ok, "warning": c.warning, "detail": c.detail,
             "seconds": round(c.seconds, 4)} for c in checks]}))
    else:
        for c in checks:
            typer.echo(f"{c.line()}  ({1000 * c.seconds:.0f} ms)")
        typer.echo(f"pre-flight {'FAILED' if failed else 'passed'}: {len(checks)} checks in {1000 * seconds:.0f} ms")
    for c in failed:  # also on stderr, one line each, as every refusal
        typer.echo(f"error: pre-flight: {c.name}: {c.detail}", err=True)
    if failed:
        raise typer.Exit(2)


@app.command()
def schema() -> None:
    """Print the JSON Schema of job files (for editor completion and validation)."""
    from scaletrain.config import job_schema

    typer.echo(json.dumps(job_schema(), indent=2))


UriOpt = Annotated[
    Optional[str],
    typer.Option("--uri", help="tracking store or server (default: MLFLOW_TRACKING_URI, else ./mlflow.db)"),
]


def _tracking_uri(uri: str | None) -> str:
    from scaletrain.tracking.mlflow_run import resolve_tracking_uri

    return uri or resolve_tracking_uri()


@app.command()
def runs(
    experiment: Annotated[Optional[str], typer.Option("--experiment", "-e", help="only this experiment")] = None,
    limit: Annotated[int, typer.Option(help="newest N runs")] = 20,
    uri: UriOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="JSON instead of a table")] = False,
) -> None:
    """List tracked runs: status, steps, final loss, duration, git SHA."""
    from scaletrain.tracking.runs import list_runs

    try:
        rows = list_runs(_tracking_uri(uri), experiment, limit)
    except ScaletrainError as exc:
        _fail(exc)
    if as_json:
        typer.echo(json.dumps(rows))
        return
    from rich import box
    from rich.console import Console
    from rich.table import Table

    # The id is whole whatever the width (it is what `show`, `reproduce` and `resume` take);
    # the experiment's name is what gives way.
    refs = [row["run_id"] or row["run"] for row in rows]
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    table.add_column("run", no_wrap=True, min_width=max(map(len, refs), default=3))
    table.add_column("experiment", overflow="ellipsis", no_wrap=True, ratio=1)
    for name in ("status", "steps", "loss", "time", "git"):
        table.add_column(name, no_wrap=True, justify="right" if name in ("steps", "loss", "time") else "left")
    for ref, row in zip(refs, rows):
        table.add_row(
            ref, row["experiment"], row["status"].lower(),
            "" if row["steps"] is None else str(row["steps"]),
            "" if row["final_loss"] is None else f"{row['final_loss']:.4g}",
            "" if row["duration_s"] is None else _duration(row["duration_s"]),
            (row["git_sha"] or "")[:7],
        )
    Console().print(table if rows else "no runs yet: train one with `scaletrain run JOB`")


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes < 60 else f"{minutes // 60}h{minutes % 60:02d}m"


@app.command()
def show(
    run_id: Annotated[str, typer.Argument(help="MLflow run id or scaletrain run id", metavar="RUN")],
    uri: UriOpt = None,
) -> None:
    """Show one run: params, final metrics, artifacts, run card."""
    from scaletrain.tracking.runs import run_details

    try:
        details = run_details(_tracking_uri(uri), run_id)
    except ScaletrainError as exc:
        _fail(exc)
    typer.echo(json.dumps(details, indent=2))


@app.command()
def reproduce(
    run_id: Annotated[str, typer.Argument(help="MLflow run id or scaletrain run id", metavar="RUN")],
    uri: UriOpt = None,
    set_: Annotated[Optional[list[str]], typer.Option(
        "--set", "-s", help="a value the tracking server's copy of the job has masked (***): "
        "--set task.args.api_token=... (repeatable; nothing else can be changed)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the outcome as JSON")] = False,
) -> None:
    """Run a recorded job again (its recorded code, tracked in the store given); report what
    differs, then whether the weights match."""
    from scaletrain.reproduce import reproduce as reproduce_run

    try:
        outcome = reproduce_run(
            run_id, _tracking_uri(uri), announce=lambda line: typer.echo(line, err=True),
            overrides=list(set_ or []),
        )
    except ScaletrainError as exc:
        _fail(exc)
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
    os.execve(mlflow_bin, [mlflow_bin, "ui", "--host", "127.0.0.1", "--port", str(port)],
              {**os.environ, "MLFLOW_BACKEND_STORE_URI": store})


def _print_summary(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"{summary.get('job')} finished", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    table.add_row("run", str(summary.get("run_id")))
    table.add_row("workers", f"{summary.get('world_size')} ({summary.get('engine')}, {summary.get('strategy')})")
    steps = str(summary.get("steps"))
    if summary.get("resumed_from_step"):
        steps += f" (resumed from step {summary['resumed_from_step']})"
    if summary.get("restarts"):
        steps += f", {summary['restarts']} restart(s)"
    table.add_row("steps", steps)
    loop_metrics = {"lr", "grad_norm", "step_time_s", "data_wait_s", "samples_per_s"}
    for split in ("train", "eval"):
        metrics = summary.get(split) or {}
        shown = {k: v for k, v in metrics.items() if k not in loop_metrics}
        if shown:
            table.add_row(split, "  ".join(f"{k} {_fmt(v)}" for k, v in shown.items()))
    train = summary.get("train") or {}
    speed, step_time = train.get("samples_per_s"), train.get("step_time_s")
    if isinstance(speed, (int, float)) and isinstance(step_time, (int, float)):
        table.add_row("speed", f"{speed:,.0f} samples/s, {step_time * 1e3:.1f} ms/step")
    wall, first = summary.get("wall_time_s"), summary.get("time_to_first_step_s")
    if isinstance(wall, (int, float)):  # first None: no step ran (a resumed run already done)
        table.add_row("wall time", f"{wall:.1f} s" + (
            f" (first step after {first:.1f} s)" if isinstance(first, (int, float)) else " (no step to run)"))
    if summary.get("checkpoint_step") is not None:
        table.add_row("checkpoint", f"step {summary['checkpoint_step']}")
    for key in ("weights", "logs"):
        if summary.get(key):
            table.add_row(key, str(summary[key]))
    console.print(table)


def _size(count: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if count < 1024 or unit == "GB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return str(count)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


def entrypoint() -> None:
    try:
        code = app()
    except SystemExit as exc:  # click ends every command this way
        code = exc.code
    exit_quickly(code)


if __name__ == "__main__":
    entrypoint()
