"""The run directory and what a launcher hands every worker (RunSpec): plain data, so any engine
(local, Ray) can ship it; the lock a launcher holds on the directory it uses. A leaf:
launchers, workers, the tracking process and the checkpoint tools all read it, and it imports
nothing of scaletrain but its errors."""

from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import socket
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from scaletrain.errors import ConfigError, ScaletrainError

__all__ = ["RunSpec", "new_run_id", "check_run_ref", "RunLock", "RunInUse", "LOCK_FILE"]

LOCK_FILE = ".lock"
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
        """Save the spec in the run directory, for engines that start workers as commands.

        The unredacted job: a new file readable by its owner only (never a symlink followed,
        never an old file's mode kept), renamed into place whole, since it is what
        ``scaletrain resume`` starts from; never logged as an artifact."""
        path = Path(self.run_dir) / "spec.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".spec.json.", suffix=".tmp", dir=path.parent)  # 0600
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(json.dumps(asdict(self), indent=2))
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)  # replaces a symlink itself, not its target
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)  # the rename itself survives a power cut
        finally:
            os.close(directory)
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


class RunInUse(ScaletrainError):
    """Another launcher holds the run directory: nothing was changed."""

    exit_code = 2


class RunLock:
    """An exclusive ``flock`` on ``<run dir>/.lock``, held by the launcher that uses the run
    directory for its whole life: a second launch of the run (a resume while it runs, two
    resumes at once) is refused instead of sweeping, overwriting and journaling over the first.
    The kernel drops the lock when its process dies, however it dies: no stale lock. The file
    names its holder, for the refusal; it is never inherited by workers (close-on-exec)."""

    def __init__(self, run_dir: str | os.PathLike, run_id: str, node_rank: int = 0):
        self.path = Path(run_dir) / LOCK_FILE
        self.run_id, self.node_rank = run_id, node_rank
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        if self._fd is not None:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:  # not ours to write, or a symlink put in its place
            raise RunInUse(f"run {self.run_id}: cannot lock {self.path}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise RunInUse(self._refusal(holder)) from None
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "node_rank": self.node_rank,
                  "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # the lock goes with the last descriptor
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _refusal(self, holder: dict[str, Any]) -> str:
        who = f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}"
        theirs = holder.get("node_rank", self.node_rank)
        if theirs != self.node_rank:  # several nodes writing one shared run directory
            return (
                f"run {self.run_id}: its directory {self.path.parent} is in use by node {theirs}'s "
                f"launcher ({who}); on a shared filesystem give each node its own run directory "
                "(--set run_dir=runs-node-N)"
            )
        return f"run {self.run_id} is in use by {who}; wait for it or stop it"


def _holder(fd: int) -> dict[str, Any]:
    """Who holds the lock, as its file says (it may not have written it yet: then {})."""
    for _ in range(20):
        try:
            data = json.loads(os.pread(fd, 4096, 0) or b"null")
        except ValueError:
            data = None
        if isinstance(data, dict):
            return data
        time.sleep(0.01)
    return {}
