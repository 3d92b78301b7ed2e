"""What happened to a run and when, read from its JSON logs (the artifact ``logs/``): checkpoints,
attempts, resumes, restarts, alerts and stops, for the report's time axis. Pure functions over
lines: a torn or foreign line is skipped, never fatal."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

__all__ = ["Event", "read_lines", "worker_events", "launcher_events", "rank_figures", "histogram_quantile"]

_STEP_IN_NAME = re.compile(r"step-0*(\d+)")
_STOP_AT = re.compile(r"stopping at step (\d+)")


@dataclass(frozen=True)
class Event:
    time: float  # unix seconds
    kind: str  # start, checkpoint, resume, restart, alert, stop
    text: str
    step: int | None = None


def read_lines(text: str) -> list[dict[str, Any]]:
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("message"), str):
            row["_time"] = _unix(row.get("timestamp"))
            if row["_time"] is not None:
                rows.append(row)
    return rows


def _unix(stamp: Any) -> float | None:
    try:
        return datetime.fromisoformat(str(stamp)).timestamp()
    except ValueError:
        return None


def _step(row: dict[str, Any]) -> int | None:
    step = row.get("step")
    return step if isinstance(step, int) else None


def worker_events(rows: Iterable[dict[str, Any]]) -> list[Event]:
    """From rank 0's log: each attempt's start, checkpoints saved, resumes and agreed stops."""
    events = []
    for row in rows:
        message, at = row["message"], row["_time"]
        if message == "worker started":
            events.append(Event(at, "start", f"workers started ({row.get('world_size', '?')} ranks, "
                                            f"{row.get('device', '?')})"))
        elif message == "checkpoint saved":
            step = _step(row)
            events.append(Event(at, "checkpoint", f"checkpoint of step {step} saved", step))
        elif message.startswith("resuming from checkpoint"):
            found = _STEP_IN_NAME.search(message)
            step = int(found.group(1)) if found else None
            events.append(Event(at, "resume", f"resumed from the checkpoint of step {step}", step))
        elif (found := _STOP_AT.match(message)) is not None:
            events.append(Event(at, "stop", message, int(found.group(1))))
    return events


def launcher_events(rows: Iterable[dict[str, Any]]) -> list[Event]:
    """From the launcher's log: restarts after a failure and the alerts that fired."""
    events = []
    for row in rows:
        message, at = row["message"], row["_time"]
        if message.startswith("restarting the workers"):
            events.append(Event(at, "restart", message))
        elif row.get("code") == "ST-ALERT" and row.get("alert"):
            events.append(Event(at, "alert", message))
    return events


def histogram_quantile(q: float, buckets: tuple[float, ...], counts: list[float]) -> float | None:
    """Prometheus' estimate: linear within the bucket holding the q-th observation."""
    total = sum(counts)
    if total <= 0:
        return None
    rank, seen, lower = q * total, 0.0, 0.0
    for upper, count in zip([*buckets, float("inf")], counts):
        if count and seen + count >= rank:
            if upper == float("inf"):
                return lower
            return lower + (upper - lower) * (rank - seen) / count
        seen += count
        lower = upper
    return lower


def rank_figures(telemetry: dict[str, dict[str, Any]], buckets: tuple[float, ...]) -> list[dict[str, Any]]:
    """Per rank, from its telemetry file: steps, samples, step time (mean, p50, p90), samples/s
    while stepping, and the share of step time spent waiting for data."""
    ranks = []
    for name, document in telemetry.items():
        figures = document.get("figures") or {}
        rank = (document.get("labels") or {}).get("rank")
        hist = figures.get("step_seconds") or {}
        counts = [float(c) for c in hist.get("counts", [])]
        steps, busy = sum(counts), float(hist.get("sum", 0.0))
        if rank is None or not steps:
            continue
        samples = float(figures.get("samples_total", 0.0))
        wait = float(figures.get("data_wait_seconds_total", 0.0))
        ranks.append({
            "rank": int(rank),
            "steps": int(figures.get("steps_total", steps)),
            "samples": int(samples),
            "step_mean_s": busy / steps,
            "step_p50_s": histogram_quantile(0.5, buckets, counts),
            "step_p90_s": histogram_quantile(0.9, buckets, counts),
            "samples_per_s": samples / busy if busy > 0 else None,
            "data_wait_share": wait / busy if busy > 0 else None,
            "source": name,
        })
    return sorted(ranks, key=lambda r: r["rank"])
