"""The run directory and what a launcher hands every worker (RunSpec): plain data, so any engine
(local, Ray) can ship it. A leaf: launchers, workers, the tracking process and the checkpoint
tools all read it, and it imports nothing of scaletrain."""

from __future__ import annotations

import json
import os
import secrets
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["RunSpec", "new_run_id"]


def new_run_id() -> str:
    """Sortable by start time, unique without coordination: 20261202-141500-3fa9c1."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


@dataclass
class RunSpec:
    job: dict[str, Any]  # the resolved JobConfig, as JSON-able data
    run_id: str
    run_dir: str
    trace_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    python_path: list[str] = field(default_factory=list)  # where task.target is imported from
    threads: int = 1  # intra-op threads per worker
    tracking_uri: str | None = None  # MLflow: the store or server of the job's run
    tracking_run_id: str | None = None  # the job's MLflow run, once open (tracking/mlflow_run.json has it too)
    attempt: int = 0  # launches of this run: 1 for `run`, +1 for each `scaletrain resume`
    node_rank: int = 0  # several nodes: this launcher's (0: the driver, which tracks the run)
    checkpoints: str | None = None  # where checkpoints go, resolved by the launcher
    # Where a worker on another machine than the driver's writes (its logs, rank 0's outputs
    # until they are relayed); None: the run directory itself (same machine, or shared).
    local_dir: str | None = None

    @property
    def out_dir(self) -> Path:
        """Where this process writes the run's files: the run directory, or its local stand-in."""
        return Path(self.local_dir or self.run_dir)

    @property
    def logs_dir(self) -> Path:
        return self.out_dir / "logs"

    def worker_log(self, rank: int) -> Path:
        return self.logs_dir / f"worker-{rank}.jsonl"

    def worker_error(self, rank: int) -> Path:
        return self.logs_dir / f"worker-{rank}.error.json"

    def worker_stacks(self, rank: int) -> Path:
        return self.logs_dir / f"worker-{rank}.stacks.txt"

    def worker_result(self) -> Path:
        """This node's result, written by its first worker (rank 0's on the driver)."""
        return self.logs_dir / "node-result.json"

    def write(self) -> Path:
        """Save the spec in the run directory, for engines that start workers as commands."""
        path = Path(self.run_dir) / "spec.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        # The unredacted job: readable by its owner only, and never logged as an artifact.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(json.dumps(asdict(self), indent=2))
        return path

    @classmethod
    def read(cls, path: str | os.PathLike) -> RunSpec:
        return cls(**json.loads(Path(path).read_text(encoding="utf-8")))

    @classmethod
    def in_dir(cls, job: dict[str, Any], run_root: str | os.PathLike, run_id: str | None = None,
               **kwargs: Any) -> RunSpec:
        run_id = run_id or new_run_id()
        run_dir = Path(run_root) / job["name"] / run_id
        return cls(job=job, run_id=run_id, run_dir=str(run_dir.resolve()), **kwargs)
