"""What a launcher hands every worker (RunSpec): plain data, so any engine (local, Ray) can ship
it; where each of a run's files is; run ids."""

from __future__ import annotations

import json
import os
import re
import secrets
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from scaletrain.errors import ConfigError
from scaletrain.rundir.atomic import write_text_atomic
from scaletrain.rundir.names import (
    LAUNCHER_LOG,
    LOGS_DIR,
    NODE_RESULT_FILE,
    SPEC_FILE,
    TELEMETRY_DIR,
    worker_error_name,
    worker_log_name,
    worker_stacks_name,
    worker_step_name,
)

__all__ = ["RunSpec", "new_run_id", "check_run_ref"]

# What a user may name a run by (scaletrain's run id, MLflow's run id): no quote, glob
# character or path separator, so it is safe in an MLflow filter and in a glob.
_RUN_REF = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def new_run_id() -> str:
    """Sortable by start time, unique without coordination: 20261202-141500-3fa9c1."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


def check_run_ref(ref: str) -> str:
    """``ref`` if it can be a run id; else ConfigError (exit 2) with one line."""
    if not _RUN_REF.fullmatch(ref):
        raise ConfigError(
            f"{ref!r} is not a run id: use the scaletrain or MLflow run id as `scaletrain runs` "
            "lists it (letters, digits, '.', '_' and '-')"
        )
    return ref


# Fields an older version's spec.json may hold and this one no longer has (tracking_uri and
# tracking_run_id: nothing read them; tracking/mlflow_run.json records the job's MLflow run).
_RETIRED_FIELDS = ("tracking_uri", "tracking_run_id")


@dataclass
class RunSpec:
    job: dict[str, Any]  # the resolved JobConfig, as JSON-able data
    run_id: str
    run_dir: str
    trace_id: str = field(default_factory=lambda: uuid.uuid4().hex)  # the run's, kept by every resume
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])  # this launch's (new per resume)
    python_path: list[str] = field(default_factory=list)  # where task.target is imported from
    threads: int = 1  # intra-op threads per worker
    attempt: int = 0  # launches of this run: 1 for `run`, +1 for each `scaletrain resume`
    node_rank: int = 0  # several nodes: this launcher's (0: the driver, which tracks the run)
    checkpoints: str | None = None  # where checkpoints go, resolved by the launcher
    # Where a worker on another machine than the driver's writes (its logs, rank 0's outputs
    # until they are relayed); None: the run directory itself (same machine, or shared).
    local_dir: str | None = None
    # The launcher's git state (tracking/git_state.py) for the run card: a worker never runs
    # git itself, since a subprocess started while a DataLoader forks its workers can wait
    # on them for good (the fork inherits the subprocess's status pipe).
    git: dict[str, Any] | None = None

    @property
    def out_dir(self) -> Path:
        """Where this process writes the run's files: the run directory, or its local stand-in."""
        return Path(self.local_dir or self.run_dir)

    @property
    def logs_dir(self) -> Path:
        return self.out_dir / LOGS_DIR

    @property
    def launcher_log(self) -> Path:
        return self.logs_dir / LAUNCHER_LOG

    def worker_log(self, rank: int) -> Path:
        return self.logs_dir / worker_log_name(rank)

    def worker_error(self, rank: int) -> Path:
        return self.logs_dir / worker_error_name(rank)

    def worker_stacks(self, rank: int) -> Path:
        return self.logs_dir / worker_stacks_name(rank)

    def worker_step(self, rank: int) -> Path:
        return self.logs_dir / worker_step_name(rank)

    @property
    def telemetry_dir(self) -> Path:
        return self.logs_dir / TELEMETRY_DIR

    def worker_result(self) -> Path:
        """This node's result, written by its first worker (rank 0's on the driver)."""
        return self.logs_dir / NODE_RESULT_FILE

    def write(self) -> Path:
        """Save the spec in the run directory, for engines that start workers as commands.

        The unredacted job: a new file readable by its owner only (never a symlink followed,
        never an old file's mode kept), renamed into place whole, since it is what
        ``scaletrain resume`` starts from; never logged as an artifact."""
        path = Path(self.run_dir) / SPEC_FILE
        write_text_atomic(path, json.dumps(asdict(self), indent=2))  # a new file, mode 0600
        return path

    @classmethod
    def read(cls, path: str | os.PathLike) -> RunSpec:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        for key in _RETIRED_FIELDS:  # a run started by an older version still resumes
            data.pop(key, None)
        return cls(**data)

    @classmethod
    def in_dir(cls, job: dict[str, Any], run_root: str | os.PathLike, run_id: str | None = None,
               **kwargs: Any) -> RunSpec:
        run_id = run_id or new_run_id()
        run_dir = Path(run_root) / job["name"] / run_id
        return cls(job=job, run_id=run_id, run_dir=str(run_dir.resolve()), **kwargs)


