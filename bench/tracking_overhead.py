"""Tracking overhead: what logging every step to MLflow costs training, measured three ways.

1. Critical path, precise. The extra work tracking puts in the training process itself (keep
   each step's values, one journal line per step), in one process: blocks of 200 steps
   alternate between a trainer with tracking off and one logging every step (same model, data
   and production reporter sinks), in A B B A order (an A/A run showed the second block of a
   pair 50-90 us slower on this machine); median microseconds per step over the blocks.
2. Tracker CPU. What delivering the points costs, off the training processes: the metric
   shipper's CPU-seconds after its start-up (it reports them in launcher.jsonl) and, for the
   server variant, the `mlflow server` process tree's, per training step. On a machine with a core to spare (a GPU
   box) this costs training nothing; on one whose cores all train, it competes.
3. End to end. `scaletrain run` on the job, interleaved (A B C A B C ...), steady-state steps/s
   (first third skipped) with tracking off, on the embedded sqlite store and on a local
   `mlflow server`, logging every step; the console reports every 20 steps in all of them.
   With 2 workers (this machine's cores all train) and 1 worker (a core to spare). Every run's
   train/loss points are counted in MLflow afterwards: each step must be there.

    .venv/bin/python bench/tracking_overhead.py                     # quick: 3 repeats, 3000 steps
    .venv/bin/python bench/tracking_overhead.py --repeats 6 --steps 6000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, alternating_blocks, emit, run_scaletrain, steady_steps_per_s  # noqa: E402

sys.path.insert(0, str(REPO))
from tests.helpers.servers import MlflowServer  # noqa: E402

BLOCK_STEPS = 200


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3000, help="steps with 2 workers (1: twice)")
    parser.add_argument("--blocks", type=int, default=30, help="critical-path blocks per variant")
    parser.add_argument("--workers", default="2,1", help="end-to-end worker counts (1: twice the steps)")
    parser.add_argument("--job", default="examples/digits.yaml")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    result = {"job": args.job, "steps": args.steps, "repeats": args.repeats,
              "critical_path": critical_path(args.job, args.blocks)}
    result["end_to_end"] = end_to_end(args.job, args.steps, args.repeats,
                                      [int(w) for w in args.workers.split(",")])
    step_us = 1e6 / result["end_to_end"]["workers=2"]["steps_per_s"]["off"]["median"]
    crit = result["critical_path"]
    crit["extra_vs_2_worker_step"] = crit["extra_paired_median"] * crit["us_per_step"]["off"] / step_us
    emit(result, args.out)


# ---------------------------------------------------------------------- 1. critical path

def critical_path(job_file: str, blocks: int) -> dict:
    """Per-step time of the training process with tracking off and every step, one process."""
    import torch

    from scaletrain.config.loading import load_job
    from scaletrain.data.loader import train_loader
    from scaletrain.distributed.device import choose_placement
    from scaletrain.distributed.env import DistEnv
    from scaletrain.engine.trainer import Trainer
    from scaletrain.observe.telemetry import Telemetry
    from scaletrain.rundir import RunSpec
    from scaletrain.task import build_task
    from scaletrain.tracking.logs import LogContext
    from scaletrain.tracking.worker_sinks import worker_reporter

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="st-bench-"))
    job_path = (REPO / job_file).resolve()

    def reporter_and_job(tracking: bool):
        job = load_job(job_path, [
            "scale.workers=1", "train.epochs=null", "train.max_steps=100000000",
            "train.eval_every=null", "train.log_every=20",
            f"tracking.enabled={str(tracking).lower()}", "tracking.log_every_steps=1",
        ])
        spec = RunSpec.in_dir(job.model_dump(mode="json"), tmp / ("on" if tracking else "off"),
                              python_path=[str(job_path.parent)])
        Path(spec.run_dir).mkdir(parents=True)
        # The production sinks: the rank's live figures (observability is on by default) too.
        figures = Telemetry(spec.telemetry_dir / "rank-0.json", {"rank": "0"})
        return worker_reporter(spec, job, LogContext(spec.run_id, spec.trace_id, 0), True, None, figures, 1), job, spec

    # One trainer, its reporting switched between the two settings: two trainer instances
    # differ by up to +-100 us per step here on their own (an A/A run), memory placement.
    on_reporter, job, spec = reporter_and_job(True)
    off_reporter, off_job, _ = reporter_and_job(False)
    env = DistEnv()
    task = build_task(job.task.target, job.task.args, spec.python_path)
    shared = Trainer(job, task, env, choose_placement(env), on_reporter)  # no checkpoints
    batches = iter(train_loader(
        shared.train_set, shared.layout, rank=0, seed=job.seed, shuffle=True, start_step=0,
        stop_step=shared.max_steps, loader_workers=0, collate=shared.collate, pin_memory=False,
    ))
    settings = {"off": (off_reporter, off_job.train.log_every), "every step": (on_reporter, shared.report_every)}
    for reporter, _ in settings.values():
        reporter.on_start(shared.max_steps, 0)

    # The reporting path timed in place: all the loop's per-step reporting work is in
    # MetricsWindow.add (keep a step's values) and .report (every sink), mean_metrics and the
    # loss's detach.
    import scaletrain.engine.trainer as trainer_module
    from scaletrain.engine.metrics import MetricsWindow

    in_path = {name: 0 for name in settings}
    current = ["off"]
    depth = [0]  # a timed call inside another (a detach in add) is counted once

    def timed(function: Callable) -> Callable:
        def call(*args, **kwargs):
            if depth[0]:
                return function(*args, **kwargs)
            depth[0] += 1
            started = time.perf_counter_ns()  # (the thread CPU clock is a system call here: 2 us a read)
            try:
                return function(*args, **kwargs)
            finally:
                in_path[current[0]] += time.perf_counter_ns() - started
                depth[0] -= 1
        return call

    # The loss's detach on a reported step (inside the step) counts too: every Tensor.detach
    # is timed (the wrapper's own cost included: an overestimate).
    originals = (MetricsWindow.add, MetricsWindow.report, trainer_module.mean_metrics, torch.Tensor.detach)
    MetricsWindow.add, MetricsWindow.report = timed(MetricsWindow.add), timed(MetricsWindow.report)  # type: ignore[method-assign]
    trainer_module.mean_metrics = timed(trainer_module.mean_metrics)
    torch.Tensor.detach = timed(torch.Tensor.detach)  # type: ignore[method-assign]

    def setting(name: str) -> Callable[[], None]:
        def apply() -> None:
            shared.reporter, shared.report_every = settings[name]
            current[0] = name
        return apply

    try:
        times, cpu = alternating_blocks(shared, batches, {name: setting(name) for name in settings}, blocks, BLOCK_STEPS)
    finally:
        (MetricsWindow.add, MetricsWindow.report, trainer_module.mean_metrics,  # type: ignore[method-assign]
         torch.Tensor.detach) = originals
    path_us = {name: ns / 1e3 / ((blocks + 1) * BLOCK_STEPS) for name, ns in in_path.items()}
    for reporter, _ in settings.values():
        reporter.on_end()
    med = {name: statistics.median(v) * 1e6 for name, v in times.items()}
    med_cpu = {name: statistics.median(v) * 1e6 for name, v in cpu.items()}
    paired = [b / a - 1 for a, b in zip(cpu["off"], cpu["every step"])]
    # Whole blocks, two ways: their paired median and the least CPU a block of each setting
    # took. On this shared machine both move by more than the figure (identical runs: paired
    # 5-45 us, least 6-39 us), hence the reporting path's time measured in place as well.
    least = {name: min(v) * 1e6 for name, v in cpu.items()}
    return {
        "what": "one process, 1 thread, one trainer, alternating blocks of 200 steps; tracking's extra work "
                "in the training process (the journal line per step included), in the training "
                "thread's CPU time (time.thread_time: what another tenant's load does not inflate)",
        "us_per_step": {name: round(v, 1) for name, v in med_cpu.items()},
        "wall_us_per_step": {name: round(v, 1) for name, v in med.items()},
        "extra_us_per_step": round(med_cpu["every step"] - med_cpu["off"], 1),
        "extra_wall_us_per_step": round(med["every step"] - med["off"], 1),
        "extra_vs_1_process_step": med_cpu["every step"] / med_cpu["off"] - 1,
        "extra_paired_median": statistics.median(paired),
        "least_us_per_step": {name: round(v, 1) for name, v in least.items()},
        # the time inside the reporting path (add, report and its sinks, mean_metrics, the
        # loss's detach), per step: tracking's extra is the difference, free of the step's noise
        "reporting_path_us_per_step": {name: round(v, 2) for name, v in path_us.items()},
        "extra_reporting_path_us_per_step": round(path_us["every step"] - path_us["off"], 2),
        "extra_least_us_per_step": round(least["every step"] - least["off"], 1),
        "blocks": blocks,
    }


# ---------------------------------------------------------------------- 2 + 3. end to end

def end_to_end(job: str, steps: int, repeats: int, worker_counts: list[int]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        server = MlflowServer(tmp).start()
        try:
            out = {}
            for workers in worker_counts:  # 1 worker steps about twice as fast: twice the steps
                out[f"workers={workers}"] = _compare(job, steps * (3 - workers), repeats, workers, tmp, server)
        finally:
            server.stop()
    return out


def _compare(job: str, steps: int, repeats: int, workers: int, tmp: Path, server: MlflowServer) -> dict:
    base = [f"train.max_steps={steps}", "train.epochs=null", "train.eval_every=null",
            f"run_dir={tmp / 'runs'}", f"scale.workers={workers}", "train.log_every=20"]
    variants = {
        "off": base + ["tracking.enabled=false"],
        "embedded": base + [f"tracking.uri=sqlite:///{tmp / 'embedded.db'}", "tracking.log_every_steps=1"],
        "server": base + [f"tracking.uri={server.uri}", "tracking.log_every_steps=1"],
    }
    speeds: dict[str, list[float]] = {name: [] for name in variants}
    delivered: dict[str, list[int]] = {name: [] for name in variants}
    shipper_ms: dict[str, list[float]] = {name: [] for name in variants}
    server_ms: list[float] = []
    for _ in range(repeats):
        for name, overrides in variants.items():
            server_cpu = _tree_cpu_s(server.proc.pid) if name == "server" else 0.0
            summary = run_scaletrain(job, overrides)
            if name == "server":
                server_ms.append((_tree_cpu_s(server.proc.pid) - server_cpu) * 1e3 / steps)
            # Steady state: the first third (the shipper importing mlflow, opening the store,
            # the run card) is start-up, paid once per run, not per step.
            speeds[name].append(steady_steps_per_s(summary["run_dir"], skip=steps // 3))
            delivered[name].append(_points(summary))
            cpu = _shipper_cpu_s(summary["run_dir"])
            if cpu is not None:
                shipper_ms[name].append(cpu * 1e3 / steps)
    medians = {name: statistics.median(v) for name, v in speeds.items()}
    return {
        "steps_per_s": {n: {"median": medians[n], "min": min(v), "max": max(v)} for n, v in speeds.items()},
        "cost_vs_off": {n: 1 - medians[n] / medians["off"] for n in ("embedded", "server")},
        "noise_off_spread": (max(speeds["off"]) - min(speeds["off"])) / medians["off"],
        "steps": steps,
        "shipper_cpu_ms_per_step": {n: statistics.median(v) for n, v in shipper_ms.items() if v},
        "server_cpu_ms_per_step": statistics.median(server_ms),
        "training_cpu_ms_per_step": workers * 1e3 / medians["off"],
        "train_loss_points_delivered": delivered,
    }


def _shipper_cpu_s(run_dir: str) -> float | None:
    log = Path(run_dir, "logs", "launcher.jsonl")
    if not log.exists():
        return None
    for line in log.read_text().splitlines():
        entry = json.loads(line)
        if "shipper_cpu_s" in entry:  # after start-up: what sending the points cost
            return entry["shipper_cpu_s"] - (entry.get("shipper_startup_cpu_s") or 0.0)
    return None


def _tree_cpu_s(pid: int) -> float:
    """CPU-seconds of a process and its live children (the server's workers)."""
    import psutil

    total = 0.0
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            continue
    return total


def _points(summary: dict) -> int:
    """How many train/loss points reached MLflow (0 when tracking was off)."""
    if not summary.get("mlflow_run_id"):
        return 0
    from mlflow import MlflowClient

    uri = json.loads(Path(summary["run_dir"], "tracking", "mlflow_run.json").read_text())["uri"]
    return len(MlflowClient(uri).get_metric_history(summary["mlflow_run_id"], "train/loss"))


if __name__ == "__main__":
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    main()
