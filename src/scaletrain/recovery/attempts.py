"""What a worker knows of its attempt: which start of the launch this is, and the error file it
leaves when it fails (the launcher's root-cause analysis reads them: recovery/root_cause.py)."""

from __future__ import annotations

import json
import logging
import os
import time
import traceback
from typing import Any

from scaletrain.rundir import RESTART_COUNT_ENV, RunSpec
from scaletrain.rundir.atomic import write_text_atomic
from scaletrain.tracking.logs import LOGGER_NAME
from scaletrain.tracking.redact import Redactor

__all__ = ["restart_count", "write_error"]

log = logging.getLogger(f"{LOGGER_NAME}.worker")


def restart_count() -> int:
    """Which start of this launch this is, 0 for the first (our launchers count and tell each
    worker; torch elastic's own count, under plain torchrun, misses a restart caused by another
    node)."""
    count = os.environ.get(RESTART_COUNT_ENV) or os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return int(count or 0)


def error_code(exc: BaseException) -> str:
    """The stable code of an error (docs/observability.md): ours, or ST-USER-ERROR for what the
    job's own code or a library raised."""
    return str(getattr(exc, "code", None) or "ST-USER-ERROR")


def write_error(spec: RunSpec, rank: int, exc: BaseException, redactor: Redactor,
                steps: int | None = None) -> dict[str, Any]:
    """A small JSON file per failed rank, so any launcher can show the user the real error (and
    the steps trained); returns the record written (redacted)."""
    error = {
        "rank": rank,
        "steps": steps,
        "type": type(exc).__name__,
        "code": error_code(exc),
        "message": redactor.text(str(exc)),
        "traceback": redactor.text(traceback.format_exc()),
        "timestamp": time.time(),
    }
    try:
        write_text_atomic(spec.worker_error(rank), json.dumps(error))
    except OSError:
        log.warning("could not write the error file for rank %s", rank, exc_info=True)
    return error
