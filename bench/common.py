"""Shared helpers for the benchmarks: run scaletrain, read steady-state throughput."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# docs/benchmarks.md's section that bench/gpu_check.py --table writes; `make bench` keeps it.
GPU_SECTION = ("<!-- gpu-check:start -->", "<!-- gpu-check:end -->")


def run_scaletrain(job: str, overrides: list[str], env: dict | None = None) -> dict:
    """``scaletrain run JOB --json`` as a user would; returns the summary. Through this
    interpreter (``python -m scaletrain``): a machine with scaletrain on PYTHONPATH and no
    installed ``scaletrain`` command (the GPU check's) runs it the same way."""
    import os

    args = [sys.executable, "-m", "scaletrain", "run", job, "--json"]
    for item in overrides:
        args += ["--set", item]
    out = subprocess.run(args, cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, **(env or {})})
    if out.returncode != 0:
        raise RuntimeError(f"scaletrain failed ({out.returncode}): {out.stderr[-3000:]}")
    try:
        return json.loads(out.stdout)
    except ValueError:
        raise RuntimeError(f"no JSON summary on stdout: {out.stdout[:500]!r} {out.stderr[-1500:]}") from None


def profile_example(job_path: str | Path, overrides: list[str] | tuple[str, ...] = (),
                    batch: int | None = None):
    """An example job, its task and the planner's profile of it (timed at ``batch``, default the
    job's, with its optimizer): what the benches compare with reality."""
    from scaletrain.config.loading import load_job
    from scaletrain.plan.model_profile import profile_task
    from scaletrain.task import build_task

    job = load_job(REPO / job_path, list(overrides))
    task = build_task(job.task.target, job.task.args, [str(REPO / "examples")])
    profile = profile_task(task, job.name, job.train.precision, batch=batch or job.data.batch_size,
                           optimizer=job.optim.name)
    return job, task, profile


def steady_steps_per_s(run_dir: str | Path, skip: int = 20) -> float:
    """Steps/s after the first ``skip`` steps, from the step times of every report window."""
    rows = [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
    reports = [r for r in rows if r["split"] == "train"]
    elapsed, steps, previous = 0.0, 0, None
    for row in reports:
        if previous is not None and previous >= skip:
            elapsed += row["step_time_s"] * (row["step"] - previous)
            steps += row["step"] - previous
        previous = row["step"]
    return steps / elapsed


def emit(result: dict, out: str | None) -> None:
    """Print a bench's JSON result, and write it to ``out`` when given."""
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n")


def gpu_section(markdown: str) -> str | None:
    """The GPU check's section of a benchmarks page, markers included (None if it has none)."""
    start, end = markdown.find(GPU_SECTION[0]), markdown.find(GPU_SECTION[1])
    return markdown[start:end + len(GPU_SECTION[1])] if 0 <= start < end else None


def alternating_blocks(trainer: Any, batches: Any, switch: dict[str, Callable[[], None]], blocks: int,
                       block_steps: int = 200) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Trainer.fit's loop in blocks of ``block_steps`` steps, one trainer in one process, the
    settings of ``switch`` (name -> what puts the trainer in it) alternating A B B A after one
    warm-up block each (an A/A run showed the second block of a pair slower here): wall and
    training-thread CPU seconds per step of every block, by setting. The caller has started
    the trainer's reporters; ``batches`` is its batch iterator."""
    import time

    from scaletrain.engine.metrics import MetricsWindow
    from scaletrain.engine.trainer import TrainResult

    window, outcome = MetricsWindow(time.perf_counter(), trainer.step), TrainResult(steps=trainer.step)

    def block(name: str) -> tuple[float, float]:
        switch[name]()
        started, cpu = time.perf_counter(), time.thread_time()
        for _ in range(block_steps):
            out = trainer.train_step(batches, report=trainer._due(trainer.report_every))
            trainer.step += 1
            window.add(out, trainer.step)
            trainer._between_steps(window, outcome)
        return (time.perf_counter() - started) / block_steps, (time.thread_time() - cpu) / block_steps

    for name in switch:  # warm up
        block(name)
    wall: dict[str, list[float]] = {name: [] for name in switch}
    cpu: dict[str, list[float]] = {name: [] for name in switch}
    names = list(switch)
    for index in range(blocks):
        for name in names if index % 2 == 0 else reversed(names):
            w, c = block(name)
            wall[name].append(w)
            cpu[name].append(c)
    return wall, cpu
