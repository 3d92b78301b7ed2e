"""``scaletrain plan``: every strategy's memory, communication and step time, for a job file or
a what-if (a parameter count or a transformer shape), without a GPU or a training step.

Bad numbers the planner refuses (a ValueError) are bad input: one ``error:`` line, exit 2.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Optional

import typer

from scaletrain.cli.app import JsonOpt, SetOpt, app, user_errors
from scaletrain.cli.render import print_plan
from scaletrain.errors import ConfigError


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
    as_json: JsonOpt = False,
) -> None:
    """Memory, communication and step time of every strategy; which one to use, and why."""
    hardware = {
        "gpu": gpu, "devices_per_node": devices_per_node, "nodes": nodes,
        "memory_bytes": memory_gb * 1024**3 if memory_gb else None, "flops": tflops * 1e12 if tflops else None,
        "intra_bw": intra_gbps * 1e9 if intra_gbps else None, "inter_bw": inter_gbps * 1e9 if inter_gbps else None,
        "collective_s": collective_us * 1e-6 if collective_us is not None else None,
        "host_memory_bytes": host_memory_gb * 1024**3 if host_memory_gb else None,
    }
    shape = {"layers": layers, "hidden": hidden, "heads": heads}
    what_if = {"batch": batch, "hardware": hardware, "optimizer": optimizer, "precision": precision}
    with user_errors(value_errors=True):  # the estimate only: a ValueError printing is a bug
        result = _estimate(job, set_ or [], params, {**shape, "vocab": vocab, "seq": seq}, what_if)
    if as_json:
        typer.echo(json.dumps(result.as_dict()))
    else:
        print_plan(result)


def _estimate(job: str | None, overrides: list[str], params: float | None,
              shape: dict[str, int | None], what_if: dict[str, Any]) -> Any:
    """The plan for a job file, a transformer shape or a parameter count: exactly one of them."""
    from scaletrain.plan import plan_job, plan_what_if

    dims = {k: shape[k] for k in ("layers", "hidden", "heads")}
    if job is not None:
        if params is not None or any(dims.values()):
            raise ConfigError("give a job file or a what-if (--params, or --layers/--hidden/--heads), not both")
        from scaletrain.api import resolve_job
        from scaletrain.task import build_task

        config, search_path = resolve_job(job, overrides)
        if config.kind == "tensorflow":
            from scaletrain.plan import plan_keras_job
            from scaletrain.task import check_job_code

            check_job_code(config, search_path)  # TensorFlow is there
            return plan_keras_job(config, search_path, what_if["hardware"])
        if config.task is None:
            raise ConfigError("scaletrain plan builds the model of a task: job; a loop builds its own. "
                              "Plan it as a what-if (--params N, or --layers/--hidden/--heads)")
        return plan_job(config, build_task(config.task.target, config.task.args, search_path),
                        what_if["hardware"])
    if any(dims.values()):
        missing = [f"--{k}" for k, v in dims.items() if not v]
        if missing:
            raise ConfigError(f"a transformer what-if needs {', '.join(missing)} as well")
        return plan_what_if(shape={k: v for k, v in shape.items() if v is not None}, **what_if)
    if params is not None:
        if params <= 0:
            raise ConfigError(f"--params must be a positive count, got {params:g}")
        return plan_what_if(params=params, **what_if)
    raise ConfigError("give a job file, --params N, or a transformer shape (--layers --hidden --heads)")
