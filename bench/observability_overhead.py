"""Observability overhead: what the live figures (telemetry files, the launcher's Prometheus
endpoint, the built-in alerts) cost training, with observability on against off.

1. Critical path, precise. One process, one trainer, its reporter switched between blocks of 200
   steps with the rank's telemetry (a TelemetrySink: each reported window into the figures, the
   last step every step, the file rewritten at most once a second) and without, in A B B A order;
   median training-thread CPU microseconds per step (time.thread_time: what another tenant's load
   does not inflate). Tracking is off in both: this is observability's own cost.
2. End to end. `scaletrain run` on the job with 2 workers, A B B A: observability off, and on with
   the alerts evaluated every second and the endpoint scraped every second (ten times Prometheus'
   usual rate) by this script; steady-state steps/s (first third skipped). Every "on" run must
   have answered its scrapes.

    .venv/bin/python bench/observability_overhead.py                # quick
    .venv/bin/python bench/observability_overhead.py --repeats 3 --steps 4000 --blocks 100
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import urllib.request
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, alternating_blocks, emit, run_scaletrain, steady_steps_per_s  # noqa: E402

sys.path.insert(0, str(REPO))
from tests.helpers.servers import free_port  # noqa: E402

BLOCK_STEPS = 200


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=1, help="A B B A rounds end to end")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--blocks", type=int, default=30, help="critical-path blocks per variant")
    parser.add_argument("--job", default="examples/digits.yaml")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    result = {"job": args.job, "steps": args.steps, "repeats": args.repeats,
              "critical_path": critical_path(args.job, args.blocks),
              "end_to_end": end_to_end(args.job, args.steps, args.repeats)}
    step_us = 1e6 / result["end_to_end"]["steps_per_s"]["off"]["median"]
    crit = result["critical_path"]
    crit["extra_vs_2_worker_step"] = crit["extra_paired_median"] * crit["us_per_step"]["off"] / step_us
    emit(result, args.out)


def critical_path(job_file: str, blocks: int) -> dict:
    import torch

    from scaletrain.config.loading import load_job
    from scaletrain.data.loader import train_loader
    from scaletrain.distributed.device import choose_placement
    from scaletrain.distributed.env import DistEnv
    from scaletrain.engine.trainer import Trainer
    from scaletrain.observe.telemetry import Telemetry, install
    from scaletrain.rundir import RunSpec
    from scaletrain.task import build_task
    from scaletrain.tracking.logs import LogContext
    from scaletrain.tracking.worker_sinks import worker_reporter

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="st-bench-obs-"))
    job_path = (REPO / job_file).resolve()
    job = load_job(job_path, ["scale.workers=1", "train.epochs=null", "train.max_steps=100000000",
                              "train.eval_every=null", "train.log_every=20", "tracking.enabled=false"])
    spec = RunSpec.in_dir(job.model_dump(mode="json"), tmp / "run", python_path=[str(job_path.parent)])
    Path(spec.run_dir).mkdir(parents=True)
    context = LogContext(spec.run_id, spec.trace_id, 0)
    figures = {"on": Telemetry(spec.telemetry_dir / "rank-0.json", {"rank": "0"}), "off": Telemetry(None)}
    reporters = {name: worker_reporter(spec, job, context, True, None, telemetry, 1)
                 for name, telemetry in figures.items()}
    env = DistEnv()
    task = build_task(job.task.target, job.task.args, spec.python_path)
    trainer = Trainer(job, task, env, choose_placement(env), reporters["off"])
    batches = iter(train_loader(
        trainer.train_set, trainer.layout, rank=0, seed=job.seed, shuffle=True, start_step=0,
        stop_step=trainer.max_steps, loader_workers=0, collate=trainer.collate, pin_memory=False,
    ))
    for reporter in reporters.values():
        reporter.on_start(trainer.max_steps, 0)

    def setting(name: str) -> Callable[[], None]:
        def apply() -> None:
            trainer.reporter = reporters[name]
            install(figures[name])
        return apply

    wall, cpu = alternating_blocks(trainer, batches, {"off": setting("off"), "on": setting("on")}, blocks, BLOCK_STEPS)
    for reporter in reporters.values():
        reporter.on_end()
    med_cpu = {name: statistics.median(v) * 1e6 for name, v in cpu.items()}
    med_wall = {name: statistics.median(v) * 1e6 for name, v in wall.items()}
    paired = [b / a - 1 for a, b in zip(cpu["off"], cpu["on"])]
    written = figures["on"].figures.get("steps_total", 0)
    return {
        "what": "one process, 1 thread, one trainer, alternating blocks of 200 steps with the rank's "
                "telemetry and without (tracking off in both); training-thread CPU time",
        "us_per_step": {name: round(v, 1) for name, v in med_cpu.items()},
        "wall_us_per_step": {name: round(v, 1) for name, v in med_wall.items()},
        "extra_us_per_step": round(med_cpu["on"] - med_cpu["off"], 1),
        "extra_paired_median": statistics.median(paired),
        "telemetry_steps_counted": written,
        "blocks": blocks,
    }


class _Scraper:
    """GET the endpoint every second, as Prometheus would (ten times its usual rate)."""

    def __init__(self, port: int):
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.answered = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            try:
                with urllib.request.urlopen(self.url, timeout=2) as response:  # noqa: S310  loopback
                    if b"scaletrain_steps_total" in response.read():
                        self.answered += 1
            except OSError:
                pass

    def __enter__(self) -> _Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def end_to_end(job: str, steps: int, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        base = [f"train.max_steps={steps}", "train.epochs=null", "train.eval_every=null", "scale.workers=2",
                f"run_dir={Path(tmp) / 'runs'}", "train.log_every=20", "tracking.enabled=false",
                "checkpoint.every_steps=null"]
        speeds: dict[str, list[float]] = {"off": [], "on": []}
        scrapes: list[int] = []
        for index in range(2 * repeats):  # A B B A
            for name in ("off", "on") if index % 2 == 0 else ("on", "off"):
                if name == "off":
                    summary = run_scaletrain(job, [*base, "observability.enabled=false"])
                else:
                    port = free_port()
                    with _Scraper(port) as scraper:
                        summary = run_scaletrain(job, [*base, "observability.enabled=true",
                                                       f"observability.port={port}",
                                                       "observability.alerts.every_s=1"])
                    scrapes.append(scraper.answered)
                speeds[name].append(steady_steps_per_s(summary["run_dir"], skip=steps // 3))
    if min(scrapes) == 0:
        raise RuntimeError(f"an observed run answered no scrape: {scrapes}")
    medians = {name: statistics.median(v) for name, v in speeds.items()}
    return {
        "steps_per_s": {n: {"median": medians[n], "min": min(v), "max": max(v)} for n, v in speeds.items()},
        "cost_vs_off": 1 - medians["on"] / medians["off"],
        "noise_off_spread": (max(speeds["off"]) - min(speeds["off"])) / medians["off"],
        "scrapes_answered": scrapes,
        "steps": steps,
    }


if __name__ == "__main__":
    main()
