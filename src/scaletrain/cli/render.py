"""How outcomes look on a terminal: tables and one-line formats, apart from the commands so
those read as flag -> call -> print. Rich is imported inside each function (``--help`` is fast).
"""

from __future__ import annotations

import json
from typing import Any

import typer

GIB = 1024**3


def fmt_bytes(count: float, unit: str | None = None, digits: int = 1, label: bool = True) -> str:
    """``count`` bytes in ``unit`` (KiB, MiB or GiB), or without one in the largest of B, KB, MB,
    GB that keeps it under 1024 (all 1024-based)."""
    if unit is not None:
        value = count / 1024 ** (("KiB", "MiB", "GiB").index(unit) + 1)
        return f"{value:.{digits}f}" + (f" {unit}" if label else "")
    for name in ("B", "KB", "MB", "GB"):
        if count < 1024 or name == "GB":
            return f"{count:.0f} {name}" if name == "B" else f"{count:.{digits}f} {name}"
        count /= 1024
    return str(count)


def fmt_duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes < 60 else f"{minutes // 60}h{minutes % 60:02d}m"


def fmt_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


def print_summary(summary: dict[str, Any]) -> None:
    """A finished run: its id, workers, steps, metrics, speed, where its weights and logs are."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"{summary.get('job')} finished", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    table.add_row("run", str(summary.get("run_id")))
    table.add_row("workers", f"{summary.get('world_size')} ({summary.get('engine')}, {summary.get('strategy')})")
    steps = str(summary.get("steps")) if summary.get("steps") or summary.get("strategy") != "script" else "not reported (scaletrain.report)"
    if summary.get("resumed_from_step"):
        steps += f" (resumed from step {summary['resumed_from_step']})"
    if summary.get("restarts"):
        steps += f", {summary['restarts']} restart(s)"
    table.add_row("steps", steps)
    loop_metrics = {"lr", "grad_norm", "step_time_s", "data_wait_s", "samples_per_s", "tokens_per_s"}
    for split in ("train", "eval"):
        metrics = summary.get(split) or {}
        shown = {k: v for k, v in metrics.items() if k not in loop_metrics}
        if shown:
            table.add_row(split, "  ".join(f"{k} {fmt_value(v)}" for k, v in shown.items()))
    train = summary.get("train") or {}
    speed, step_time = train.get("samples_per_s"), train.get("step_time_s")
    if isinstance(speed, (int, float)) and isinstance(step_time, (int, float)):
        tokens = train.get("tokens_per_s")
        table.add_row("speed", f"{speed:,.0f} samples/s" + (f" ({tokens:,.0f} tokens/s)" if tokens else "")
                      + f", {step_time * 1e3:.1f} ms/step")
    wall, first = summary.get("wall_time_s"), summary.get("time_to_first_step_s")
    if isinstance(wall, (int, float)):  # first None: no step ran (a resumed run already done)
        table.add_row("wall time", f"{wall:.1f} s" + (
            f" (first step after {first:.1f} s)" if isinstance(first, (int, float))
            else "" if summary.get("strategy") == "script" else " (no step to run)"))
    spent = summary.get("goodput")
    if isinstance(spent, dict):
        lost = [f"{name} {spent[key]:.1f} s" for name, key in (
            ("start-up", "startup_s"), ("checkpoints", "checkpoint_stall_s"), ("redone", "redone_s"),
            ("other", "other_s")) if spent.get(key)]
        table.add_row("goodput", f"{spent['ratio']:.0%} of the wall time training" + (
            f" ({', '.join(lost)})" if lost else ""))
    if summary.get("checkpoint_step") is not None:
        table.add_row("checkpoint", f"step {summary['checkpoint_step']}")
    for key in ("weights", "logs"):
        if summary.get(key):
            table.add_row(key, str(summary[key]))
    console.print(table)


def print_checks(checks: list[Any], as_json: bool) -> None:
    """Pre-flight checks, one line each (or JSON); a failed one also as an ``error:`` line."""
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


def print_checkpoints(rows: list[dict[str, Any]], path: str) -> None:
    """Checkpoints: step, size, workers, the loss and eval metrics, status (and why)."""
    from rich.console import Console
    from rich.table import Column, Table

    show_why = any(row["why"] for row in rows)
    table = Table(Column("checkpoint", no_wrap=True), "step", "size", "workers", "metrics",
                  "status", *(["why"] if show_why else []))
    for row in rows:
        shown = {k: v for k, v in (row.get("metrics") or {}).items()
                 if k == "train/loss" or k.startswith("eval/")}
        metrics = "  ".join(f"{k} {fmt_value(v)}" for k, v in sorted(shown.items(), reverse=True))
        table.add_row(
            row["name"], str(row["step"]),
            fmt_bytes(row["bytes"]) if "bytes" in row else "",
            str(row.get("world_size", "")), metrics, row["status"],
            *([row["why"]] if show_why else []),
        )
    Console().print(table if rows else f"no checkpoints at {path}")


def print_runs(rows: list[dict[str, Any]]) -> None:
    """Tracked runs, newest first. The id is whole whatever the width (it is what `show`,
    `reproduce` and `resume` take); the experiment's name is what gives way."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

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
            "" if row["duration_s"] is None else fmt_duration(row["duration_s"]),
            (row["git_sha"] or "")[:7],
        )
    Console().print(table if rows else "no runs yet: train one with `scaletrain run JOB`")


