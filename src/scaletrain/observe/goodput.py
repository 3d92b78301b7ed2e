"""Goodput: the share of a launch's wall time spent on training steps that count, and where the
rest went (start-up, checkpoint stalls, steps redone after a restart, the remainder: restarts'
downtime, evaluations outside the step windows, shutdown and the final export).

Read from rank 0's telemetry file before the launch and after it (its counters go on across
attempts and resumes), so the figures are this launch's alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from scaletrain.observe.telemetry import load_figures

__all__ = ["rank0_figures", "goodput"]


def rank0_figures(telemetry_dir: Path) -> dict[str, Any]:
    return load_figures(telemetry_dir / "rank-0.json")


def _sum(figures: dict[str, Any], name: str) -> float:
    value = figures.get(name)
    if isinstance(value, dict):
        value = value.get("sum", 0.0)
    return float(value) if isinstance(value, (int, float)) else 0.0


def goodput(before: dict[str, Any], after: dict[str, Any], final_step: int | None, started_at: float,
            wall_s: float, request_id: str) -> dict[str, float] | None:
    """None when rank 0 ran no step this launch, or its figures are not on this machine.
    Start-up: from the launch to its first step (of its first attempt, if it restarted)."""
    steps_run = _sum(after, "steps_total") - _sum(before, "steps_total")
    step_s = _sum(after, "step_seconds") - _sum(before, "step_seconds")
    first, progress_from = after.get("first_step_timestamp_seconds"), after.get("launch_progress_from")
    if (steps_run <= 0 or step_s <= 0 or final_step is None or wall_s <= 0
            or after.get("first_step_request_id") != request_id or after.get("launch_request_id") != request_id
            or not isinstance(first, (int, float)) or not isinstance(progress_from, (int, float))):
        return None
    # Steps from their marks (they outlive a SIGKILL); their time at the mean the figures counted.
    mean_step_s = step_s / steps_run
    productive = max(0.0, final_step - progress_from) * mean_step_s
    redone = (_sum(after, "redone_steps_total") - _sum(before, "redone_steps_total")) * mean_step_s
    stall = _sum(after, "checkpoint_save_seconds") - _sum(before, "checkpoint_save_seconds")
    startup = max(0.0, first - started_at)
    return {
        "ratio": round(productive / wall_s, 4),
        "productive_s": round(productive, 3),
        "startup_s": round(startup, 3),
        "checkpoint_stall_s": round(stall, 3),
        "redone_s": round(redone, 3),
        "other_s": round(max(0.0, wall_s - productive - startup - stall - redone), 3),
    }
