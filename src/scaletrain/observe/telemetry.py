"""One process's share of the job's live figures, kept in memory and written as one small JSON
file the launcher's endpoint reads on each scrape (exporter.py).

A side channel, off the training step's path: updates are a few dict operations, and the file
is rewritten (temporary file, rename; no fsync: these are figures, not records) at most every
``every_s``. Counters go on from the file an earlier attempt of the run left, so a restart
reads as more work done, never as a reset. A process installs its telemetry once
(``install``); the code that counts something takes it from ``current()``, a no-op one when
nothing was installed (a unit test, a tool).
"""

from __future__ import annotations

import bisect
import json
import mmap
import os
import struct
import threading
import time
from pathlib import Path
from typing import Any

from scaletrain.observe.catalog import FIGURES

__all__ = ["Telemetry", "TelemetrySink", "StepMark", "read_step_mark", "current", "install", "load_figures"]


class Telemetry:
    def __init__(self, path: str | Path | None, labels: dict[str, str] | None = None, every_s: float = 1.0):
        self.path = Path(path) if path is not None else None
        self.labels = dict(labels or {})
        self.every_s = every_s
        self.figures: dict[str, Any] = load_figures(self.path)
        self._lock = threading.Lock()  # an async checkpoint's thread counts too
        self._written_at = 0.0

    def add(self, name: str, value: float = 1.0, label: str | None = None) -> None:
        """A counter goes up (by ``value``; ``label``: the value of the figure's label)."""
        with self._lock:
            if label is None:
                self.figures[name] = self.figures.get(name, 0.0) + value
            else:
                by = self.figures.setdefault(name, {})
                by[label] = by.get(label, 0.0) + value

    def set(self, name: str, value: float, label: str | None = None) -> None:
        with self._lock:
            if label is None:
                self.figures[name] = value
            else:
                self.figures.setdefault(name, {})[label] = value

    def observe(self, name: str, value: float, count: int = 1) -> None:
        """``count`` observations of ``value`` in a histogram."""
        self.observe_many(name, [(value, count)])

    def observe_many(self, name: str, observations: list[tuple[float, int]]) -> None:
        """``(value, count)`` observations in a histogram, under one lock."""
        buckets = FIGURES[name].buckets
        with self._lock:
            hist = self.figures.setdefault(name, {"counts": [0] * (len(buckets) + 1), "sum": 0.0})
            counts, total = hist["counts"], hist["sum"]
            for value, count in observations:
                counts[bisect.bisect_left(buckets, value)] += count
                total += value * count
            hist["sum"] = total

    def work(self, kind: str, units: float = 1.0, errors: float = 0.0) -> None:
        """Units of work of a kind done (or tried), and how many of them failed."""
        self.add("work_total", units, kind)
        # Errors at 0 from the first unit on: Prometheus' rate() sees the first error as an increase.
        self.add("errors_total", errors, kind)

    def flush(self, force: bool = False) -> None:
        """Write the file, if ``every_s`` has passed since the last write (or ``force``)."""
        now = time.monotonic()
        if self.path is None or (not force and now - self._written_at < self.every_s):
            return
        self._written_at = now
        with self._lock:
            text = json.dumps({"labels": self.labels, "pid": os.getpid(), "time": time.time(),
                               "figures": self.figures})
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            temporary.write_text(text, encoding="utf-8")
            os.replace(temporary, self.path)
        except OSError:
            pass  # figures for a live view: a full disk must not stop training over them


def load_figures(path: Path | None) -> dict[str, Any]:
    """The figures an earlier attempt left (counters go on from them)."""
    if path is None:
        return {}
    try:
        figures = json.loads(path.read_text(encoding="utf-8")).get("figures")
    except (OSError, ValueError, AttributeError):
        return {}
    return figures if isinstance(figures, dict) else {}


_current = Telemetry(None)


def current() -> Telemetry:
    return _current


def install(telemetry: Telemetry) -> Telemetry:
    """This process's telemetry from now on; returns the one it replaces."""
    global _current
    previous, _current = _current, telemetry
    return previous


