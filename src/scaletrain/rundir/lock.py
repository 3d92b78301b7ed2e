"""The lock a launcher holds on the run directory it uses."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from scaletrain.errors import ScaletrainError
from scaletrain.rundir.names import LOCK_FILE

__all__ = ["RunLock", "RunInUse"]


class RunInUse(ScaletrainError):
    """Another launcher holds the run directory: nothing was changed."""

    exit_code = 2
    code = "ST-RUN-IN-USE"


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
            os.ftruncate(self._fd, 0)  # no holder named: the next one's refusals wait for its name
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
    """Who holds the lock, as its file says. A holder that has just taken it may not have
    written its name yet: the file is then empty, or still names a holder that died without
    releasing it (a process of this host that is gone); wait a little for the new name."""
    found: dict[str, Any] = {}
    for _ in range(50):
        try:
            data = json.loads(os.pread(fd, 4096, 0) or b"null")
        except ValueError:
            data = None
        if isinstance(data, dict):
            found = data
            if not _gone(data):
                return data
        time.sleep(0.01)
    return found


def _gone(holder: dict[str, Any]) -> bool:
    """The named holder is a process of this host that no longer exists."""
    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname() or not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's: it exists
        return False
    return False