def print_plan(result: Any) -> None:
    """Every strategy's memory, communication and step time; the narrow table on a narrow terminal."""
    from rich.console import Console
    from rich.measure import Measurement
    from rich.table import Table

    def size(value: float) -> str:
        return fmt_bytes(value, "GiB", digits=2) if value >= GIB / 10 else fmt_bytes(value, "MiB")

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
    for column in ("strategy", "ranks", "params", "grads", "optim", "gathered", "activ.", "buffers", "total",
                   "fits", "comm/step", "calls", "step", "samples/s"):
        table.add_column(column, justify="left" if column == "strategy" else "right", no_wrap=True)
    for e in result.estimates:
        m = e.memory
        chosen = result.recommended is e
        table.add_row(
            ("* " if chosen else "") + e.option.label, str(e.option.world), size(m["params"]),
            size(m["grads"]), size(m["optimizer"]), size(m["gathered"]), size(m["activations"]), size(m["buffers"]),
            size(m["total"]), "yes" if e.fits else "[red]no[/]", size(sum(e.comm_bytes.values())),
            str(e.collectives), f"{e.step_s * 1e3:.1f} ms" if e.step_s else "-",
            f"{e.samples_per_s:,.0f}" if e.samples_per_s else "-",
        )
    wide = Measurement.get(console, console.options.update(max_width=10_000), table).maximum
    if wide <= console.width:
        console.print(table)
    else:  # e.g. 80 columns: the units in the header, the model states as one column
        console.print(_narrow_plan_table(result, title))
        console.print("state: parameters, gradients, optimizer and buffers kept between steps; gath.: "
                      "FSDP's transient all-gather (each apart, and samples/s, with --json or on a "
                      f"terminal of {wide} columns)")
    console.print(f"[bold]recommendation[/]: {result.reason}")
    for note in result.notes:
        console.print(f"note: {note}")


def _narrow_plan_table(result: Any, title: str) -> Any:
    from rich import box
    from rich.table import Table

    def gib(value: float) -> str:
        return fmt_bytes(value, "GiB", digits=1 if value >= GIB / 20 else 2, label=False)

    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("strategy", max_width=18)
    for column in ("ranks", "state\nGiB", "gath.\nGiB", "activ.\nGiB", "total\nGiB", "fits", "comm\nGiB",
                   "step\nms"):
        table.add_column(column, justify="right", no_wrap=True)
    for e in result.estimates:
        m = e.memory
        state = m["params"] + m["grads"] + m["optimizer"] + m["buffers"]
        table.add_row(
            ("* " if result.recommended is e else "") + e.option.label, str(e.option.world), gib(state),
            gib(m["gathered"]), gib(m["activations"]), gib(m["total"]), "yes" if e.fits else "[red]no[/]",
            gib(sum(e.comm_bytes.values())), f"{e.step_s * 1e3:,.0f}" if e.step_s else "-",
        )
    return table


def print_trials(summary: dict[str, Any]) -> None:
    """A search's trials, compact, the trial ids whole (Tune's trial folders and logs carry
    them); the best marked *, each failed trial's error below."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    keys = sorted({key for row in summary["trials"] for key in row["config"]})
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