class TelemetrySink:
    """A Reporter sink on every rank: each reported window of steps (this rank's own timing)
    goes into the rank's figures; each step moves its last step and time. The flush, rate-limited,
    rides on the step."""

    def __init__(self, telemetry: Telemetry, world_size: int, is_main: bool, request_id: str | None = None,
                 reached_before: int | None = None):
        self.telemetry = telemetry
        self.request_id = request_id  # the launch's: its first step is kept across its restarts
        # The step the previous attempt of this rank reached (its step mark, which outlives a
        # SIGKILL): the steps between the resumed step and it are trained again (goodput).
        self.reached_before = reached_before
        self.world_size = max(1, world_size)
        self.is_main = is_main  # counts the job's steps as units of work (once, not per rank)
        self.last_reported: int | None = None

    def on_start(self, total_steps: int | None, start_step: int) -> None:
        self.last_reported = start_step
        figures, reached = self.telemetry.figures, self.reached_before or 0
        self.telemetry.add("redone_steps_total", max(0, reached - start_step))
        if self.request_id is not None and figures.get("launch_request_id") != self.request_id:
            # What this launch trains that no earlier one did starts here.
            figures["launch_request_id"] = self.request_id
            figures["launch_progress_from"] = max(start_step, reached)
        self.telemetry.flush(force=True)

    def on_step(self, step: int) -> None:
        figures, now = self.telemetry.figures, time.time()
        figures["last_step"] = step
        figures["last_step_timestamp_seconds"] = now
        if self.request_id is not None and figures.get("first_step_request_id") != self.request_id:
            # The launch's first step (goodput's start-up): a restart within it keeps it.
            figures["first_step_request_id"] = self.request_id
            figures["first_step_timestamp_seconds"] = now
        self.telemetry.flush()

    def on_train_metrics(self, reports: Any) -> None:
        """The window's figures summed first, then a few updates: a window of a step each
        (tracking every step) costs the step's thread little more than one of many steps."""
        t = self.telemetry
        names = ("step_time_s", "samples_per_s", "tokens_per_s", "data_wait_s")
        if hasattr(reports, "column"):  # the loop's ReportWindow: its columns, no dict per step
            steps = reports.steps
            times, rates, tokens, waits = (reports.column(name) for name in names)
        else:  # StepReports (tracking/reporter.py)
            steps = [report.step for report in reports]
            times, rates, tokens, waits = ([report.metrics.get(name) for report in reports] for name in names)
        previous = self.last_reported if self.last_reported is not None else steps[0] - 1
        self.last_reported = steps[-1]
        total, timed = 0, []
        samples: float | None = None
        token_count: float | None = None
        waited: float | None = None
        for step, step_time, rate, count, wait in zip(steps, times, rates, tokens, waits):
            covered, previous = step - previous, step  # the steps since the last report
            if covered <= 0:
                continue
            total += covered
            if step_time is not None:
                timed.append((step_time, covered))
                if rate is not None:
                    samples = (samples or 0.0) + rate * step_time * covered
                if count is not None:
                    token_count = (token_count or 0.0) + count * step_time * covered
            if wait is not None:
                waited = (waited or 0.0) + wait * covered
        if total:
            t.add("steps_total", total)
            if self.is_main:
                t.work("step", total)
        if timed:
            t.observe_many("step_seconds", timed)
        if samples is not None:
            t.add("samples_total", samples / self.world_size)
        if token_count is not None:
            t.add("tokens_total", token_count / self.world_size)
        if waited is not None:
            t.add("data_wait_seconds_total", waited)
        t.flush()

    def on_eval_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.telemetry.add("evals_total")

    def on_end(self) -> None:
        self.telemetry.flush(force=True)


class StepMark:
    """This rank's last finished step in the 8 bytes of a shared memory map: stored every step
    without a system call, and read by the launcher when the rank hangs or dies (the page stays
    in the OS's cache after the process is gone), so the root cause can say after which step."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, 8)
            self._map = mmap.mmap(fd, 8)
        finally:
            os.close(fd)
        self.set(0)

    def set(self, step: int) -> None:
        struct.pack_into("<q", self._map, 0, step)

    def close(self) -> None:
        self._map.close()


def read_step_mark(path: str | Path) -> int | None:
    try:
        data = Path(path).read_bytes()
    except OSError:
        return None
    return struct.unpack("<q", data)[0] if len(data) == 8 else None
