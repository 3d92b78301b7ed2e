"""The metric journal: every point is on local disk before anyone tries to send it.

``metrics.journal.jsonl`` holds points in order: one line per report window (its first
sequence number, the metric names once, and in one little-endian block in base64 the steps
(int64), their wall-clock times (float64 seconds) and the values, a column per metric
(float64): as JSON text the floats alone cost rank 0's training thread ~10 us a step; lines
that carry steps, times and values as JSON, or the values as packed rows, from earlier
versions, are still read), or one line per step (an evaluation, a window whose steps name
different metrics); one write per report. ``metrics.journal.sent`` holds the highest sequence
number delivered together with everything before it. A later attempt (or the same one after an
outage) sends what lies past the cursor again. Points keep their original timestamp, so a point delivered twice is
the same point, and MLflow's SQL store keeps it once.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import json
import struct
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
    """The points of one line, of any kind. A window's points are numbered step by step, key
    by key."""
    seq = entry["seq"]
    if "columns" in entry:  # a report window, packed
        keys, count = entry["keys"], entry["n"]
        width = len(keys)
        data = base64.b64decode(entry["columns"], validate=True)
        if len(data) != 8 * count * (width + 2):
            raise ValueError("a window whose values do not fill its columns")
        flat = struct.unpack(f"<{count}q{count * (width + 1)}d", data)
        packed = flat[2 * count:]
        return [MetricPoint(seq + number * width + index, key, packed[index * count + number], step,
                            int(flat[count + number] * 1000))
                for number, step in enumerate(flat[:count]) for index, key in enumerate(keys)]
    if "steps" in entry:  # a report window from an earlier version: rows as JSON or packed
        keys, points = entry["keys"], []
        width = len(keys)
        values = entry["values"] if "values" in entry else _unpack_rows(entry["f64"], width, len(entry["steps"]))
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


def _pack_window(steps: list[int], wall_times: list[float], columns: list[list[float]]) -> bytes:
    count = len(steps)
    if {len(wall_times), *map(len, columns)} != {count}:
        raise ValueError("a column without a value for every step")
    data = struct.pack(f"<{count}q{count * (len(columns) + 1)}d", *steps, *wall_times,
                       *itertools.chain.from_iterable(columns))
    return binascii.b2a_base64(data, newline=False)


def _unpack_rows(text: str, width: int, count: int) -> list[tuple[float, ...]]:
    raw = base64.b64decode(text, validate=True)
    if len(raw) != 8 * width * count:
        raise ValueError("a window whose values do not fill its rows")
    flat = struct.unpack(f"<{width * count}d", raw)
    return [flat[index:index + width] for index in range(0, width * count, width)]


class MetricJournal:
    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / "metrics.journal.jsonl"
        self.cursor_path = self.directory / "metrics.journal.sent"
        self._lock = threading.Lock()
        self._file: IO[bytes] | None = None
        self._keys: tuple[list[str], bytes] = ([], b"[]")  # the last window's keys, and as JSON
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
            self._file.write(("\n".join(lines) + "\n").encode())
            self._file.flush()

    def append_window(self, steps: list[int], wall_times: list[float], keys: list[str],
                      columns: list[list[float]]) -> None:
        """The steps of one report (``wall_times``: time.time() at each), a column of values
        for each of ``keys``, as one line in one write (points numbered step by step, key by
        key, as ``append`` numbers them)."""
        if len(columns) != len(keys):
            raise ValueError("a key without a column of values")
        packed = _pack_window(steps, wall_times, columns)
        with self._lock:
            if keys != self._keys[0]:  # (a window's keys are the last one's, as a rule)
                self._keys = (list(keys), json.dumps(keys).encode())
            self._open()
            # The line by hand (json.dumps cost ~8 us of a 20-step window): base64 needs no escaping.
            line = b'{"seq": %d, "keys": %s, "n": %d, "columns": "%s"}\n' % (self._next_seq, self._keys[1], len(steps), packed)
            self._next_seq += len(steps) * len(keys)
            assert self._file is not None  # noqa: S101  opened above
            self._file.write(line)
            self._file.flush()

    def _open(self) -> None:
        if self._file is None:
            torn = self.path.exists() and self.path.stat().st_size > 0 and not self._ends_with_newline()
            self._file = open(self.path, "ab")
            if torn:  # a crash cut the last line short: start ours on a fresh one
                self._file.write(b"\n")

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
