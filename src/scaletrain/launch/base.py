"""A launcher starts the workers of one attempt and returns rank 0's result."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import Any

from scaletrain.errors import WorkerFailedError
from scaletrain.launch.spec import RunSpec

__all__ = ["Launcher", "worker_error"]


class Launcher(ABC):
    name: str = ""

    @abstractmethod
    def launch(self, spec: RunSpec, workers: int) -> dict[str, Any]:
        """Run ``workers`` copies of the worker entry point; raise WorkerFailedError on failure."""


def worker_error(spec: RunSpec, rank: int, fallback: str) -> WorkerFailedError:
    """The user-facing error for a failed rank, from the error file the worker wrote."""
    log_path = str(spec.worker_log(rank))
    try:
        data = json.loads(spec.worker_error(rank).read_text(encoding="utf-8"))
        what = f"{data['type']}: {data['message']}" if data.get("message") else data["type"]
    except (OSError, ValueError, KeyError):
        what = fallback
    return WorkerFailedError(
        f"worker rank {rank} failed: {what} (details: {log_path})", rank=rank, log_path=log_path
    )
