"""Structured JSON logs: one file per worker, plus stderr when it is not a terminal.

Every record carries timestamp, level, message, run_id, trace_id (the run's: the same across
restarts and resumes), request_id (this invocation of scaletrain: a resume has its own), rank
and the current step, so the lines of all workers of all attempts can be merged and filtered
with jq. Other libraries' lines routed into the run's logs (torch elastic, Ray) carry them too.
"""

from __future__ import annotations

import json
import logging
import sys
import traceback
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from scaletrain.tracking.redact import Redactor

__all__ = ["JsonFormatter", "LogContext", "setup_logging", "LOGGER_NAME", "LAUNCHER_LOGGER_NAME"]

LOGGER_NAME = "scaletrain"
# The launcher's own records (tracking, sending) live apart from the workers' ``scaletrain``
# logger, so an in-process worker and its launcher never write each other's lines twice.
LAUNCHER_LOGGER_NAME = "scaletrain_launcher"
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class LogContext:
    """The fields stamped on every record of this process; ``step`` moves as training does."""

    def __init__(self, run_id: str | None, trace_id: str | None, rank: int | None, request_id: str | None = None):
        self.run_id = run_id
        self.trace_id = trace_id
        self.request_id = request_id
        self.rank = rank
        self.step: int | None = None

    @classmethod
    def for_spec(cls, spec: Any, rank: int | None) -> LogContext:
        return cls(spec.run_id, spec.trace_id, rank, getattr(spec, "request_id", None))


class _ContextFilter(logging.Filter):
    def __init__(self, context: LogContext):
        super().__init__()
        self.context = context

    def filter(self, record: logging.LogRecord) -> bool:
        record.run_id = self.context.run_id
        record.trace_id = self.context.trace_id
        record.request_id = self.context.request_id
        record.rank = self.context.rank
        if getattr(record, "step", None) is None:
            record.step = self.context.step
        return True


class JsonFormatter(logging.Formatter):
    def __init__(self, redactor: Redactor | None = None):
        super().__init__()
        self.redactor = redactor

    def format(self, record: logging.LogRecord) -> str:
        entry = self._entry(record)
        # Masked before encoding: JSON escapes a secret with a quote or an accent.
        return self.redactor.json(entry) if self.redactor else json.dumps(entry, default=str)

    def _entry(self, record: logging.LogRecord) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "timestamp": datetime.fromtimestamp(record.created, timezone.utc).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname.lower(),
            "message": record.getMessage(),
            "logger": record.name,
            "run_id": getattr(record, "run_id", None),
            "trace_id": getattr(record, "trace_id", None),
            "request_id": getattr(record, "request_id", None),
            "rank": getattr(record, "rank", None),
            "step": getattr(record, "step", None),
        }
        for key, value in vars(record).items():
            # A library's private extras (Ray's _ray_timestamp_ns) are not ours to print.
            if key not in _STANDARD and key not in entry and key != "console" and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exception"] = "".join(traceback.format_exception(*record.exc_info))
        return entry


class _HumanFormatter(logging.Formatter):
    def __init__(self, redactor: Redactor | None = None):
        super().__init__()
        self.redactor = redactor

    def format(self, record: logging.LogRecord) -> str:
        rank = getattr(record, "rank", None)
        where = f"[rank {rank}] " if rank is not None else ""
        line = f"{record.levelname.lower()}: {where}{record.getMessage()}"
        return self.redactor.text(line) if self.redactor else line


def setup_logging(
    context: LogContext,
    log_file: str | Path | None,
    console_level: int = logging.INFO,
    redactor: Redactor | None = None,
    logger_name: str = LOGGER_NAME,
) -> Callable[[], None]:
    """Attach the file and console handlers to the ``scaletrain`` logger; returns the undo.

    On a terminal the console shows warnings and errors in plain words (the progress bar tells
    the rest); elsewhere it gets the same JSON lines as the file.
    """
    logger = logging.getLogger(logger_name)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    context_filter = _ContextFilter(context)
    handlers: list[logging.Handler] = []
    if log_file is not None:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(log_file, encoding="utf-8")
        file_handler.setFormatter(JsonFormatter(redactor))
        file_handler.setLevel(logging.DEBUG)
        handlers.append(file_handler)
    console = logging.StreamHandler(sys.stderr)
    console.addFilter(lambda record: getattr(record, "console", True))
    if sys.stderr.isatty():
        console.setFormatter(_HumanFormatter(redactor))
        console.setLevel(logging.WARNING)
    else:
        console.setFormatter(JsonFormatter(redactor))
        console.setLevel(console_level)
    handlers.append(console)
    for handler in handlers:
        handler.addFilter(context_filter)
        logger.addHandler(handler)

    def undo() -> None:
        for handler in handlers:
            logger.removeHandler(handler)
            handler.close()

    return undo


def route_loggers_to_file(
    names: tuple[str, ...], path: str | Path, level: int | None = None, *, redactor: Redactor,
    context: LogContext | None = None,
) -> Callable[[], None]:
    """Send other libraries' loggers (torch elastic, Ray) to a JSON file in the run's logs
    instead of the console, redacted like the run's own lines and stamped with ``context`` (the
    run's trace id); returns the undo."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(JsonFormatter(redactor))
    if context is not None:
        handler.addFilter(_ContextFilter(context))
    saved = []
    for name in names:
        logger = logging.getLogger(name)
        saved.append((logger, logger.propagate, logger.level, list(logger.handlers)))
        for existing in list(logger.handlers):
            logger.removeHandler(existing)
        logger.addHandler(handler)
        logger.propagate = False
        if level is not None:
            logger.setLevel(level)

    def undo() -> None:
        for logger, propagate, old_level, handlers in saved:
            logger.removeHandler(handler)
            for existing in handlers:
                logger.addHandler(existing)
            logger.propagate = propagate
            logger.setLevel(old_level)
        handler.close()

    return undo
