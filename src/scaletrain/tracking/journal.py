"""The metric journal: every point is on local disk before anyone tries to send it.

``metrics.journal.jsonl`` holds points in order: one line per report window (its first
sequence number, the steps, their timestamps, the metric names once, and the values, a row per
step, as little-endian float64 in base64: writing floats as JSON text cost rank 0's training
thread ~10 us a step for 9 metrics, packing them ~1 us; lines with the values as JSON rows
are still read), or one line
per step (an evaluation, a window whose steps name different metrics, and journals written
before windows were); one write per report. ``metrics.journal.sent`` holds the highest sequence number delivered together
with everything before it. A later attempt (or the same one after an outage) sends what lies
past the cursor again. Points keep their original timestamp, so a point delivered twice is
the same point, and MLflow's SQL store keeps it once.
"""

from __future__ import annotations

import array
import base64
import itertools
import json
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from scaletrain.rundir.atomic import write_text_atomic

__all__ = ["MetricPoint", "MetricJournal"]


@dataclass(frozen=True)
class MetricPoint:
    seq: int
    key: str
    value: float
    step: int
    timestamp_ms: int


def _points(entry: dict) -> list[MetricPoint]:
    """The points of one line, of either kind."""
    seq = entry["seq"]
    if "steps" in entry:  # a report window
        keys, points = entry["keys"], []
        width = len(keys)
        values = entry["values"] if "values" in entry else _unpack(entry["f64"], width, len(entry["steps"]))
        rows = zip(entry["steps"], entry["ts"], values, strict=True)
        for number, (step, timestamp, row) in enumerate(rows):
            if len(row) != width:
                raise ValueError("a row without a value for every key")
            first = seq + number * width
            points += [MetricPoint(first + index, key, value, step, timestamp)
                       for index, (key, value) in enumerate(zip(keys, row))]
        return points
    return [MetricPoint(seq + index, key, value, entry["step"], entry["ts"])
            for index, (key, value) in enumerate(entry["values"].items())]


def _pack(rows: list[list[float]], width: int) -> str:
    flat = array.array("d", itertools.chain.from_iterable(rows))
    if len(flat) != width * len(rows):
        raise ValueError("a row without a value for every key")
    if sys.byteorder == "big":
        flat.byteswap()  # little-endian on every machine
    return base64.b64encode(flat.tobytes()).decode("ascii")


def _unpack(text: str, width: int, count: int) -> list[list[float]]:
    flat = array.array("d", base64.b64decode(text, validate=True))  # ValueError: not whole float64s
    if len(flat) != width * count:
        raise ValueError("a window whose values do not fill its rows")
    if sys.byteorder == "big":
        flat.byteswap()
    return [flat[index:index + width].tolist() for index in range(0, width * count, width)]


class MetricJournal:
    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / "metrics.journal.jsonl"
        self.cursor_path = self.directory / "metrics.journal.sent"
        self._lock = threading.Lock()
        self._file: IO[str] | None = None
        self._next_seq = self._last_seq() + 1

    def _last_seq(self) -> int:
        return max((point.seq for point in self.read_from(0)[0]), default=0)

    def last_steps(self) -> dict[str, int]:
        """The highest step journaled per metric prefix (``train``, ``eval``): after a restart
        the redone steps are not journaled twice."""
        last: dict[str, int] = {}
        for point in self.read_from(0)[0]:
            prefix = point.key.split("/", 1)[0]
            last[prefix] = max(last.get(prefix, 0), point.step)
        return last

    def read_from(self, offset: int) -> tuple[list[MetricPoint], int]:
        """Points in the complete lines after byte ``offset``, and the offset to read from next
        (a line still being written is left for the next call)."""
        if not self.path.exists():
            return [], offset
        with open(self.path, "rb") as handle:
            handle.seek(offset)
            data = handle.read()
        end = data.rfind(b"\n") + 1
        points = []
        for line in data[:end].decode("utf-8", "replace").splitlines():
            try:
                points.extend(_points(json.loads(line)))
            except (ValueError, TypeError, KeyError, AttributeError):
                continue  # a line torn by a crash mid-write: its points were never acknowledged
        return points, offset + end

    def append(self, rows: list[tuple[int, int, dict[str, float]]]) -> None:
        """Write ``(step, timestamp_ms, {key: value})`` rows in one write and flush them to the
        OS (they survive SIGKILL of this process)."""
        with self._lock:
            self._open()
            assert self._file is not None  # noqa: S101  opened above
            lines = []
            for step, timestamp_ms, values in rows:
                lines.append(json.dumps({"seq": self._next_seq, "step": step, "ts": timestamp_ms, "values": values}))
                self._next_seq += len(values)
            self._file.write("\n".join(lines) + "\n")
            self._file.flush()

    def append_window(self, steps: list[int], timestamps_ms: list[int], keys: list[str],
                      rows: list[list[float]]) -> None:
        """The steps of one report, each with a value for every one of ``keys``, as one line in
        one write (points numbered step by step, key by key, as ``append`` numbers them)."""
        with self._lock:
            self._open()
            line = json.dumps({"seq": self._next_seq, "steps": steps, "ts": timestamps_ms, "keys": keys,
                               "f64": _pack(rows, len(keys))})
            self._next_seq += len(steps) * len(keys)
            assert self._file is not None  # noqa: S101  opened above
            self._file.write(line + "\n")
            self._file.flush()

    def _open(self) -> None:
        if self._file is None:
            torn = self.path.exists() and self.path.stat().st_size > 0 and not self._ends_with_newline()
            self._file = open(self.path, "a", encoding="utf-8")
            if torn:  # a crash cut the last line short: start ours on a fresh one
                self._file.write("\n")

    def _ends_with_newline(self) -> bool:
        with open(self.path, "rb") as handle:
            handle.seek(-1, 2)
            return handle.read(1) == b"\n"

    def sent_cursor(self) -> int:
        try:
            return int(self.cursor_path.read_text(encoding="utf-8").strip() or 0)
        except (OSError, ValueError):
            return 0

    def mark_sent(self, seq: int) -> None:
        write_text_atomic(self.cursor_path, str(seq))

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
